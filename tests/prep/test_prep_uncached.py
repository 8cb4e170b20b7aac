"""The prep task carries its uncached-token estimate into the pending item (the item's last
field, schedulers/store/lua/prelude.lua), and only what the inference worker actually sent counts
as cached: the next turn of a conversation is counted as mostly cached once the earlier turn ran,
a new prompt of the same size in full, and so is every job sharing a new prefix while none of
them was sent yet, or one whose look-alike was cancelled before it ran. Real pieces: the prep
task, the Redis store, the inference task, ``fleet sim`` counting the tokens."""

from __future__ import annotations

import time

import redis

from fleet.core.seal import sign_cancel
from fleet.worker.jobs.cancel import cancel_job
from fleet.worker.jobs.infer import infer_job
from fleet.worker.runtime import Runtime
from tests.support.worker_runtime import DOCUMENT, admit, prepare, run


def test_the_next_turn_is_mostly_cached_once_the_first_ran_and_a_new_prompt_is_not(rt: Runtime) -> None:
    block = rt.settings.backend.block_tokens
    first = [{"role": "user", "content": f"Read this:\n{DOCUMENT}"}]
    ref, prompt, uncached = prepare(rt, first)
    assert prompt > 3 * block and uncached == prompt  # nothing of it was sent before
    run(rt, ref)
    turn = [*first, {"role": "assistant", "content": "Read."}, {"role": "user", "content": "Summarise it."}]
    _, prompt2, uncached2 = prepare(rt, turn)
    assert uncached2 == prompt2 - prompt // block * block < block
    other = [{"role": "user", "content": f"Read this instead:\n{DOCUMENT.replace('line', 'row')}"}]
    _, prompt3, uncached3 = prepare(rt, other)
    assert uncached3 == prompt3 > 3 * block


def test_jobs_sharing_a_new_prompt_count_in_full_until_one_of_them_is_sent(rt: Runtime) -> None:
    """Prepared is not sent: before, the second job counted the first one's prompt as cached at
    prep already, so a batch sharing a new long prompt all bypassed the long-prefill limit."""
    block = rt.settings.backend.block_tokens
    first = [{"role": "user", "content": f"Read this:\n{DOCUMENT}"}]
    turn = [*first, {"role": "assistant", "content": "Read."}, {"role": "user", "content": "And?"}]
    ref, prompt, _ = prepare(rt, first)
    _, prompt2, uncached2 = prepare(rt, turn)
    assert uncached2 == prompt2  # the first job's prompt is only prepared, not sent
    _, _, uncached_again = prepare(rt, first)
    assert uncached_again == prompt
    run(rt, ref)
    _, prompt4, uncached4 = prepare(rt, turn)
    assert uncached4 == prompt4 - prompt // block * block


def test_a_cancelled_job_never_counts_as_cached(rt: Runtime, redis_client: redis.Redis) -> None:
    first = [{"role": "user", "content": f"Read this:\n{DOCUMENT}"}]
    ref, prompt, _ = prepare(rt, first)
    project, job_id = ref.split("/", 1)
    redis_client.set(rt.keys.cancel(ref), sign_cancel(project, job_id, rt.settings.projects[project].secret))
    assert cancel_job(rt, project, job_id) == "cancelled"
    _, prompt2, uncached2 = prepare(rt, first)
    assert uncached2 == prompt2 == prompt


def test_an_attempt_the_server_refused_does_not_count(rt: Runtime) -> None:
    refused = [{"role": "user", "content": f"Read this: [sim:http500/1]\n{DOCUMENT}"}]
    ref, prompt, _ = prepare(rt, refused)
    assert infer_job(rt, ref, "reports", admit(rt, ref, time.time())) == "continued"  # a 500, no token
    _, _, uncached = prepare(rt, refused)
    assert uncached == prompt


def test_an_untrusted_jobs_leading_system_messages_never_count_as_another_jobs(rt: Runtime) -> None:
    """On the wire the first system message carries the data note with the job's own fence tag,
    so nothing after it is byte-identical to another job's prompt. Before, the stable prefix was
    recorded by the plain system messages: a second untrusted job with the same two leading
    system messages counted them as cached (a 12K-token prompt estimated at a few hundred)."""
    block = rt.settings.backend.block_tokens
    leading = [{"role": "system", "content": "Be brief."},
               {"role": "system", "content": f"Reference:\n{DOCUMENT}"}]
    ref, prompt, uncached = prepare(rt, [*leading, {"role": "user", "content": "first text",
                                                    "untrusted": True}])
    assert uncached == prompt > 3 * block
    run(rt, ref)
    _, prompt2, uncached2 = prepare(rt, [*leading, {"role": "user", "content": "another text",
                                                    "untrusted": True}])
    assert uncached2 == prompt2


def test_a_trusted_jobs_stable_prefix_counts_once_it_was_sent(rt: Runtime) -> None:
    block = rt.settings.backend.block_tokens
    leading = [{"role": "system", "content": "Be brief."},
               {"role": "system", "content": f"Reference:\n{DOCUMENT}"}]
    ref, prompt, _ = prepare(rt, [*leading, {"role": "user", "content": "What is line 3?"}])
    run(rt, ref)
    _, prompt2, uncached2 = prepare(rt, [*leading, {"role": "user", "content": "And line 9?"}])
    assert prompt2 - prompt // block * block <= uncached2 < prompt2 - 3 * block
