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
safe side). There is one backend and no routing by prefix, so nothing else follows the salt.

Only a prompt the server computed counts, never one that was merely prepared: N jobs sharing a
new long prompt, prepared before the first one's attempt ended, all count it in full, and a
cancelled, refused or never-run job counts for nothing. The estimate is made once, at prep, and the
dispatcher admits later; it is not re-estimated at admission (that would cost a lookup per
candidate in the admission script and the digests in every pending item). So it is conservative
in one direction only: a prompt counted in full may find its prefix cached by the time it runs
(a batch sharing a new prompt: each of them is treated as a long prefill and waits for a quiet
window of its own), while a prompt counted as cached is cached unless the server evicted the
blocks meanwhile (a busy pool, a restart).

One round trip per job (an MGET of the lookups); nothing is written here.
"""

from __future__ import annotations

from typing import Any

import redis

from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.core.models import Job
from fleet.core.promptcache import chained_digests
from fleet.core.request import build_request_messages
from fleet.core.seal import cache_salt
from fleet.prep.prepare import Prepared


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
) -> int:
    """The prompt tokens expected to miss the prefix cache, by what the project sent under
    ``salt`` (its requests' ``cache_salt``)."""
    if remember_s <= 0:
        return prompt_tokens
    lookups = [keys.sent(project, d) for d in chained_digests(wire, tools, salt)]
    if not lookups:
        return prompt_tokens
    seen = [int(v) for v in client.mget(lookups) if v is not None]
    cached = min(max(seen, default=0), prompt_tokens)
    return prompt_tokens - cached // block_tokens * block_tokens


def uncached_of(
    client: redis.Redis, keys: Keys, settings: Settings, ready: Job, prepared: Prepared, *,
    tools: list[dict[str, Any]] | None,
) -> int:
    """``estimate_uncached`` for a prepared job (``ready``: the job with its prepared messages),
    its messages as fleet/infer/attempts.py sends them (the fence tag prep drew) with ``tools``,
    those its turns send (fleet/infer/tools.py ``as_sent``)."""
    wire, _ = build_request_messages(ready, prepared.fence_tag)
    return estimate_uncached(
        client, keys, ready.project, wire=wire, tools=tools,
        salt=cache_salt(settings, ready.project), prompt_tokens=prepared.prompt_tokens,
        block_tokens=settings.backend.block_tokens,
        remember_s=settings.backend.prefix_cache_s,
    )
