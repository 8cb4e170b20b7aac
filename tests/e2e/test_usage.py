"""The usage ledger in a real fleet: ``fleet sim``, a dispatcher, two inference workers and
``fleet gateway`` as processes on the test Redis.

Kill storm: every job's first request stalls mid-reasoning (``[sim:stall=.../1]``), both inference
workers are killed with ``kill -9`` while they stream (once each stream's progress is in the
ledger: the lease keeper records it at every renewal), two new ones start, the jobs' leases
expire (``lease_ttl_s`` 3 s) and every job runs again under a new fence and ends OK. Then every
request the simulator saw is one turn in the ledger (8 = 8), its prompt tokens equal the
simulator's prompt counter (each prompt once), the finished turns' completion tokens equal the
simulator's per-request histogram of finished requests exactly, and the killed turns count what
their workers had seen (an estimate from the deltas: 379 of the 400 tokens the simulator
generated for them, measured).

Gateway: a project reads its own usage with its API key in OpenAI's bucket shape; another
project's key never sees it, whatever it asks for; ``fleet usage`` prints the same figures.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.core.apikeys import digest
from fleet.core.codes import Code
from fleet.core.usage import UsageLedger, key_label
from fleet.core.usagereport import totals
from fleet.worker.queues import INFER_TASK
from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import METRICS_AUTH, config_with_keys
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CAP = 4
SIM_ARGS = ["--think-min-tokens", "100", "--think-max-tokens", "300",
            "--answer-min-tokens", "10", "--answer-max-tokens", "40"]
QUEUED = ("reports", "triage")  # the kill storm's projects; the gateway tests use two others


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("fleet-usage"),
        backend={"max_num_seqs": CAP},
        admission={"lease_ttl_s": 3, "backend_gate": False},
        timeouts={"idle_s": 120},  # the stalled streams wait for the kill, not for a timeout
    )
    with Harness(config, sim_speed=100, sim_args=SIM_ARGS, workers=2, gateway=True) as harness:
        yield harness, keys


@pytest.fixture
def probe(fleet: tuple[Harness, dict[str, str]]) -> FleetProbe:
    return FleetProbe(fleet[0])


def _sim_finished(harness: Harness) -> dict[str, float]:
    """The simulator's own histograms of FINISHED requests (count, prompt and generation sums)."""
    text = httpx.get(f"{harness.backend_url}/metrics", timeout=10).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count",
                               "vllm:request_generation_tokens_sum"):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def _ledger_totals(harness: Harness, projects: tuple[str, ...]) -> dict[str, int]:
    ledger = UsageLedger(harness.client.redis, harness.client.keys, harness.settings.usage)
    now = time.time()
    summed: dict[str, int] = {}
    for project in projects:
        for name, value in totals(ledger.read(project, now - 7200, now + 3600)).items():
            summed[name] = summed.get(name, 0) + value
    return summed


def _progress_entries(harness: Harness, ids: list[str]) -> int:
    keys, client = harness.client.keys, harness.client.redis
    return int(client.exists(*[keys.usage_open(QUEUED[n % 2], job_id) for n, job_id in enumerate(ids)]))


def _streaming_workers(probe: FleetProbe) -> dict[str, int]:
    found: dict[str, int] = {}
    for hostname, tasks in (probe.active_tasks() or {}).items():
        found[hostname] = sum(1 for t in tasks if t["name"] == INFER_TASK)
    return found


