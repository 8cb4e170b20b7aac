"""What an operator sees of a real fleet: Celery events (Flower) with each job's final code, worker
/metrics, fleet-wide figures exported once by two dispatchers, ``fleet top``, and job ids on the log
lines about jobs."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.cli.top import WINDOW_S
from fleet.core.codes import Code
from fleet.core.config import load_settings
from fleet.core.keys import Keys
from fleet.core.models import Envelope, Timings, Usage
from fleet.core.results import ResultStore
from fleet.local.embedded import free_port
from schedulers.store import make_store
from schedulers.store.base import PendingItem
from tests.support.fleet_harness import TEST_BROKER, FleetProbe, Harness, make_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


class EventLog:
    """Every Celery event the fleet sends (what Flower reads), captured on a thread."""

    def __init__(self, app: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self._conn = app.connection_for_read()
        self._receiver = app.events.Receiver(self._conn, handlers={"*": self.events.append})
        self._thread = threading.Thread(target=self._receiver.capture, daemon=True,
                                        kwargs={"limit": None, "timeout": None, "wakeup": False})
        self._thread.start()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e.get("type") == kind]

    def close(self) -> None:
        self._receiver.should_stop = True
        self._thread.join(timeout=10)
        self._conn.release()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    config = make_config(tmp_path_factory.mktemp("ops"), admission={"metrics_port": free_port()})
    harness = Harness(config, sim_speed=100)
    harness.fleet.extra_env["FLEET_WORKER_METRICS_PORT"] = str(free_port())
    with harness:
        yield harness


@pytest.fixture(scope="module")
def events(fleet: Harness) -> Iterator[EventLog]:
    log = EventLog(fleet.client._celery)
    # subscribed once anything arrives: workers send a heartbeat every few seconds
    wait_until(lambda: log.events, 60, "a first Celery event")
    yield log
    log.close()


def ask(project: str, text: str) -> dict[str, Any]:
    return {"project": project, "messages": [{"role": "user", "content": text}],
            "thinking_budget": 2000}


def scrape(port: int | str) -> dict[str, Any]:
    """{family name: family} of one process's /metrics, parsed by prometheus_client."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample_sum(families: dict[str, Any], sample: str, **labels: str) -> float:
    return sum(s.value for f in families.values() for s in f.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_task_events_carry_the_final_code_and_the_job(fleet: Harness, events: EventLog) -> None:
    client = fleet.client
    good = client.submit(ask("triage", "[sim:think=50] [sim:answer=10] fine"))
    bad = client.submit_raw({"id": "bad1", "project": "triage", "messages": "not a list"},
                            project="triage", job_id="bad1")
    slow = client.submit(ask("reports", "[sim:stall=100000] wait forever"))
    wait_until(lambda: client.status(slow).get("state") == "running", 60, "the slow job to run")
    client.cancel(slow)
    codes = {j: client.result(j, timeout=120).code for j in (good, bad, slow)}
    assert codes == {good: Code.OK, bad: Code.E_INPUT_INVALID, slow: Code.E_CANCELLED}

    def finished() -> list[dict[str, Any]] | None:
        done = events.of("task-succeeded") + events.of("task-failed")
        return done if len(done) >= 6 else None  # prep x3 (two hand over) + cancel + infer x2

    wait_until(finished, 60, "the task events")
    received = {e["uuid"]: e for e in events.of("task-received")}
    shown = {}
    for e in events.of("task-succeeded") + events.of("task-failed"):
        kwargs = received[e["uuid"]]["kwargs"]
        assert "not a list" not in kwargs and "sim:think" not in kwargs  # no job text in Flower
        shown[(received[e["uuid"]]["name"], e["type"])] = e.get("result") or e.get("exception")
    assert "E_INPUT_INVALID job=bad1" in shown[("fleet.prep", "task-failed")]
    assert "E_CANCELLED job=" + slow in shown[("fleet.infer", "task-failed")]
    assert f"OK job={good}" in shown[("fleet.infer", "task-succeeded")]
    assert {e["kwargs"] for e in received.values() if e["name"] == "fleet.infer"} == {
        f"project=triage job={good}", f"project=reports job={slow}"}
    # a task that ended with a non-OK code is acknowledged, not left to be delivered again
    unacked = f"{fleet.settings.key_prefix}q:unacked"
    wait_until(lambda: client.redis.hlen(unacked) == 0, 30, "no unacknowledged task")
    assert len(received) == len({e["uuid"] for e in events.of("task-received")}) == 6  # with the cancel


def test_worker_metrics_count_what_it_published(fleet: Harness) -> None:
    client = fleet.client
    ids = [client.submit(ask("assistant", f"[sim:think=80] [sim:answer=20] question {n}"))
           for n in range(3)]
    envelopes = [client.result(j, timeout=120) for j in ids]
    assert all(e.code == Code.OK for e in envelopes)
    families = scrape(fleet.fleet.extra_env["FLEET_WORKER_METRICS_PORT"])
    one = {"project": "assistant"}
    assert sample_sum(families, "fleet_worker_results_total", code="OK", **one) == 3
    expected = {"prompt": sum(e.usage.prompt_tokens for e in envelopes),
                "reasoning": sum(e.usage.reasoning_tokens for e in envelopes),
                "answer": sum(e.usage.completion_tokens - e.usage.reasoning_tokens for e in envelopes)}
    for kind, tokens in expected.items():
        assert sample_sum(families, "fleet_worker_tokens_total", kind=kind, **one) == tokens > 0
    assert sample_sum(families, "fleet_worker_attempts_count", **one) == 3
    assert sample_sum(families, "fleet_worker_attempts_sum", **one) == sum(len(e.attempts) for e in envelopes)
    assert sample_sum(families, "fleet_worker_ttft_seconds_count", **one) == 3
    assert sample_sum(families, "fleet_worker_latency_seconds_sum", **one) == pytest.approx(
        sum(e.timings.total_s or 0 for e in envelopes))


def test_two_dispatchers_export_fleet_wide_figures_once(fleet: Harness) -> None:
    ports = [fleet.settings.admission.metrics_port, free_port()]
    fleet.fleet.spawn("dispatcher-extra", ["dispatcher", "--log-level", "WARNING"],
                      {"FLEET_ADMISSION_METRICS_PORT": str(ports[1])})
    job = fleet.client.submit(ask("translate", "[sim:think=20] [sim:answer=5] after the second"))
    assert fleet.client.result(job, timeout=120).code == Code.OK

    def both_up_one_leader() -> list[dict[str, Any]] | None:
        try:
            scraped = [scrape(p) for p in ports]
        except httpx.HTTPError:
            return None  # the second one is still starting
        leaders = sum(sample_sum(f, "fleet_metrics_leader") for f in scraped)
        return scraped if leaders == 1 else None

    scraped = wait_until(both_up_one_leader, 60, "both dispatchers up, one metrics leader")
    snap = FleetProbe(fleet).snapshot()
    assert sum(sample_sum(f, "fleet_dispatch_admissions_total") for f in scraped) == snap.admissions > 0
    codes = {k.decode(): int(v) for k, v in fleet.client.redis.hgetall(fleet.client.keys.code_counts).items()}
    assert sum(sample_sum(f, "fleet_results_total") for f in scraped) == sum(codes.values()) > 0
    # each still exports its own queue-wait histogram
    assert all("fleet_dispatch_queue_wait_seconds" in f for f in scraped)


def test_fleet_top_once_shows_pending_work(tmp_path: Path, redis_client: Any, key_prefix: str) -> None:
    """A store with jobs pending and no dispatcher to admit them, one finished job in the window."""
    config = make_config(tmp_path)
    settings = load_settings(config, env={}).model_copy(update={"key_prefix": key_prefix})
    store = make_store(settings, redis_client)
    for n in range(3):
        store.add_pending(PendingItem(job_id=f"p{n}", project="research", prompt_tokens=100,
                                      max_new_tokens=1000, band="batch", priority=0,
                                      enqueued_at=time.time(), deadline=None))
    results = ResultStore(redis_client, Keys(key_prefix), settings)
    results.publish(Envelope(job_id="done1", project="triage", code=Code.OK, content="x",
                             usage=Usage(prompt_tokens=10, completion_tokens=600),
                             timings=Timings(queued_s=2.0, total_s=9.0)))
    env = {**os.environ, "FLEET_CONFIG": str(config), "FLEET_KEY_PREFIX": key_prefix,
           "FLEET_BROKER_URL": TEST_BROKER, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "fleet", "top", "--once"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 6:  # ... and waiting (deferred jobs), last
            rows[cells[0]] = cells[1:5]  # pending, finished, mean wait s, tokens/s
    assert rows["research"][0] == "3"
    assert rows["triage"] == ["0", "1", "2.0", f"{600 / WINDOW_S:.1f}"]
    assert "in flight 0/32" in out.stdout and "backend" in out.stdout


def test_log_lines_about_jobs_name_the_job() -> None:
    """Every log call in the task and inference modules carries ``job=<id>``."""
    modules = [ROOT / "fleet" / "worker" / n for n in ("tasks.py", "lease.py")]
    modules += sorted((ROOT / "fleet" / "worker" / "jobs").glob("*.py"))
    modules += sorted((ROOT / "fleet" / "infer").glob("*.py"))
    missing = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "log"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and "job=" not in str(node.args[0].value)):
                missing.append(f"{path.name}:{node.lineno}")
    assert missing == []


def test_prep_backlog_shows_in_fleet_queues_and_metrics(
        tmp_path: Path, redis_client: Any, key_prefix: str) -> None:
    """Prep messages no worker has taken yet: Flower's broker page counts them, and so must the
    fleet's own views, beside the dispatcher store's pending jobs."""
    from rich.console import Console

    from fleet.cli.queues import queues_table
    from fleet.worker.app import create_app
    from fleet.worker.dispatch import PrepBacklogCollector
    from fleet.worker.queues import PREP_TASK

    settings = load_settings(make_config(tmp_path), env={}).model_copy(update={"key_prefix": key_prefix})
    app = create_app(settings)
    for n in range(2):
        app.send_task(PREP_TASK, kwargs={"project": "reports", "job_id": f"r{n}", "signed": {}})
    app.send_task(PREP_TASK, kwargs={"project": "reports", "job_id": "c1",
                                     "signed": {"job": {"sources": [{"path": "x"}]}}})
    app.close()
    console = Console(record=True, width=200)
    console.print(queues_table(settings, redis_client))
    rows = {cells[0]: cells for line in console.export_text().splitlines()
            if len(cells := [c.strip() for c in line.strip().strip("│").split("│")]) == 7}
    assert rows["reports"][6] == "3" and rows["triage"][6] == "0"  # the last column: prep queue
    family = next(iter(PrepBacklogCollector(settings, redis_client).collect()))
    assert {s.labels["project"]: s.value for s in family.samples}["reports"] == 3


def test_fleet_top_without_redis_says_so_in_one_line(tmp_path: Path) -> None:
    port = free_port()
    dead = f"redis://:secret-password@127.0.0.1:{port}/0"
    env = {**os.environ, "FLEET_CONFIG": str(make_config(tmp_path)), "FLEET_BROKER_URL": dead}
    out = subprocess.run([sys.executable, "-m", "fleet", "top", "--once"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith(f"{Code.E_BROKER_UNAVAILABLE.value} the broker at redis://:***@")
    assert str(port) in out.stderr and "secret-password" not in out.stderr


def test_metrics_leader_is_one_at_a_time_and_hands_over(redis_client: Any, key_prefix: str) -> None:
    from schedulers.metrics import LEADER_RENEW_S, MetricsLeader

    now = [0.0]
    key = Keys(key_prefix).metrics_leader
    a, b = (MetricsLeader(redis_client, key, clock=lambda: now[0]) for _ in range(2))
    assert a.renew() and not b.renew()
    now[0] += LEADER_RENEW_S
    assert a.renew() and not b.renew()  # the holder extends, the other keeps out
    a.release()
    assert not a.held
    now[0] += LEADER_RENEW_S
    assert b.renew() and not a.renew()


def test_a_busy_worker_metrics_port_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    import socket

    from prometheus_client import CollectorRegistry

    from schedulers.metrics import serve_registry

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level("WARNING", logger="schedulers.metrics"):
            assert serve_registry(CollectorRegistry(), port, "worker") is None
    assert f"metrics port {port} is in use (another worker on this host?)" in caplog.text
