"""What a new operator meets at the ``fleet`` command line, with real processes and a real Redis:

- input files that are missing, a directory or not JSON are E_INPUT_INVALID naming the file (exit
  2, one line); only the broker's own errors are E_BROKER_UNAVAILABLE;
- ``fleet batch`` without ``--out`` says why each refused line was refused (line, field, code);
- ``fleet up`` on a named broker that does not answer is one coded line, not a traceback; it uses
  the configured backend unless that is the example's default (then ``fleet sim``) or ``--sim``;
- ``fleet status`` of a project this configuration does not have says "unknown project".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.core.codes import Code
from fleet.local.embedded import free_port
from tests.support.fleet_harness import make_config
from tests.support.processes import kill_tree
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def fleet_env(config: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    return env | {"FLEET_CONFIG": str(config), "COLUMNS": "200"} | extra


def run_fleet(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleet", *args], env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return fleet_env(make_config(tmp_path))


@pytest.mark.parametrize("kind", ["missing", "directory", "not-json"])
def test_input_files_that_cannot_be_read_are_input_errors_naming_the_file(
        tmp_path: Path, env: dict[str, str], kind: str) -> None:
    path = tmp_path / f"input-{kind}"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-json":
        path.write_bytes(b"\xff\xfe not utf-8 nor json")
    for args in (["batch", str(path), "-p", "research"], ["submit", "-p", "research", "--file", str(path)]):
        done = run_fleet(env, *args)
        assert done.returncode == 2, done.stdout + done.stderr
        line = one_line(done.stderr)
        assert line.startswith(f"{Code.E_INPUT_INVALID.value} "), line
        assert str(path) in line and "Traceback" not in done.stderr


def test_batch_without_out_says_why_each_refused_line_was_refused(tmp_path: Path, env: dict[str, str]) -> None:
    good = {"custom_id": "g", "messages": [{"role": "user", "content": "hi"}]}
    lines = [good, {"custom_id": "c", "messages": [{"role": "user", "content": "x"}], "colour": "red"}]
    path = tmp_path / "b1.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n{not json\n")
    done = run_fleet(env, "batch", str(path), "-p", "research")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "submitted 1 of 3 lines" in done.stdout
    refused = done.stderr.strip().splitlines()
    assert len(refused) == 2, done.stderr
    assert refused[0].startswith("line 2 (custom_id c): E_INPUT_INVALID") and "colour" in refused[0]
    assert refused[1].startswith("line 3 (custom_id line-3): E_INPUT_INVALID")


def test_status_of_a_project_this_configuration_lacks_says_unknown_project(env: dict[str, str]) -> None:
    done = run_fleet(env, "status", "nosuch/abc")
    assert done.returncode == 2
    assert one_line(done.stderr).startswith(f"{Code.E_INPUT_INVALID.value} unknown project 'nosuch'")


def test_fleet_up_on_a_named_broker_that_does_not_answer_is_one_coded_line(tmp_path: Path) -> None:
    down = f"redis://127.0.0.1:{free_port()}/0"  # not the default location: never replaced
    done = run_fleet(fleet_env(make_config(tmp_path, broker_url=down)), "up")
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line(done.stderr)
    assert line.startswith(f"{Code.E_BROKER_UNAVAILABLE.value} ") and "Traceback" not in done.stderr


def test_fleet_up_uses_the_configured_backend_and_says_so(tmp_path: Path) -> None:
    backend = f"http://127.0.0.1:{free_port()}"
    env = fleet_env(make_config(tmp_path, backend={"url": backend}))
    out = tmp_path / "up.out"
    with out.open("wb") as output:
        process = subprocess.Popen([sys.executable, "-m", "fleet", "up"], env=env, stdout=output,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "Ctrl-C to stop" in out.read_text() or process.poll() is not None, 120,
                   "fleet up to start its children")
        text = out.read_text()
        assert f"backend {backend} (backend.url)" in text, text
        assert "sim |" not in text
    finally:
        kill_tree(process)


def test_fleet_up_sim_starts_the_simulator_whatever_is_configured(tmp_path: Path) -> None:
    env = fleet_env(make_config(tmp_path, backend={"url": "http://gpu.invalid:8100"}))
    out = tmp_path / "up.out"
    with out.open("wb") as output:
        process = subprocess.Popen([sys.executable, "-m", "fleet", "up", "--sim"], env=env, stdout=output,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "Ctrl-C to stop" in out.read_text() or process.poll() is not None, 120,
                   "fleet up to start its children")
        text = out.read_text()
        assert "(fleet sim, --sim)" in text and "gpu.invalid" not in text, text
    finally:
        kill_tree(process)
