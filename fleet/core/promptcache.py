"""What a project sent to the backend recently, by digest: the facts behind the uncached-token
estimate (fleet/prep/cachehint.py), written only once the server has computed a prompt.

Every key is ``{p}sent:{<project>}:<sha256>`` (what went to the first backend) or
``{p}sent:{<project>}:<backend>:<sha256>`` (to another one, by its name: each server has a prefix
cache of its own, and routing prefers the one holding a prompt's prefix), one of
``chained_digests`` of a request exactly as
it went on the wire: the tools it carried, then its messages one by one (untrusted parts fenced
with the job's own tag, the data note and any retry note in the leading system message, the tool
rounds' conversation at the end). The value is a token count the server has computed at the start
of every prompt with those leading parts; the TTL is ``backend.prefix_cache_s`` (the time vLLM's
prefix cache is assumed to keep a prompt's blocks). ``record_sent`` writes, for one request:

* at its last digest, its prompt tokens as the server counted them (the usage chunk's
  ``prompt_tokens``); a stream cut before the usage chunk (the loop watcher) has that count only
  when the request is exactly the prompt prep counted (``Plan.prompt_tokens``), else the whole
  prompt is not recorded;
* at the digest of its stable prefix (the job's leading system messages: the project's system
  prompt, then the job's own), ``Plan.prefix_tokens`` (prep's count of those messages alone, at
  most what they take on the wire beside the tools), only when the request starts with exactly
  those messages: not for an untrusted job (the data note with the job's own fence tag goes into
  the first system message), nor a retry with a note (it goes there too).

Keyed by the wire, a record matches only a later prompt that is byte-identical up to that point,
under the same ``cache_salt`` (the chain starts from it: vLLM never serves a prompt blocks cached
under another salt, so neither does the estimate, and a project whose salt changed, a new
``cache_group`` or worker key, counts nothing of what it sent before), tools included (prep
looks a prompt up with the tools its turns will send: for a project that runs its tools, the
registry's definitions, fleet/infer/tools.py ``as_sent``).

The inference attempt (fleet/infer/attempts.py) queues the records with the attempt's history
entry, in that one round trip, once the attempt produced at least one token (its prefill is done,
its blocks are in the cache); every such attempt renews the time. Nothing is written at prep, nor
for an attempt the server refused or never answered: a prepared prompt may wait in line, be
cancelled or never run, and until the server has computed it none of its blocks is cached. So a
prompt counts as cached from the end of the attempt that sent it (a job sharing it that is
prepared while that attempt still runs counts it in full: on the safe side). Prep only reads
(``chained_digests`` of the new prompt, one lookup per leading part).

Failure cases: a Redis error while recording is a Redis error of the inference task (the job goes
back in line, as for its history entry). A gateway chat request (fleet/gateway/chat.py) records
its whole prompt (no stable prefix) once its stream ended with a first token, off the client's
path; a Redis error there is logged and nothing else happens (the next request counts its prompt
whole). A record's
count includes the closing template tokens of its last message (and, for a prompt, the assistant
header), which a longer prompt does not share: a few tokens too many, so the estimate can count
one block more than vLLM finds when they cross a block boundary.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import redis

from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.core.models import Job, Message


def _digest(previous: str, part: Any) -> str:
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{previous}\n{text}".encode()).hexdigest()


def chained_digests(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    salt: str) -> list[str]:
    """One digest per leading part of ``messages`` (after the salt and the tools): [:1], [:2], ..."""
    digests, current = [], _digest(salt, tools or [])
    for message in messages:
        current = _digest(current, message)
        digests.append(current)
    return digests


def backend_tag(settings: Settings, name: str | None = None) -> str | None:
    """The backend part of a record's key for the backend ``name`` (default: the settings'
    ``backend``, the one a turn streams to): None for the first backend (the keys of a
    one-backend fleet), else its name."""
    name = settings.backend.name if name is None else name
    return None if name == settings.backends[0].name else name


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
    salt: str,
    prompt_tokens: int | None,
    prefix: list[Message],
    prefix_tokens: int,
    remember_s: float,
    backend: str | None = None,
) -> None:
    """Queue on ``pipe`` (the caller executes it) that ``project`` sent the request ``wire`` with
    ``tools`` under ``salt`` (all as sent) to ``backend`` (``backend_tag``), of ``prompt_tokens``
    (None: not known, not recorded), and its stable ``prefix`` of ``prefix_tokens`` when the
    request starts with exactly those messages."""
    if remember_s <= 0:
        return
    ttl = max(1, round(remember_s))
    digests = chained_digests(wire, tools, salt)
    leading = [m.to_openai() for m in prefix]
    if leading and prefix_tokens > 0 and wire[: len(leading)] == leading:
        pipe.set(keys.sent(project, digests[len(leading) - 1], backend), prefix_tokens, ex=ttl)
    if digests and prompt_tokens:  # after the prefix: a prompt of only the prefix keeps its count
        pipe.set(keys.sent(project, digests[-1], backend), prompt_tokens, ex=ttl)
