"""The prep task carries its uncached-token estimate into the pending item (the item's last
field, schedulers/store/lua/prelude.lua): the next turn of a conversation is counted as mostly
cached, a new prompt of the same size in full. Real pieces: the prep task, the Redis store,
``fleet sim`` counting the tokens."""

from __future__ import annotations

import uuid
from typing import Any

import redis

from fleet.core.keys import Keys, job_ref
from fleet.core.signing import sign
from fleet.worker.runtime import Runtime
from fleet.worker.tasks import prep_job

from .test_continuations import rt, sim

__all__ = ["rt", "sim"]


def prepare(rt: Runtime, messages: list[dict[str, Any]]) -> tuple[int, int]:
    """(prompt tokens, uncached tokens) of the job's pending item."""
    job_id = uuid.uuid4().hex[:12]
    raw = {"id": job_id, "project": "reports", "messages": messages}
    assert prep_job(rt, "reports", job_id, sign(raw, "reports", rt.settings.projects["reports"].secret)) == "pending"
    client: redis.Redis = rt.redis
    item = client.hget(Keys(rt.settings.key_prefix).dispatch + "items", job_ref("reports", job_id))
    fields = (item.decode() if isinstance(item, bytes) else str(item)).split(" ")
    return int(fields[3]), int(fields[13])


def test_the_next_turn_is_mostly_cached_and_a_new_prompt_is_not(rt: Runtime) -> None:
    block = rt.settings.backend.block_tokens
    document = " ".join(f"line {n} of the shared document." for n in range(1_200))
    first = [{"role": "user", "content": f"Read this:\n{document}"}]
    prompt, uncached = prepare(rt, first)
    assert prompt > 3 * block and uncached == prompt  # nothing of it was sent before
    turn = [*first, {"role": "assistant", "content": "Read."}, {"role": "user", "content": "Summarise it."}]
    prompt2, uncached2 = prepare(rt, turn)
    assert uncached2 == prompt2 - prompt // block * block < block
    other = [{"role": "user", "content": f"Read this instead:\n{document.replace('line', 'row')}"}]
    prompt3, uncached3 = prepare(rt, other)
    assert uncached3 == prompt3 > 3 * block