def test_after_a_kill_storm_the_ledger_equals_what_the_simulator_finished(
        fleet: tuple[Harness, dict[str, str]], probe: FleetProbe) -> None:
    harness, _ = fleet
    sim_before, stats_before = _sim_finished(harness), probe.sim_stats()
    ledger_before = _ledger_totals(harness, QUEUED)
    ids = [harness.client.submit({
        "project": QUEUED[n % 2], "thinking_budget": 2000, "content_reserve": 256,
        "messages": [{"role": "user", "content": f"Storm {n} {uuid.uuid4().hex[:6]}: "
                                                 "[sim:stall=1000000/1] [sim:think=200] [sim:answer=20]"}]})
        for n in range(CAP)]
    wait_until(lambda: probe.sim_stats()["running"] == CAP, 60, "every job streaming")
    wait_until(lambda: sum(_streaming_workers(probe).values()) == CAP, 60, "the workers to report their streams")
    wait_until(lambda: _progress_entries(harness, ids) == CAP, 30, "each stream's progress in the ledger")
    for name, process in list(harness.fleet.children):
        if name.startswith("worker-"):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    for n in (7, 8):
        harness.fleet.spawn(f"worker-{n}", ["worker", "--concurrency", "8", "--hostname",
                                            f"fleet-{n}-{os.getpid()}@%h", "--log-level", "WARNING"])
    envelopes = {job_id: harness.client.result(job_id, timeout=120) for job_id in ids}
    assert {j: e.code if e else None for j, e in envelopes.items()} == dict.fromkeys(ids, Code.OK)

    sim_after, stats_after = _sim_finished(harness), probe.sim_stats()
    finished = {name: sim_after[name] - sim_before.get(name, 0.0) for name in sim_after}
    sim = {name: stats_after[name] - stats_before[name]
           for name in ("total_requests", "aborted", "prompt_tokens", "generation_tokens")}
    ledger = {name: n - ledger_before.get(name, 0) for name, n in _ledger_totals(harness, QUEUED).items()}
    assert sim["aborted"] == CAP  # the killed turns
    # every request vLLM saw is one turn in the ledger: the killed ones counted by the jobs'
    # next turns from their last progress entry, the others by their own end
    assert ledger["requests"] == sim["total_requests"] == 2 * CAP
    assert ledger["crashed_turns"] == ledger["cut_turns"] == ledger["code:E_STREAM_DROPPED"] == CAP
    assert ledger["code:OK"] == CAP
    assert ledger["prompt_tokens"] == sim["prompt_tokens"]  # each prompt once, as vLLM counts it
    # the finished turns exactly as vLLM's per-request histograms; the killed ones as the
    # workers saw them before they died (an estimate from the deltas received)
    assert (ledger["reasoning_tokens"] + ledger["answer_tokens"] - ledger["crashed_tokens"]
            == finished["vllm:request_generation_tokens_sum"])
    killed = sim["generation_tokens"] - finished["vllm:request_generation_tokens_sum"]
    # exactly: every chunk carried the server's running count (continuous_usage_stats), and the
    # streams had stalled with everything generated received; so the ledger is the simulator's
    assert ledger["crashed_tokens"] == killed, (ledger, killed)
    assert ledger["reasoning_tokens"] + ledger["answer_tokens"] == sim["generation_tokens"]
    # fleet usage (a real CLI process) prints the same figures
    shown = probe.cli("usage", "--by", "model", "--json")
    assert shown.returncode == 0, shown.stderr
    rows = [row for row in json.loads(shown.stdout) if row["project"] in QUEUED]
    assert sum(row["requests"] for row in rows) == ledger_before.get("requests", 0) + 2 * CAP
    assert sum(row["prompt_tokens"] for row in rows) == ledger_before.get("prompt_tokens", 0) + ledger["prompt_tokens"]


def _usage(harness: Harness, key: str, **params: object) -> httpx.Response:
    url = f"http://127.0.0.1:{harness.settings.gateway.port}/v1/organization/usage/completions"
    return httpx.get(url, params=params, headers={"Authorization": f"Bearer {key}"}, timeout=10)


def _summed(results: list[dict]) -> dict:
    """The results of several buckets as one (their numbers added, the rest from the first)."""
    summed = {**results[0], "fleet": {**results[0]["fleet"], "codes": {}}}
    for name in ("input_tokens", "output_tokens", "num_model_requests"):
        summed[name] = sum(r[name] for r in results)
    for name in ("loop_cuts", "loop_cut_tokens", "cut_turns"):
        summed["fleet"][name] = sum(r["fleet"][name] for r in results)
    for result in results:
        for code, n in result["fleet"]["codes"].items():
            summed["fleet"]["codes"][code] = summed["fleet"]["codes"].get(code, 0) + n
    return summed


def test_a_project_reads_its_own_usage_over_the_gateway_and_no_other(
        fleet: tuple[Harness, dict[str, str]], probe: FleetProbe) -> None:
    harness, keys = fleet
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{harness.settings.gateway.port}/v1",
                           api_key=keys["research"], max_retries=0)
    text = f"Reconcile ledger {uuid.uuid4().hex}. [sim:loop/1] [sim:think=30] [sim:answer=8]"
    answer = client.chat.completions.create(model="local", messages=[{"role": "user", "content": text}],
                                            extra_body={"loop_retry": True})
    assert answer.usage is not None
    start = int(time.time()) - 3600
    page = _usage(harness, keys["research"], start_time=start, bucket_width="1h",
                  group_by=["api_key_id", "model"])
    assert page.status_code == 200, page.text
    body = page.json()
    assert body["object"] == "page" and body["has_more"] is False
    results = [r for bucket in body["data"] for r in bucket["results"]]
    assert {r["api_key_id"] for r in results} == {key_label(digest(keys["research"]))}
    mine = _summed(results)  # one bucket, or two when the request crossed an hour
    # the loop cut turn (the gateway's watcher) and the answered one: two model requests
    assert mine["num_model_requests"] == 2 and mine["fleet"]["loop_cuts"] == 1
    assert mine["fleet"]["codes"] == {"E_THINK_LOOP": 1, "OK": 1} and mine["fleet"]["cut_turns"] == 1
    assert mine["fleet"]["loop_cut_tokens"] > 0 and mine["model"] == "local"
    # the answered turn's own figures are vLLM's, as the client got them; the cut one adds its prompt
    assert mine["input_tokens"] == 2 * answer.usage.prompt_tokens  # the cut one: the gateway's exact count
    assert mine["output_tokens"] == answer.usage.completion_tokens + mine["fleet"]["loop_cut_tokens"]
    # another project's key sees its own (empty) ledger, whatever it names
    for params in ({}, {"project_ids": "research"}, {"api_key_ids": mine["api_key_id"]}):
        other = _usage(harness, keys["translate"], start_time=start, bucket_width="1h", **params)
        assert other.status_code == 200
        assert [r for b in other.json()["data"] for r in b["results"]] == [], params
    # the gateway's Prometheus counters saw the same turns
    metrics = httpx.get(f"http://127.0.0.1:{harness.settings.gateway.port}/metrics",
                        headers=METRICS_AUTH, timeout=10).text
    assert 'fleet_usage_turns_total{code="E_THINK_LOOP",project="research"} 1.0' in metrics


