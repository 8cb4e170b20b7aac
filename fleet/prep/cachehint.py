"""How many of a prepared prompt's tokens will miss vLLM's prefix cache: the prefill's real cost.

The dispatcher's quiet long prefills and its prefill bucket (schedulers/policy/limits.py) count
``uncached_tokens``, so a 40K-token prompt that repeats what its project sent a minute ago (the
next turn of a conversation, a re-ask, the same report with a new question at the end) is not
throttled like a 60K-token prompt nobody sent before.

vLLM's prefix cache reuses whole KV blocks of a prompt's leading tokens that an earlier request
computed and that were not evicted since. The fleet cannot see the server's cache, but it knows
what each project SENT (fleet/core/promptcache.py: the inference worker records each request it
sent, and its stable prefix, once an attempt that sent them got a token back, kept for
``backend.prefix_cache_s``), keyed by the request as it went on the wire. A new prompt's cached
part is the longest record among its leading parts (tools, then one chained digest per message:
one lookup each, laid out as the inference worker will send it): an earlier prompt, or a stable
prefix, byte-identical to the start of this one. That count is rounded down to whole KV blocks;
the rest is ``uncached_tokens``. Projects are kept apart: a project's prompts only ever match its own,
sent under its own ``cache_salt`` (fleet/core/seal.py). Projects sharing a ``cache_group`` share
the server's cache but not these records: a prompt another member sent counts in full (on the
safe side).

Several backends: each has a cache of its own, and the records say which one a prompt went to.
The estimate is made on every backend the job may run on (one MGET for them all); the backend
with the most cached whole blocks is the job's *hint*, and the job's uncached tokens are its
misses there. Admission counts them on the hint backend only (the whole prompt on any other) and
routes the job there while its load is near the least loaded one's
(schedulers/policy/placement.py ``pick``).

Only a prompt the server computed counts, never one that was merely prepared: N jobs sharing a
new long prompt, prepared before the first one's attempt ended, all count it in full, and a
cancelled, refused or never-run job counts for nothing. The estimate is made once, at prep, and the
dispatcher admits later; it is not re-estimated at admission (that would cost a lookup per
candidate in the admission script and the digests in every pending item). So it is conservative
in one direction only: a prompt counted in full may find its prefix cached by the time it runs
(a batch sharing a new prompt: each of them is treated as a long prefill and waits for a quiet
window of its own), while a prompt counted as cached is cached unless the server evicted the
blocks meanwhile (a busy pool, a restart).

One round trip per job (an MGET of the lookups, every backend's); nothing is written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.core.models import Job
from fleet.core.promptcache import backend_tag, chained_digests
from fleet.core.request import build_request_messages
from fleet.core.seal import cache_salt
from fleet.prep.prepare import Prepared


@dataclass(frozen=True)
class CacheEstimate:
    """A prepared prompt's expected prefix-cache misses (``uncached_tokens``) on ``hint``: the
    backend expected to hold its longest cached prefix (its index in the settings' order), kept
    only when the job may run on more than one (None: none holds any, or there is no choice)."""

    uncached_tokens: int
    hint: int | None = None


def _cached(values: list[bytes | str | None], prompt_tokens: int, block_tokens: int) -> int:
    """The tokens a backend's records (one per leading part; None: no record) say are cached, in
    whole blocks of ``block_tokens``."""
    seen = [int(v) for v in values if v is not None]
    return min(max(seen, default=0), prompt_tokens) // block_tokens * block_tokens


def estimate_uncached(
    client: redis.Redis,
    keys: Keys,
    project: str,
    *,
    wire: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    salt: str,
    prompt_tokens: int,
    block_tokens: int,
    remember_s: float,
    backend: str | None = None,
) -> int:
    """The prompt tokens expected to miss the prefix cache of one backend (``backend``: its
    ``promptcache.backend_tag``), by what the project sent there under ``salt``."""
    if remember_s <= 0:
        return prompt_tokens
    lookups = [keys.sent(project, d, backend) for d in chained_digests(wire, tools, salt)]
    if not lookups:
        return prompt_tokens
    return prompt_tokens - _cached(client.mget(lookups), prompt_tokens, block_tokens)


def estimate_routed(
    client: redis.Redis,
    keys: Keys,
    settings: Settings,
    project: str,
    *,
    wire: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    salt: str,
    prompt_tokens: int,
    eligible: int,
) -> CacheEstimate:
    """The estimate on every backend of the mask ``eligible`` at once (one MGET): the backend
    with the most cached whole blocks (the first of equals) is the hint, and its misses are the
    job's uncached tokens; with no record anywhere, the whole prompt and no hint."""
    entries = [(i, entry) for i, entry in enumerate(settings.backends)
               if (eligible >> i) & 1 and entry.prefix_cache_s > 0]
    digests = chained_digests(wire, tools, salt)
    if not entries or not digests:
        return CacheEstimate(prompt_tokens)
    lookups = [keys.sent(project, d, backend_tag(settings, entry.name)) for _, entry in entries for d in digests]
    values = client.mget(lookups)
    hint, most = None, 0
    for n, (i, entry) in enumerate(entries):
        cached = _cached(values[n * len(digests):(n + 1) * len(digests)], prompt_tokens, entry.block_tokens)
        if cached > most:
            hint, most = i, cached
    choice = eligible & (eligible - 1) != 0  # more than one backend
    return CacheEstimate(prompt_tokens - most, hint if choice else None)


def uncached_of(
    client: redis.Redis, keys: Keys, settings: Settings, ready: Job, prepared: Prepared, *,
    tools: list[dict[str, Any]] | None, eligible: int = 1,
) -> CacheEstimate:
    """``estimate_routed`` for a prepared job (``ready``: the job with its prepared messages)
    that may run on the backends of ``eligible``, its messages as fleet/infer/attempts.py sends
    them (the fence tag prep drew) with ``tools``, those its turns send (fleet/infer/tools.py
    ``as_sent``)."""
    wire, _ = build_request_messages(ready, prepared.fence_tag)
    return estimate_routed(
        client, keys, settings, ready.project, wire=wire, tools=tools,
        salt=cache_salt(settings, ready.project), prompt_tokens=prepared.prompt_tokens, eligible=eligible,
    )
