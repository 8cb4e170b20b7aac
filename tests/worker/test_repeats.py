"""The queue job's digest for the exact-repeat cache (fleet/worker/repeats.py ``job_digest``): the
same for two submissions of one request whatever differs between them and never reaches vLLM as
such (the fence tag and the token counts it moves, the id, metadata, priority), different for
anything that changes what vLLM is asked (the schema in force, the sampling, the budget)."""

from __future__ import annotations

from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.models import Job
from fleet.core.request import new_fence_tag
from fleet.infer.budget import plan
from fleet.worker.repeats import job_digest

SETTINGS = load_settings(EXAMPLE_CONFIG, env={})


def _project(**changes: object):  # type: ignore[no-untyped-def]
    return SETTINGS.projects["research"].model_copy(update={"repeat_cache": SETTINGS.projects[
        "research"].repeat_cache.model_copy(update={"enabled": True}), **changes})


def _job(**fields: object) -> Job:
    base = {"project": "research", "temperature": 0,
            "messages": [{"role": "user", "content": "Summarise the pasted page.", "untrusted": False},
                         {"role": "user", "content": "<html>the page, from outside</html>", "untrusted": True}]}
    return Job.model_validate({**base, **fields})


def _digest(job: Job, prompt_tokens: int, project=None, fence: str | None = None) -> str | None:  # type: ignore[no-untyped-def]
    project = project or _project()
    return job_digest(project, "local", job, plan(job, project, SETTINGS, prompt_tokens), fence or new_fence_tag())


def test_two_submissions_of_one_untrusted_request_share_a_digest() -> None:
    first = _digest(_job(metadata={"n": 1}, priority=2), 812)
    again = _digest(_job(metadata={"n": 2}), 816)  # another fence tag: a few tokens more
    assert first is not None and first == again


def test_what_changes_the_request_changes_the_digest() -> None:
    base = _digest(_job(), 812)
    assert _digest(_job(thinking_budget=500), 812) != base
    assert _digest(_job(seed=3), 812) != base
    assert _digest(_job(response_schema={"type": "object"}), 812) != base
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    assert _digest(_job(), 812, project=_project(response_schema=schema)) != base  # the project's schema


def test_requests_that_sample_or_end_at_prep_are_not_looked_up() -> None:
    assert _digest(_job(temperature=0.7), 812) is None
    assert _digest(_job(kind="trim"), 812) is None
    off = SETTINGS.projects["research"]
    assert job_digest(off, "local", _job(), plan(_job(), off, SETTINGS, 812), new_fence_tag()) is None


def test_an_entry_this_version_cannot_read_is_a_miss(redis_client, key_prefix: str) -> None:  # type: ignore[no-untyped-def]
    """An entry written by another version (a field more, broken JSON, no envelope) is a miss at
    every step that reads one, never a failed job."""
    from fleet.core.config import RepeatCacheSettings
    from fleet.core.keys import Keys
    from fleet.core.repeatcache import Entry, RepeatCache
    from fleet.worker.repeats import served_envelope

    keys = Keys(key_prefix)
    cache = RepeatCache(redis_client, keys, "research", RepeatCacheSettings(enabled=True))
    redis_client.hset(keys.rcache("research", "e"), "d1", '{"content": "x", "newer_field": 1}')
    redis_client.hset(keys.rcache("research", "e"), "d2", "not json")
    assert cache.get("d1") is None and cache.get("d2") is None
    odd = Entry("", "", [], "stop", {}, "", 0.0, 10**10, extra={"envelope": {"code": "NOT_A_CODE"}})
    assert served_envelope(odd, _job(), []) is None
    assert served_envelope(Entry("", "", [], "stop", {}, "", 0.0, 10**10), _job(), []) is None
