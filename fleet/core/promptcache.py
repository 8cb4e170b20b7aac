"""What a project sent to the backend recently, by digest: the facts behind the uncached-token
estimate (fleet/prep/cachehint.py), written only once the server has computed a prompt.

Two kinds of ``{p}sent:{<project>}:<sha256>`` keys (value: token count; TTL
``backend.prefix_cache_s``, the time vLLM's prefix cache is assumed to keep a prompt's blocks):

* the project's stable prefix (the prepared job's leading system messages: the project's system
  prompt, then the job's own), by ``prefix_digest``, with ``Plan.prefix_tokens``;
* the whole prepared prompt, by the last of ``chained_digests`` of its message list as prep laid
  it out for vLLM (tools first, then each message; untrusted parts fenced with the job's own tag),
  with ``Plan.prompt_tokens``.

``record_sent`` writes both when the server computed the prompt: the inference attempt
(fleet/infer/attempts.py) queues them with the attempt's history entry, in that one round trip,
once the attempt produced at least one token (its prefill is done, its blocks are in the cache);
every such attempt renews the time. Nothing is written at prep, nor for an attempt the server
refused or never answered: a prepared prompt may wait in line, be cancelled or never run, and
until the server has computed it none of its blocks is cached. So a prompt counts as cached from
the end of the attempt that sent it (a job sharing it that is prepared while that attempt still
runs counts it in full: on the safe side). Prep only reads (``chained_digests`` of the new prompt,
one lookup per leading part).

Failure cases: a Redis error while recording is a Redis error of the inference task (the job goes
back in line, as for its history entry); a retry whose note changes the system message still
records the prompt as prep laid it out (that is what later prompts are looked up by; the note's
blocks are the retry's own, after the shared ones only when the note comes last); a gateway
request (fleet/gateway) records nothing, so later prompts never count what a gateway client sent
as cached (on the safe side).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import redis

from fleet.core.keys import Keys
from fleet.core.models import Job, Message


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


def leading_system(job: Job) -> list[Message]:
    """The job's system messages before its first other message (of a prepared job: its stable
    prefix, which prep lays out first)."""
    count = 0
    for message in job.messages:
        if message.role != "system":
            break
        count += 1
    return job.messages[:count]


def record_sent(
    pipe: redis.client.Pipeline,
    keys: Keys,
    project: str,
    *,
    wire: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    prompt_tokens: int,
    prefix: list[Message],
    prefix_tokens: int,
    remember_s: float,
) -> None:
    """Queue on ``pipe`` (the caller executes it) that ``project`` sent this prompt and its stable
    prefix to the backend."""
    if remember_s <= 0:
        return
    ttl = max(1, round(remember_s))
    digests = chained_digests(wire, tools)
    if digests:
        pipe.set(keys.sent(project, digests[-1]), prompt_tokens, ex=ttl)
    stable = prefix_digest(prefix)
    if stable and prefix_tokens > 0:
        pipe.set(keys.sent(project, stable), prefix_tokens, ex=ttl)
