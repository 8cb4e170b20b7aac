"""Broker loss is an ordinary event (docs/operations.md): a Redis of the test's own, with AOF
``everysec``, killed with ``kill -9`` and started again on the same port and folder while the REAL
fleet (``fleet sim``, a dispatcher, a worker of every role) runs a batch. The processes stay up,
reconnect by themselves, and every job ends with exactly one envelope."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.fleet_harness import FleetProbe, Harness, RestartableRedis, make_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

JOBS = 12
SIM_ARGS = ["--think-min-tokens", "200", "--think-max-tokens", "400",
            "--answer-min-tokens", "10", "--answer-max-tokens", "40"]


def test_workers_ride_out_a_redis_restart_and_every_job_ends_once(
        tmp_path, broker: RestartableRedis) -> None:
    config = make_config(tmp_path, broker_url=broker.url, backend={"max_num_seqs": 4},
                         admission={"lease_ttl_s": 3})
    with Harness(config, sim_speed=20, sim_args=SIM_ARGS) as fleet:
        probe = FleetProbe(fleet)
        ids = [fleet.client.submit({"project": "assistant", "id": f"loss-{n}",
                                    "messages": [{"role": "user", "content": f"question {n}"}]})
               for n in range(JOBS)]
        wait_until(lambda: probe.snapshot().in_flight > 0, 60, "a job in flight")
        fleet.client.redis.connection_pool.disconnect()
        broker.crash_and_restart()
        envelopes = {job_id: fleet.client.result(job_id, timeout=240) for job_id in ids}
        assert all(envelopes.values()), [j for j, e in envelopes.items() if e is None]
        assert not fleet.fleet.check(), "a process exited on the broker loss"
        counts = probe.envelope_counts()
        assert {job_id: counts[job_id] for job_id in ids} == dict.fromkeys(ids, 1)


def test_the_dispatcher_holds_while_no_inference_worker_is_live(tmp_path) -> None:
    """A prepared job is not admitted into a fleet.infer queue nobody consumes; the first
    inference worker to start runs it."""
    config = make_config(tmp_path, admission={"lease_ttl_s": 3})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, workers=0) as fleet:
        probe = FleetProbe(fleet)
        fleet.fleet.spawn("prep", ["worker", "--role", "prep", "--concurrency", "2",
                                   "--hostname", f"prep-{os.getpid()}@%h", "--log-level", "WARNING"])
        job_id = fleet.client.submit({"project": "assistant", "id": "held",
                                      "messages": [{"role": "user", "content": "anyone there?"}]})
        wait_until(lambda: probe.state(job_id) == "pending", 60, "the job prepared")
        # several dispatcher rounds passed the job over (admission.max_wait_s is 1 s)
        wait_until(lambda: probe.snapshot().holds.get("no_workers", 0) >= 3, 60,
                   "three dispatcher rounds to pass the job over (hold no_workers)")
        assert probe.snapshot().in_flight == 0
        assert probe.sim_requests(job_id) == []
        held = [line for line in fleet.fleet._tails["dispatcher-0"] if "no live inference worker" in line]
        assert len(held) == 1, list(fleet.fleet._tails["dispatcher-0"])
        fleet.fleet.spawn("infer", ["worker", "--role", "infer", "--concurrency", "4",
                                    "--hostname", f"infer-{os.getpid()}@%h", "--log-level", "WARNING"])
        envelope = fleet.client.result(job_id, timeout=120)
        assert envelope is not None and envelope.ok, envelope
        assert len(probe.sim_requests(job_id)) == 1


def test_fleet_batch_across_a_redis_restart_reports_every_line(
        tmp_path, broker: RestartableRedis) -> None:
    """The batch client rides out the restart: every line is written to --out as it arrives, and
    the same file collected again (--collect) or resumed (--resume) names the same jobs."""
    config = make_config(tmp_path, broker_url=broker.url, backend={"max_num_seqs": 4},
                         admission={"lease_ttl_s": 3})
    lines = [{"custom_id": f"q{n}", "messages": [{"role": "user", "content": f"question {n}"}]}
             for n in range(JOBS)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    with Harness(config, sim_speed=20, sim_args=SIM_ARGS) as fleet:
        probe = FleetProbe(fleet)
        batch = subprocess.Popen(
            [sys.executable, "-m", "fleet", "batch", str(src), "-p", "assistant", "--out", str(out),
             "--timeout", "240"], env={**fleet.fleet.env, "COLUMNS": "200"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_until(lambda: out.exists() and out.read_text().count("\n") >= 2, 120, "first results")
        broker.crash_and_restart()
        output, _ = batch.communicate(timeout=300)
        assert batch.returncode == 0, output
        rows = [json.loads(text) for text in out.read_text().splitlines()]
        assert sorted(r["custom_id"] for r in rows) == sorted(line["custom_id"] for line in lines)
        assert {r["code"] for r in rows} == {"OK"}, rows
        requests = len(probe.sim_requests())
        again = tmp_path / "again.jsonl"
        collected = probe.cli("batch", str(src), "-p", "assistant", "--collect", "--out", str(again))
        assert collected.returncode == 0, collected.stdout + collected.stderr
        assert sorted(json.loads(t)["id"] for t in again.read_text().splitlines()) == sorted(
            r["id"] for r in rows)
        resumed = probe.cli("batch", str(src), "-p", "assistant", "--resume", "--out", str(out))
        assert resumed.returncode == 0 and "submitted 0 of 0 lines" in resumed.stdout, resumed.stdout
        assert len(probe.sim_requests()) == requests  # nothing ran twice
        counts = probe.envelope_counts()
        assert all(counts[r["response"]["request_id"]] == 1 for r in rows)
