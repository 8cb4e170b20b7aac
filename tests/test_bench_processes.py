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
from pathlib import Path

import pytest

from fleet.core.config import load_settings
from fleet.local.embedded import free_port


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


def _bench(args: list[str], log: Path, tmp: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
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
    """The bench's children inherit it and load their settings with it set."""
    settings = load_settings(env={"FLEET_BENCH_REDIS_URL": "redis://127.0.0.1:6399/0"})
    assert settings.broker_url != "redis://127.0.0.1:6399/0"
