"""The usage ledger on a real Redis: a turn counts once whatever resends it, a new fence is a new
turn, hours keep their TTL, and the readers (``fleet usage``'s rows, the gateway's buckets) add
up what was counted."""

from __future__ import annotations

import csv
import io
import json
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime

import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.cli.usage import render_csv, render_json, usage_rows
from fleet.core.config import UsageSettings
from fleet.core.keys import Keys
from fleet.core.usage import HourCounts, TurnUsage, UsageLedger, hour_of
from fleet.core.usagereport import buckets, totals
from fleet.infer.turnusage import TurnProgress, turn_usage
from fleet.infer.vllm import StreamResult

# 10:15 UTC three days ago (within any retention; the ledger reads nothing older than that)
T0 = (time.time() // 86_400 - 3) * 86_400 + 10 * 3600 + 15 * 60
DAY = datetime.fromtimestamp(T0, UTC).strftime("%Y-%m-%d")


def _turn(job: str = "j1", fence: int = 1, turn: int = 1, **kw: object) -> TurnUsage:
    base: dict = {"project": "a", "job_id": job, "fence": fence, "turn": turn, "code": "OK",
                  "prompt_tokens": 100, "cached_tokens": 40, "reasoning_tokens": 30,
                  "answer_tokens": 12, "ended_at": T0}
    return TurnUsage(**{**base, **kw})


def _ledger(client: redis.Redis, prefix: str, seen: list[TurnUsage] | None = None) -> UsageLedger:
    return UsageLedger(client, Keys(prefix), UsageSettings(retention_days=400),
                       on_count=seen.append if seen is not None else None)


def test_a_turn_counts_once_and_a_new_fence_is_a_new_turn(redis_client, key_prefix):
    seen: list[TurnUsage] = []
    ledger = _ledger(redis_client, key_prefix, seen)
    assert ledger.count([_turn(), _turn()]) == 1  # the same turn twice in one pipeline
    assert ledger.count([_turn()]) == 0  # resent later
    assert ledger.count([_turn(fence=2)]) == 1  # redelivered: a new request to vLLM
    assert len(seen) == 2  # the Prometheus hook fires for counted turns only
    key = Keys(key_prefix).usage_hour("a", hour_of(T0))
    fields = {k.decode(): int(v) for k, v in redis_client.hgetall(key).items()}
    assert fields == {"queue|local|requests": 2, "queue|local|prompt_tokens": 200,
                      "queue|local|cached_tokens": 80, "queue|local|reasoning_tokens": 60,
                      "queue|local|answer_tokens": 24, "queue|local|code:OK": 2}
    assert 399 * 86_400 < redis_client.ttl(key) <= 400 * 86_400


def test_concurrent_resends_count_once(redis_client, key_prefix):
    ledger = _ledger(redis_client, key_prefix)
    counted: list[int] = []
    turns = [_turn(job=f"j{i}") for i in range(20)]

    def resend() -> None:
        counted.append(ledger.count(turns))

    threads = [threading.Thread(target=resend) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(counted) == 20
    assert totals(ledger.read("a", T0 - 3600, T0 + 3600))["requests"] == 20


def test_loop_cuts_tool_rounds_and_cut_turns_have_their_fields(redis_client, key_prefix):
    ledger = _ledger(redis_client, key_prefix)
    ledger.count([_turn(job="loop", code="E_THINK_LOOP", cut=True, answer_tokens=0),
                  _turn(job="tool", tool_round=True, key="sha256:abcd0123", model="m2")])
    summed = totals(ledger.read("a", T0 - 10, T0 + 10))
    assert summed["loop_cuts"] == 1 and summed["loop_cut_tokens"] == 30
    assert summed["cut_turns"] == 1 and summed["tool_rounds"] == 1
    assert summed["code:E_THINK_LOOP"] == 1 and summed["code:OK"] == 1
    cells = ledger.read("a", T0 - 10, T0 + 10)
    assert {(c.key, c.model) for c in cells} == {("queue", "local"), ("sha256:abcd0123", "m2")}


def test_rows_by_hour_day_key_and_model(redis_client, key_prefix):
    ledger = _ledger(redis_client, key_prefix)
    ledger.count([_turn(job="h10"), _turn(job="h11", ended_at=T0 + 3600, key="sha256:00ff00ff"),
                  _turn(job="h11b", ended_at=T0 + 3600, model="other")])
    now = T0 + 3600
    by_hour = usage_rows(ledger, ["a"], "hour", 1, now=now)
    assert [(r["period"], r["requests"]) for r in by_hour] == [(f"{DAY}T10:00Z", 1),
                                                               (f"{DAY}T11:00Z", 2)]
    by_day = usage_rows(ledger, ["a"], "day", 1, now=now)
    assert sum(r["requests"] for r in by_day) == 3 and sum(r["prompt_tokens"] for r in by_day) == 300
    by_key = {r["key"]: r["requests"] for r in usage_rows(ledger, ["a"], "key", 1, now=now)}
    assert by_key == {"queue": 2, "sha256:00ff00ff": 1}
    by_model = {r["model"]: r["codes"] for r in usage_rows(ledger, ["a"], "model", 1, now=now)}
    assert by_model == {"local": {"OK": 2}, "other": {"OK": 1}}
    assert usage_rows(ledger, ["b"], "hour", 1, now=now) == []  # another project: its own hashes
    parsed = list(csv.DictReader(io.StringIO(render_csv(by_key_rows := usage_rows(ledger, ["a"], "key", 1, now=now)))))
    assert [row["key"] for row in parsed] == ["queue", "sha256:00ff00ff"]
    assert json.loads(render_json(by_key_rows))[0]["answer_tokens"] == 24


def test_buckets_cover_the_range_and_split_by_group(redis_client, key_prefix):
    ledger = _ledger(redis_client, key_prefix)
    ledger.count([_turn(job="x"), _turn(job="y", key="sha256:11112222")])
    start = int(T0) // 86_400 * 86_400
    day = buckets(ledger.read("a", start, start + 2 * 86_400), start, start + 2 * 86_400, 86_400, ["key"])
    assert [len(b.groups) for b in day] == [2, 0]  # the empty day is there, with no results
    assert sorted(g.key or "" for g in day[0].groups) == ["queue", "sha256:11112222"]


def test_what_a_turn_counts_from_its_stream():
    served = StreamResult(content="hello", reasoning="think", first_token_s=0.1, usage={
        "prompt_tokens": 50, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": 32},
        "completion_tokens_details": {"reasoning_tokens": 15}})
    turn = turn_usage("a", "j", 3, 1, "OK", served, counted_prompt=49)
    assert (turn.prompt_tokens, turn.cached_tokens, turn.reasoning_tokens, turn.answer_tokens,
            turn.cut) == (50, 32, 15, 5, False)
    # cut mid-stream: the fleet's prompt count (a token came back) and the deltas it received
    cut = StreamResult(reasoning="a" * 40, reasoning_deltas=12, first_token_s=0.1)
    turn = turn_usage("a", "j", 3, 1, "E_THINK_LOOP", cut, counted_prompt=49)
    assert (turn.prompt_tokens, turn.reasoning_tokens, turn.answer_tokens, turn.cut) == (49, 12, 0, True)
    # refused before any token: a request, no tokens
    refused = turn_usage("a", "j", 3, 1, "E_UPSTREAM_ERROR", StreamResult(), counted_prompt=49)
    assert (refused.prompt_tokens, refused.reasoning_tokens, refused.cut) == (0, 0, True)
    assert refused.fields() == {"queue|local|requests": 1, "queue|local|cut_turns": 1,
                                "queue|local|code:E_UPSTREAM_ERROR": 1}


def test_a_turn_whose_worker_died_is_counted_once_from_its_last_progress(redis_client, key_prefix):
    keys = Keys(key_prefix)
    ledger = _ledger(redis_client, key_prefix)
    progress = TurnProgress("a", "j9", fence=4, model="local")
    progress.start(1, prompt_tokens=300)
    assert progress.snapshot() is None  # no token yet: nothing to leave
    progress.seen("x" * 400, "")
    progress.seen("y" * 40, "")
    seen = progress.snapshot()
    assert seen is not None and seen.reasoning_tokens == 110  # 440 characters, 2 deltas
    ledger.checkpoint(seen)
    assert ledger.settle("a", "j9", fence=4) is False  # its own grant: still streaming
    assert ledger.settle("a", "j9", fence=5) is True  # the next grant: the worker died
    assert ledger.settle("a", "j9", fence=6) is False  # counted once, entry gone
    assert redis_client.get(keys.usage_open("a", "j9")) is None
    summed = totals(ledger.read("a", time.time() - 60, time.time() + 60))
    assert (summed["requests"], summed["crashed_turns"], summed["cut_turns"], summed["prompt_tokens"],
            summed["reasoning_tokens"], summed["crashed_tokens"]) == (1, 1, 1, 300, 110, 110)
    assert summed["code:E_STREAM_DROPPED"] == 1


def test_a_turn_that_ends_removes_its_own_progress_only(redis_client, key_prefix):
    keys = Keys(key_prefix)
    ledger = _ledger(redis_client, key_prefix)
    progress = TurnProgress("a", "j7", fence=2, model="local")
    progress.start(1, prompt_tokens=10)
    progress.seen("think", "")
    ledger.checkpoint(progress.snapshot())  # type: ignore[arg-type]
    ledger.count([_turn(job="j7", fence=1)])  # an older grant's late count: not its entry
    assert redis_client.get(keys.usage_open("a", "j7")) is not None
    assert 0 < redis_client.ttl(keys.usage_open("a", "j7")) <= 86_400
    ledger.count([_turn(job="j7", fence=2)])  # the turn itself ends: counted, entry gone
    assert redis_client.get(keys.usage_open("a", "j7")) is None
    assert ledger.settle("a", "j7", fence=3) is False
    # a dead turn settled, then its worker's own late count (the same marker) adds nothing
    ledger.checkpoint(replace(progress.snapshot(), fence=8))  # type: ignore[type-var]
    assert ledger.settle("a", "j7", fence=9) is True
    assert ledger.count([_turn(job="j7", fence=8)]) == 0


def test_prometheus_counts_what_the_ledger_counted(redis_client, key_prefix):
    from prometheus_client import generate_latest

    from fleet.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    ledger = UsageLedger(redis_client, Keys(key_prefix), UsageSettings(retention_days=400),
                         on_count=metrics.observe_turn)
    ledger.count([_turn(), _turn(job="loop", code="E_THINK_LOOP")])
    ledger.count([_turn()])  # resent: not counted again, here either
    text = generate_latest(metrics.registry).decode()
    assert 'fleet_usage_turns_total{code="OK",project="a"} 1.0' in text
    assert 'fleet_usage_turns_total{code="E_THINK_LOOP",project="a"} 1.0' in text
    assert 'fleet_usage_tokens_total{kind="prompt",project="a"} 200.0' in text
    assert 'fleet_usage_tokens_total{kind="cached",project="a"} 80.0' in text
    assert 'fleet_usage_tokens_total{kind="loop_cut",project="a"} 42.0' in text


@settings(max_examples=200, deadline=None)
@given(hours=st.lists(st.tuples(st.integers(0, 96), st.sampled_from(["queue", "sha256:00000001"]),
                                st.sampled_from(["local", "m2"]), st.integers(1, 50)), max_size=30),
       start_h=st.integers(0, 96), span_h=st.integers(1, 96), daily=st.booleans(),
       group_by=st.sampled_from([(), ("key",), ("model",), ("key", "model")]))
def test_buckets_add_up_to_the_cells_they_cover(hours, start_h, span_h, daily, group_by) -> None:  # type: ignore[no-untyped-def]
    base = 1_764_547_200  # a UTC midnight
    cells = [HourCounts(base + h * 3600, key, model, {"requests": n, f"code:{key}": n})
             for h, key, model, n in hours]
    start, end = base + start_h * 3600 + 600, base + (start_h + span_h) * 3600
    width = 86_400 if daily else 3600
    made = buckets(cells, start, end, width, group_by)
    assert [b.start for b in made] == list(range(start - start % width, end, width))
    covered = [c for c in cells if start - start % 3600 <= c.start < end]
    summed: dict[str, int] = {}
    for bucket in made:
        pairs = [(g.key, g.model) for g in bucket.groups]
        assert len(pairs) == len(set(pairs))  # one group per (key, model) asked for
        for group in bucket.groups:
            assert (group.key is None) == ("key" not in group_by)
            for name, n in group.counts.items():
                summed[name] = summed.get(name, 0) + n
    assert summed == {k: v for k, v in totals(covered).items() if v}


def test_an_unreadable_progress_entry_is_dropped_not_fatal(redis_client, key_prefix):
    keys = Keys(key_prefix)
    ledger = _ledger(redis_client, key_prefix)
    for junk in ("not json", '{"fence": 1}', "[1, 2]"):
        redis_client.set(keys.usage_open("a", "bad"), junk)
        assert ledger.settle("a", "bad", fence=2) is False
        assert redis_client.get(keys.usage_open("a", "bad")) is None
    redis_client.set(keys.usage_open("a", "bad"), "not json")
    assert ledger.count([_turn(job="bad")]) == 1  # the script drops it and counts the turn
    assert redis_client.get(keys.usage_open("a", "bad")) is None


def test_an_api_key_tag_counts_only_with_the_workers_seal_and_on_its_own_job() -> None:
    from fleet.core.config import EXAMPLE_CONFIG, load_settings
    from fleet.core.seal import key_tag, tagged_key

    settings = load_settings(EXAMPLE_CONFIG, env={})
    other = settings.model_copy(update={"security": settings.security.model_copy(
        update={"worker_secret": "another-workers-key-0123456789"})})
    tag = key_tag(settings, "a/j1", "sha256:0123abcd")
    assert tagged_key(settings, "a/j1", tag) == "sha256:0123abcd"
    assert tagged_key(settings, "a/j2", tag) is None  # moved to another job of the project
    assert tagged_key(settings, "b/j1", tag) is None  # or of another project
    assert tagged_key(settings, "a/j1", {**tag, "api_key": "sha256:ffffffff"}) is None  # relabelled
    assert tagged_key(settings, "a/j1", key_tag(other, "a/j1", "sha256:0123abcd")) is None  # forged
    assert tagged_key(settings, "a/j1", {"api_key": "sha256:0123abcd"}) is None  # unsealed
    assert tagged_key(settings, "a/j1", {}) is None


def test_a_repeat_tag_holds_only_with_the_workers_seal_and_on_its_own_job() -> None:
    """The exact-repeat cache's tag in a queue job's record (fleet/worker/repeats.py): a producer
    may write its job hash, so a tag it moved, relabelled or made itself names no entry."""
    from fleet.core.config import EXAMPLE_CONFIG, load_settings
    from fleet.core.seal import repeat_tag, tagged_repeat

    settings = load_settings(EXAMPLE_CONFIG, env={})
    other = settings.model_copy(update={"security": settings.security.model_copy(
        update={"worker_secret": "another-workers-key-0123456789"})})
    digest = "ab" * 32
    tag = repeat_tag(settings, "a/j1", digest)
    assert tagged_repeat(settings, "a/j1", tag) == digest
    assert tagged_repeat(settings, "a/j2", tag) is None
    assert tagged_repeat(settings, "b/j1", tag) is None
    assert tagged_repeat(settings, "a/j1", {**tag, "rcache": "cd" * 32}) is None
    assert tagged_repeat(settings, "a/j1", repeat_tag(other, "a/j1", digest)) is None
    assert tagged_repeat(settings, "a/j1", {"rcache": digest}) is None


def test_prometheus_counts_the_reasoning_a_final_attempt_continued():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from fleet.core.models import Attempt, Envelope
    from fleet.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    cut = Attempt(number=1, code="E_STREAM_DROPPED", backend="a")
    done = Attempt(number=2, code="OK", backend="b", continued_tokens=1500)
    metrics.observe(Envelope(job_id="j1", project="p", code="OK", attempts=[cut, done]))
    metrics.observe(Envelope(job_id="j2", project="p", code="OK", attempts=[Attempt(number=1, code="OK", backend="a")]))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    samples = [(s.labels, s.value) for s in families["fleet_worker_continued_tokens"].samples
               if s.name.endswith("_total")]
    assert samples == [({"project": "p", "backend": "b"}, 1500.0)]  # the final attempt's, its backend