@pytest.mark.parametrize(("params", "param"), [
    ({}, "start_time"),
    ({"start_time": "soon"}, "start_time"),
    ({"start_time": 100, "bucket_width": "1m"}, "bucket_width"),
    ({"start_time": 100, "group_by": "user_id"}, "group_by"),
    ({"start_time": 100, "user_ids": "u"}, "user_ids"),
    ({"start_time": 100, "bucket_width": "1h", "limit": 169}, "limit"),
    ({"start_time": 100, "end_time": 50}, "start_time"),
])
def test_a_bad_usage_query_is_a_coded_400(fleet: tuple[Harness, dict[str, str]], params: dict,
                                          param: str) -> None:
    harness, keys = fleet
    answer = _usage(harness, keys["research"], **params)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == (Code.E_INPUT_INVALID.value, param)


def test_usage_pages_through_its_buckets(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, keys = fleet
    now = int(time.time())
    first = _usage(harness, keys["translate"], start_time=now - 5 * 3600, end_time=now,
                   bucket_width="1h", limit=2).json()
    assert len(first["data"]) == 2 and first["has_more"] is True
    rest = _usage(harness, keys["translate"], start_time=now - 5 * 3600, end_time=now,
                  bucket_width="1h", limit=24, page=first["next_page"]).json()
    starts = [b["start_time"] for b in first["data"] + rest["data"]]
    assert starts == sorted(set(starts)) and len(starts) == 6 and rest["has_more"] is False
    assert all(b["end_time"] - b["start_time"] == 3600 for b in rest["data"])
    # a span of decades (or one past year 9999) makes only one page of buckets
    ancient = _usage(harness, keys["translate"], start_time=0, bucket_width="1h").json()
    assert len(ancient["data"]) == 24 and ancient["next_page"] == str(24 * 3600)
    future = 10**13 - 10**13 % 3600
    far = _usage(harness, keys["translate"], start_time=future, end_time=future + 7200, bucket_width="1h")
    assert far.status_code == 200 and [b["results"] for b in far.json()["data"]] == [[], []]
    unauth = httpx.get(f"http://127.0.0.1:{harness.settings.gateway.port}/v1/organization/usage/completions",
                       params={"start_time": 1}, timeout=10)
    assert unauth.status_code == 401 and unauth.json()["error"]["code"] == Code.E_AUTH.value


def test_tasks_and_batch_lines_count_under_the_key_that_sent_them(
        fleet: tuple[Harness, dict[str, str]]) -> None:
    """A task (``/v1/tasks``) and a batch's lines run as queue jobs; the gateway tags each with
    its caller's key (sealed), so their turns count under that key, not under ``queue``."""
    harness, keys = fleet
    key = keys["assistant"]
    url = f"http://127.0.0.1:{harness.settings.gateway.port}/v1"
    headers = {"Authorization": f"Bearer {key}"}
    made = httpx.post(f"{url}/tasks", headers=headers, timeout=10, json={
        "messages": [{"role": "user", "content": "A task. [sim:think=20] [sim:answer=5]"}]})
    assert made.status_code == 200, made.text
    task = made.json()["id"]
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    lines = [{"custom_id": f"l{n}", "messages": [
        {"role": "user", "content": f"Line {n}. [sim:think=20] [sim:answer=5]"}]} for n in range(2)]
    uploaded = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_until(lambda: httpx.get(f"{url}/tasks/{task}", headers=headers, timeout=10).json()["status"] == "final",
               120, "the task to end", every_s=0.2)
    wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", 120, "the batch", every_s=0.2)
    page = _usage(harness, key, start_time=int(time.time()) - 86_400, bucket_width="1d", group_by="api_key_id")
    results = [r for b in page.json()["data"] for r in b["results"]]
    assert {r["api_key_id"] for r in results} == {key_label(digest(key))}  # none under "queue"
    assert sum(r["num_model_requests"] for r in results) == 3
