"""The uncached-token estimate (fleet/prep/cachehint.py) against a real Redis: what a project sent
recently (fleet/core/promptcache.py ``record_sent``) counts as cached in whole KV blocks, nothing
else does: in particular not a prompt that was only estimated (prepared), never sent."""

from __future__ import annotations

from typing import Any

import redis

from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.keys import Keys
from fleet.core.models import Job, Message
from fleet.core.promptcache import record_sent
from fleet.core.request import build_request_messages
from fleet.prep.cachehint import estimate_uncached, uncached_of
from fleet.prep.prepare import Prepared

SYSTEM = Message(role="system", content="You are the research assistant. " * 40)
BLOCK = 1_000


SALT = "salt-of-research"


def estimate(client: redis.Redis, keys: Keys, wire: list[dict[str, Any]], prompt: int,
             project: str = "research", remember_s: float = 600.0,
             tools: list[dict[str, Any]] | None = None, salt: str = SALT) -> int:
    return estimate_uncached(client, keys, project, wire=wire, tools=tools, salt=salt,
                             prompt_tokens=prompt, block_tokens=BLOCK, remember_s=remember_s)


def send(client: redis.Redis, keys: Keys, wire: list[dict[str, Any]], prompt: int,
         project: str = "research", prefix_tokens: int = 2_500, remember_s: float = 600.0,
         tools: list[dict[str, Any]] | None = None) -> None:
    pipe = client.pipeline(transaction=False)
    record_sent(pipe, keys, project, wire=wire, tools=tools, salt=SALT, prompt_tokens=prompt,
                prefix=[SYSTEM], prefix_tokens=prefix_tokens, remember_s=remember_s)
    pipe.execute()


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_the_next_turn_of_a_conversation_is_mostly_cached(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    first = [SYSTEM.to_openai(), user("the 25K-token code base ...")]
    assert estimate(redis_client, keys, first, 26_030) == 26_030  # nothing sent before
    send(redis_client, keys, first, 26_030)
    second = [*first, {"role": "assistant", "content": "answer"}, user("and now?")]
    assert estimate(redis_client, keys, second, 26_600) == 600  # 26 whole blocks cached
    send(redis_client, keys, second, 26_600)
    third = [*second, {"role": "assistant", "content": "more"}, user("and then?")]
    assert estimate(redis_client, keys, third, 40_200) == 40_200 - 26_000  # the longest match
    assert estimate(redis_client, keys, second, 26_600) == 600  # sent again: whole blocks only


def test_a_prompt_only_estimated_is_not_cached(redis_client: redis.Redis, key_prefix: str) -> None:
    """Before, the estimate recorded the prompt as sent: every job sharing a new prompt after the
    first one counted it as cached although none of them had reached the server."""
    keys = Keys(key_prefix)
    report = [SYSTEM.to_openai(), user("a 60K-token report nobody sent before ...")]
    assert [estimate(redis_client, keys, report, 60_118) for _ in range(3)] == [60_118] * 3
    send(redis_client, keys, report, 60_118)
    assert estimate(redis_client, keys, report, 60_118) == 118


def test_a_new_report_misses_all_but_the_stable_prefix(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    send(redis_client, keys, [SYSTEM.to_openai(), user("a short question")], 3_000)
    report = [SYSTEM.to_openai(), user("a 60K-token report nobody sent before ...")]
    assert estimate(redis_client, keys, report, 60_118) == 60_118 - 2_000  # 2 whole prefix blocks


def test_projects_never_match_each_others_prompts(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    wire = [SYSTEM.to_openai(), user("shared text")]
    send(redis_client, keys, wire, 30_000, project="research")
    assert estimate(redis_client, keys, [*wire, user("more")], 30_500, project="legal") == 30_500


def test_a_prompt_sent_under_another_salt_is_not_cached(redis_client: redis.Redis, key_prefix: str) -> None:
    """vLLM serves no block cached under another ``cache_salt``: neither does the estimate (a
    project whose cache group or worker key changed starts cold)."""
    keys = Keys(key_prefix)
    report = [SYSTEM.to_openai(), user("a 60K-token report ...")]
    send(redis_client, keys, report, 60_118)
    assert estimate(redis_client, keys, report, 60_118) == 118
    assert estimate(redis_client, keys, report, 60_118, salt="salt-of-a-new-group") == 60_118


def test_nothing_is_counted_cached_when_the_fleet_remembers_nothing(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    wire = [SYSTEM.to_openai(), user("q")]
    send(redis_client, keys, wire, 30_000)
    assert estimate(redis_client, keys, wire, 30_000, remember_s=0.0) == 30_000
    other = [SYSTEM.to_openai(), user("r")]
    send(redis_client, keys, other, 30_000, remember_s=0.0)  # not recorded
    assert estimate(redis_client, keys, other, 30_000) == 28_000  # the prefix, sent with `wire`


def test_untrusted_material_never_matches_another_jobs(redis_client: redis.Redis, key_prefix: str) -> None:
    """Each job fences untrusted text with its own tag, and the data note naming the tag goes into
    its first system message, so vLLM cannot reuse anything after it across jobs, and neither does
    the estimate. Before, the stable prefix was recorded by the plain system messages and counted
    for every later untrusted job, though on the wire it never matched."""
    settings = load_settings(EXAMPLE_CONFIG, env={})
    keys = Keys(key_prefix)
    messages = [SYSTEM, Message(role="user", content="material " * 9_000, untrusted=True)]
    job = Job(id="j1", project="research", messages=messages)
    found = []
    for tag in ("tag-one", "tag-two"):
        prepared = Prepared(messages, 40_000, True, [], prefix_tokens=4_000, fence_tag=tag)
        found.append(uncached_of(redis_client, keys, settings, job, prepared, tools=None).uncached_tokens)
        send(redis_client, keys, build_request_messages(job, tag)[0], 40_000, prefix_tokens=4_000)
    assert found == [40_000, 40_000]


def test_a_prefix_counts_only_beside_the_same_tools(redis_client: redis.Redis, key_prefix: str) -> None:
    """Tools are rendered with the system message: a prefix sent with tools is not the prefix of
    a prompt without them, nor with others."""
    keys = Keys(key_prefix)
    search = [{"type": "function", "function": {"name": "search_docs"}}]
    send(redis_client, keys, [SYSTEM.to_openai(), user("q")], 3_000, tools=search)
    report = [SYSTEM.to_openai(), user("a report")]
    assert estimate(redis_client, keys, report, 60_118) == 60_118
    other = [{"type": "function", "function": {"name": "fetch_page"}}]
    assert estimate(redis_client, keys, report, 60_118, tools=other) == 60_118
    assert estimate(redis_client, keys, report, 60_118, tools=search) == 60_118 - 2_000


def test_a_request_of_unknown_size_records_only_its_prefix(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    wire = [SYSTEM.to_openai(), user("q")]
    pipe = redis_client.pipeline(transaction=False)
    record_sent(pipe, keys, "research", wire=wire, tools=None, salt=SALT, prompt_tokens=None, prefix=[SYSTEM],
                prefix_tokens=2_500, remember_s=600.0)
    pipe.execute()
    assert estimate(redis_client, keys, wire, 30_000) == 28_000
