"""The persistence contract and the answers a producer gets about the broker (docs/operations.md):
unknown jobs are E_NOT_FOUND at once, a dead broker is one E_BROKER_UNAVAILABLE line in every
command, a submit rides out a Redis restart without a duplicate, and workers and dispatchers
check the broker's AOF and eviction policy at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.client import Client
from fleet.core.codes import Code
from fleet.core.config import load_settings
from fleet.core.errors import BrokerUnavailable, BrokerUnsafe, NotFound
from fleet.core.persistence import broker_risks, check_broker
from fleet.local.embedded import free_port
from fleet.worker.queues import project_queue
from tests.support.fleet_harness import RestartableRedis, make_config

JOB = {"project": "assistant", "messages": [{"role": "user", "content": "hello"}]}


def fleet_cli(config: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    return subprocess.run([sys.executable, "-m", "fleet", *args], capture_output=True, text=True,
                          timeout=120, env=clean | {"FLEET_CONFIG": str(config), "COLUMNS": "200"} | env)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    made = Client(load_settings(make_config(tmp_path), env={}))
    yield made
    made.close()


def test_an_unknown_job_is_not_found_at_once(client: Client) -> None:
    ref = "assistant/never-submitted"
    for call in (lambda: client.status(ref), lambda: client.result(ref, timeout=3600),
                 lambda: list(client.events(ref)), lambda: client.cancel(ref)):
        with pytest.raises(NotFound) as caught:
            call()
        assert caught.value.code == Code.E_NOT_FOUND


def test_a_job_whose_record_vanished_ends_the_wait(client: Client) -> None:
    """A Redis restarted without persistence forgets a job: result() says so instead of waiting."""
    job_id = client.submit({**JOB, "id": "forgotten"})
    client.redis.delete(client.keys.job(f"assistant/{job_id}"))
    with pytest.raises(NotFound):
        client.result(job_id, timeout=3600)


@pytest.mark.parametrize("args", [("status", "assistant/x"), ("tail", "assistant/x"),
                                  ("cancel", "assistant/x")])
def test_cli_unknown_job_is_one_line(tmp_path: Path, args: tuple[str, ...]) -> None:
    out = fleet_cli(make_config(tmp_path), *args)
    assert out.returncode == 1, out
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith("E_NOT_FOUND no job assistant/x"), out.stderr


@pytest.mark.parametrize("args", [("status", "assistant/x"), ("tail", "assistant/x"),
                                  ("cancel", "assistant/x"), ("queues",), ("top", "--once"),
                                  ("submit", "-p", "assistant", "hi"), ("rejections",)])
def test_cli_dead_broker_is_one_line(tmp_path: Path, args: tuple[str, ...]) -> None:
    dead = f"redis://:pw@127.0.0.1:{free_port()}/0"
    out = fleet_cli(make_config(tmp_path, broker_url=dead), *args)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("E_BROKER_UNAVAILABLE the broker at redis://:***@127.0.0.1")


def test_submit_rides_out_a_redis_restart_without_a_duplicate(tmp_path: Path) -> None:
    server = RestartableRedis()
    try:
        settings = load_settings(make_config(tmp_path, broker_url=server.url), env={})
        with Client(settings, retry_s=60) as client:
            os.kill(server.server.process.pid, 9)  # type: ignore[union-attr]
            server.server.process.wait()  # type: ignore[union-attr]
            restarter = threading.Timer(2.0, lambda: setattr(server, "server", server.start()))
            restarter.start()
            job_id = client.submit({**JOB, "id": "across"})
            restarter.join()
            assert client.status(job_id)["state"] == "submitted"
            queued = client.redis.llen(f"{settings.key_prefix}q:{project_queue('assistant')}")
            assert queued == 1
    finally:
        server.close()


def test_submit_to_a_dead_broker_gives_up_with_the_code(tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    settings = load_settings(make_config(tmp_path, broker_url=dead), env={})
    with Client(settings, retry_s=1) as client, pytest.raises(BrokerUnavailable) as caught:
        client.submit({**JOB, "id": "nowhere"})
    assert caught.value.code == Code.E_BROKER_UNAVAILABLE


def test_persistence_is_checked(tmp_path: Path, redis_url: str) -> None:
    """The suite's Redis keeps no AOF: a warning by default, a refusal when asked, nothing to say
    about a Redis with AOF and noeviction, and eviction named."""
    plain = redis.Redis.from_url(redis_url)
    warn = load_settings(make_config(tmp_path), env={})
    assert any("appendonly is off" in risk for risk in check_broker(warn, plain, role="worker",
                                                                      local_broker=False))
    refuse = warn.model_copy(update={"redis": warn.redis.model_copy(update={"on_unsafe": "refuse"})})
    with pytest.raises(BrokerUnsafe) as caught:
        check_broker(refuse, plain, role="worker", local_broker=False)
    assert caught.value.code == Code.E_BROKER_UNSAFE
    assert check_broker(refuse, plain, role="worker", local_broker=True)  # fleet up's own broker
    server = RestartableRedis()
    try:
        durable = redis.Redis.from_url(server.url)
        assert broker_risks(durable) == []
        durable.config_set("maxmemory-policy", "allkeys-lru")
        assert any("allkeys-lru" in risk for risk in broker_risks(durable))
    finally:
        server.close()


def test_a_dispatcher_refuses_an_unsafe_broker_in_one_line(tmp_path: Path) -> None:
    config = make_config(tmp_path, redis={"on_unsafe": "refuse"})
    out = fleet_cli(config, "dispatcher")
    assert out.returncode == 3, out
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("E_BROKER_UNSAFE dispatcher refuses to start")


def test_batch_checks_the_project_before_the_file(tmp_path: Path) -> None:
    out = fleet_cli(make_config(tmp_path), "batch", str(tmp_path / "missing.jsonl"), "-p", "nobody")
    assert out.returncode == 2, out
    assert out.stderr.strip() == "E_INPUT_INVALID unknown project 'nobody' (not in this configuration)"


def test_batch_refuses_duplicate_custom_ids_before_sending(tmp_path: Path, client: Client) -> None:
    src = tmp_path / "in.jsonl"
    line = {"messages": [{"role": "user", "content": "hi"}]}
    src.write_text("".join(json.dumps({**line, "custom_id": c}) + "\n" for c in ["a", "b", "a"]))
    config = make_config(tmp_path, key_prefix=client.settings.key_prefix)
    out = fleet_cli(config, "batch", str(src), "-p", "assistant", "--out", str(tmp_path / "o.jsonl"))
    assert out.returncode == 2, out
    assert out.stderr.strip() == "E_INPUT_INVALID custom_id must be unique in a batch file; repeated: a"
    assert not list(client.redis.scan_iter(match=f"{client.settings.key_prefix}job:*"))
