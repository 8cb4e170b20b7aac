"""How many of a prepared prompt's tokens will miss vLLM's prefix cache: the prefill's real cost.

The dispatcher's quiet long prefills and its prefill bucket (schedulers/policy/limits.py) count
``uncached_tokens``, so a 40K-token prompt that repeats what its project sent a minute ago (the
next turn of a conversation, a re-ask, the same report with a new question at the end) is not
throttled like a 60K-token prompt nobody sent before.

vLLM's prefix cache reuses whole KV blocks of a prompt's leading tokens that an earlier request
computed and that were not evicted since. The fleet cannot see the server's cache, but it knows
what each project sent, so it remembers, per project and for ``backend.prefix_cache_s``:

* the project's stable prefix (fleet/prep/prefix.py: system prompt and the job's leading system
  messages), by the digest of those messages, with its token count;
* every prepared prompt, by the digest of its whole message list as vLLM gets it (tools first,
  then each message; untrusted parts fenced with the job's own tag, which no other prompt shares),
  with its token count.

A new prompt's cached part is the longest of: the stable prefix, when the project sent it within
that time; an earlier prompt whose message list is a leading part of this one's (chained digests,
one per message: one lookup each). That count is rounded down to whole KV blocks; the rest is
``uncached_tokens``. An estimate, on the safe side of what the fleet saw: the server may have
evicted blocks meanwhile (a busy pool, a restart), and then a prompt counted as cached prefills in
full. Projects are kept apart: a project's prompts only ever match its own.

One pipelined round trip per job: the lookups and the two records (which renew the time).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import redis

from fleet.core.config import ProjectSettings, Settings
from fleet.core.keys import Keys
from fleet.core.models import Job, Message
from fleet.core.request import build_request_messages, tools_allowed
from fleet.prep.prefix import stable_prefix
from fleet.prep.prepare import Prepared


def _digest(previous: str, part: Any) -> str:
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{previous}\n{text}".encode()).hexdigest()


def chained_digests(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[str]:
    """One digest per leading part of ``messages`` (after the tools): [:1], [:2], ..."""
    digests, current = [], _digest("", tools or [])
    for message in messages:
        current = _digest(current, message)
        digests.append(current)
    return digests


def prefix_digest(prefix: list[Message]) -> str | None:
    return _digest("prefix", [m.to_openai() for m in prefix]) if prefix else None


def estimate_uncached(
    client: redis.Redis,
    keys: Keys,
    project: str,
    *,
    wire: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    prompt_tokens: int,
    prefix: list[Message],
    prefix_tokens: int,
    block_tokens: int,
    remember_s: float,
) -> int:
    """The prompt tokens expected to miss the prefix cache; records this prompt and its prefix."""
    if remember_s <= 0:
        return prompt_tokens
    digests = chained_digests(wire, tools)
    stable = prefix_digest(prefix)
    lookups = [keys.sent(project, d) for d in digests] + ([keys.sent(project, stable)] if stable else [])
    ttl = max(1, round(remember_s))
    pipe = client.pipeline(transaction=False)
    pipe.mget(lookups)
    if digests:
        pipe.set(keys.sent(project, digests[-1]), prompt_tokens, ex=ttl)
    if stable:
        pipe.set(keys.sent(project, stable), prefix_tokens, ex=ttl)
    found = pipe.execute()[0]
    seen = [int(v) for v in found if v is not None]
    cached = min(max(seen, default=0), prompt_tokens)
    return prompt_tokens - cached // block_tokens * block_tokens


def uncached_of(
    client: redis.Redis, keys: Keys, settings: Settings, project: ProjectSettings, job: Job,
    ready: Job, prepared: Prepared,
) -> int:
    """``estimate_uncached`` for a prepared job (``ready``: the job with its prepared messages),
    its messages as fleet/infer/attempts.py sends them (the fence tag prep drew)."""
    wire, _ = build_request_messages(ready, prepared.fence_tag)
    tools, _, _ = tools_allowed(ready, project)
    return estimate_uncached(
        client, keys, job.project, wire=wire, tools=tools, prompt_tokens=prepared.prompt_tokens,
        prefix=stable_prefix(project, job), prefix_tokens=prepared.prefix_tokens,
        block_tokens=settings.backend.block_tokens, remember_s=settings.backend.prefix_cache_s,
    )
