"""What a ``fleet bench`` run leaves on the machine (fleet/bench/__init__.py): a run stopped by
SIGTERM or SIGINT stops every process it started (simulator, dispatchers, workers, redis-servers),
leaving no temporary folder behind, and a bench uses a private redis-server of its own unless ``--redis-url`` /
``FLEET_BENCH_REDIS_URL`` names one, which must answer. Real processes: ``fleet bench`` runs as a
child of the test and its process tree is read from /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.bench import BENCH_REDIS_ENV
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.local.embedded import EmbeddedRedis, free_port, redis_answers, start_redis
from fleet.local.processes import LocalFleet
from fleet.local.topology import RedisNode


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0], int(fields[19])


def _tree(root: int) -> dict[tuple[int, int], str]:
    """Every descendant of ``root``: (pid, start time) -> command line."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            parents.setdefault(stat[0], []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        for pid in parents.get(todo.pop(), []):
            stat = _stat(pid)
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if stat is not None:
                    found[(pid, stat[2])] = command
                    todo.append(pid)
    return found


def _alive(pid: int, started: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[2] == started and stat[1] != "Z"


def _exit_code(proc: subprocess.Popen, timeout_s: float = 60) -> int | None:
    """The bench's exit code; one still running then is stopped (its signal handler stops what
    it started) and counts as None."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        return None


def _bench(args: list[str], log: Path, tmp: Path | None = None,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}, "COLUMNS": "1000",
           **(env or {})}
    if tmp is not None:
        env["TMPDIR"] = str(tmp)  # where its fleet.toml, logs and Redis folders go
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "fleet", "bench", *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


BENCHES = {
    "chaos": (["chaos", "--rounds", "storm", "--jobs", "400", "--speed", "2"],
              ("redis-server", "fleet sim", "fleet dispatcher", "--role infer", "--role prep")),
    "dispatch": (["dispatch", "--no-overhead", "--scenarios", "saturation", "--fleet-jobs", "400",
                  "--fleet-speed", "2", "--workers", "1", "--concurrency", "4"],
                 ("redis-server", "fleet sim", "fleet worker", "fleet dispatcher")),
}


@pytest.mark.slow
@pytest.mark.parametrize(("bench", "sig"), [("chaos", signal.SIGTERM), ("chaos", signal.SIGINT),
                                            ("dispatch", signal.SIGTERM)])
def test_a_bench_stopped_by_a_signal_leaves_no_process_behind(bench: str, sig: signal.Signals,
                                                              tmp_path: Path) -> None:
    args, wanted = BENCHES[bench]
    (tmp_path / "tmp").mkdir()
    proc = _bench(args, tmp_path / "bench.log", tmp_path / "tmp")
    seen: dict[tuple[int, int], str] = {}
    try:
        deadline = time.monotonic() + 240
        while not all(any(w in command for command in seen.values()) for w in wanted):
            assert proc.poll() is None, (tmp_path / "bench.log").read_text()
            assert time.monotonic() < deadline, f"not every process started: {sorted(seen.values())}"
            seen.update(_tree(proc.pid))
            time.sleep(0.2)
        # every process is up; its own redis-server too (the bench never uses a shared Redis by default)
        assert any("redis-server 127.0.0.1:" in command for command in seen.values())
        seen.update(_tree(proc.pid))
        proc.send_signal(sig)
        proc.wait(timeout=120)
        survivors = [command for (pid, started), command in seen.items() if _alive(pid, started)]
        assert survivors == [], survivors
        # and nothing of the run is left in the temporary folder (configs, logs, Redis data)
        assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid, started in seen:
            if _alive(pid, started):
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)


def test_a_named_redis_must_answer(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    proc = _bench(["loops", "--redis-url", url], tmp_path / "bench.log")
    assert proc.wait(timeout=60) == 2
    assert "does not answer" in (tmp_path / "bench.log").read_text()


def test_the_bench_redis_variable_is_no_unknown_setting() -> None:
    """An operator's shell may keep it exported for every fleet command, which load their
    settings with it set (a bench's own children no longer inherit it)."""
    settings = load_settings(env={"FLEET_BENCH_REDIS_URL": "redis://127.0.0.1:6399/0"})
    assert settings.broker_url != "redis://127.0.0.1:6399/0"


@pytest.fixture
def spare_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own, standing in for a Redis that holds someone's data."""
    server = start_redis()
    yield server
    server.close()


@pytest.mark.parametrize(("key", "named"), [("notes", "holds 1 keys"),
                                            ("prod:{d}:state", "a fleet's among them (key prefix 'prod:')")])
def test_a_named_redis_that_holds_keys_is_refused_without_force(
        spare_redis: EmbeddedRedis, tmp_path: Path, key: str, named: str) -> None:
    """Before, a bench wrote into any Redis it was given and ran workers there on the example's
    public secrets: a deployment's Redis included."""
    client = redis.Redis.from_url(spare_redis.url)
    client.set(key, "theirs")
    for how in (["--redis-url", spare_redis.url], []):
        proc = _bench(["loops", "--jobs", "1", *how], tmp_path / "bench.log",
                      env={} if how else {BENCH_REDIS_ENV: spare_redis.url})
        assert _exit_code(proc) == 2
        text = (tmp_path / "bench.log").read_text()
        assert "E_INPUT_INVALID" in text and named in text and "--force" in text, text
    assert client.dbsize() == 1 and client.get(key) == b"theirs"
    client.close()


@pytest.mark.parametrize("bench", ["chaos", "loss"])
def test_chaos_and_loss_refuse_a_redis_they_did_not_start(spare_redis: EmbeddedRedis, tmp_path: Path,
                                                          bench: str) -> None:
    """They kill and restart their Redis: before, the variable was ignored by them (and an
    explicit --redis-url an unknown option) with nothing said."""
    proc = _bench([bench], tmp_path / "bench.log", env={BENCH_REDIS_ENV: spare_redis.url})
    assert _exit_code(proc) == 2
    text = (tmp_path / "bench.log").read_text()
    assert "E_INPUT_INVALID" in text and "redis-servers it starts itself" in text, text
    assert redis_answers(spare_redis.url)


def test_a_redis_node_never_acts_on_a_server_it_did_not_start(spare_redis: EmbeddedRedis) -> None:
    """Before, a node whose port another server took between ``free_port`` and its start took
    that server's answer for its own start, and its shutdown sent SHUTDOWN to that server (the
    chaos rounds then stopped and restarted a Redis they did not hold)."""
    port = int(spare_redis.url.rsplit(":", 1)[1].split("/")[0])
    node = RedisNode(["--save", ""], port=port)
    with pytest.raises(RuntimeError, match="held by another server"):
        node.start()
    node.shutdown()
    node.kill()
    node.close()
    assert redis_answers(spare_redis.url)


def test_bench_processes_get_none_of_the_operators_fleet_variables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shell set up for a deployment: before, the bench's children inherited FLEET_BACKEND_URL
    (no simulator was started: the bench's load went to that backend), FLEET_PROJECTS and the rest."""
    production = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("FLEET_BACKEND_URL", production)
    monkeypatch.setenv("FLEET_BACKEND_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("FLEET_CONFIG", str(tmp_path / "production.toml"))
    settings = load_settings(EXAMPLE_CONFIG, env={})
    with LocalFleet(settings, workers=0, dispatchers=0, private_broker=True, log_dir=str(tmp_path),
                    inherit_env=False) as fleet:
        assert "sim" in dict(fleet.children)
        assert fleet.env["FLEET_BACKEND_URL"] != production
        fleet.spawn("config", ["config"])
        config = dict(fleet.children)["config"]
        assert config.wait(timeout=60) == 0
        shown = (tmp_path / "config.log").read_text()
    assert production not in shown and '"max_num_seqs": 32' in shown, shown
