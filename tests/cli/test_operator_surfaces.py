"""What an operator's tools show and where they run, with real processes:

- no command, banner or log prints a broker password (a real redis-server with requirepass);
- Flower listens on loopback unless told otherwise, asks for a password when given one, and shows
  "project=... job=..." instead of job texts;
- workers and dispatchers refuse the example's public secrets (recognised by value, in a copy of
  the example anywhere) on a broker nobody local started, and run on with a warning where
  ``fleet up`` / ``fleet demo`` started it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from fleet.client import Client
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.exposure import LOCAL_BROKER_ENV, public_secret_projects
from fleet.core.redisconn import mask_url
from fleet.local.embedded import EmbeddedRedis, free_port, redis_answers, redis_server_binary
from fleet.local.processes import LocalFleet, wait_http
from tests.support.fleet_harness import make_config
from tests.support.processes import kill_tree
from tests.support.testenv import TEST_REDIS_URL, delete_prefix
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PASSWORD = "pw-" + uuid.uuid4().hex


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "FLOWER_"))}
    return env | {"COLUMNS": "200"} | extra


def fleet_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleet", *args]


@pytest.fixture(scope="module")
def locked_broker() -> Iterator[str]:
    """A private redis-server that wants a password; yields its URL with the password in it."""
    folder = tempfile.mkdtemp(prefix="fleet-redis-pw-")
    port = free_port()
    process = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no", "--dir", folder,
                                "--requirepass", PASSWORD],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    handle = EmbeddedRedis(url=url, process=process, folder=folder)
    with handle:
        wait_until(lambda: redis_answers(url, 0.2), 30, "the locked redis-server")
        yield url


@pytest.fixture
def example_copy(tmp_path: Path) -> Path:
    """The example configuration under another name, in another folder."""
    path = tmp_path / "elsewhere" / "production.toml"
    path.parent.mkdir()
    shutil.copy(EXAMPLE_CONFIG, path)
    return path


# -- masking ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
    ("rediss://fleet:p%40ss@[::1]:6380/2?ssl_cert_reqs=none", "rediss://fleet:***@[::1]:6380/2?ssl_cert_reqs=none"),
    ("redis://fleet@host/0", "redis://fleet@host/0"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("http://user:tok@backend:8100", "http://user:***@backend:8100"),
])
def test_mask_url_hides_only_the_password(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_commands_never_print_the_broker_password(tmp_path: Path, locked_broker: str) -> None:
    env = clean_env(FLEET_CONFIG=str(make_config(tmp_path, broker_url=locked_broker)))
    shown = subprocess.run(fleet_cmd("config"), env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert mask_url(locked_broker) in shown.stdout
    down = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    refused = subprocess.run(fleet_cmd("status", "some-job"), env=env | {"FLEET_BROKER_URL": down},
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.startswith("E_BROKER_UNAVAILABLE the broker at redis://:***@127.0.0.1")
    demo = subprocess.run(fleet_cmd("demo", "--broker", down), env=env, capture_output=True, text=True,
                          timeout=120)
    assert demo.returncode == 2 and "E_INPUT_INVALID no Redis answers at redis://:***@" in demo.stderr
    for run in (shown, refused, demo):
        assert PASSWORD not in run.stdout + run.stderr


def test_fleet_up_and_its_processes_never_log_the_broker_password(tmp_path: Path, locked_broker: str) -> None:
    env = clean_env(FLEET_CONFIG=str(make_config(tmp_path, broker_url=locked_broker)))
    out = tmp_path / "up.out"
    with out.open("wb") as output:
        process = subprocess.Popen(fleet_cmd("up", "--speed", "50"), env=env, stdout=output,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        # the banner (printed once every child is up), and the worker's Celery banner and
        # "Connected to" line through its prefix
        wait_until(lambda: ("Connected to" in out.read_text() and "Ctrl-C to stop" in out.read_text())
                   or process.poll() is not None, 180, "the fleet to be up and the worker to connect")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, out.read_text()
    finally:
        kill_tree(process)
    text = out.read_text()
    assert f"broker  {mask_url(locked_broker)}" in text and "dispatcher-0 |" in text
    assert PASSWORD not in text


def test_demo_on_a_named_broker_masks_it_and_runs_on_the_example_secrets(tmp_path: Path, locked_broker: str,
                                                                           example_copy: Path) -> None:
    env = clean_env(FLEET_CONFIG=str(example_copy))
    done = subprocess.run(fleet_cmd("demo", "--broker", locked_broker, "--jobs", "2", "--speed", "100"),
                          env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"broker {mask_url(locked_broker)}" in done.stdout
    assert "2 results, 0 not OK, 0 missing" in done.stdout
    assert PASSWORD not in done.stdout + done.stderr


# -- Flower -------------------------------------------------------------------------------------
def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net shows them) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


@pytest.fixture
def flower(tmp_path: Path, locked_broker: str) -> Iterator[tuple[int, Path, Path]]:
    config = make_config(tmp_path, broker_url=locked_broker)
    port, out = free_port(), tmp_path / "flower.out"
    env = clean_env(FLEET_CONFIG=str(config), FLOWER_BASIC_AUTH="ops:flower-pass")
    with out.open("wb") as output:
        process = subprocess.Popen(fleet_cmd("flower", "--port", str(port)), env=env, stdout=output,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: listening_addresses(port) or process.poll() is not None, 120, "Flower to listen")
        assert process.poll() is None, out.read_text()
        yield port, config, out
    finally:
        kill_tree(process)
        delete_prefix(redis.Redis.from_url(locked_broker), load_settings(config, env={}).key_prefix)


def test_flower_listens_on_loopback_asks_for_a_password_and_hides_job_texts(flower: tuple[int, Path, Path]) -> None:
    port, config, out = flower
    assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/", timeout=10).status_code == 401
    auth = ("ops", "flower-pass")
    wait_http(f"{base}/healthcheck", 60)
    secret_text = f"confidential-{uuid.uuid4().hex}"
    settings = load_settings(config, env={})
    with Client(settings) as client:
        job_id = client.submit({"project": "triage", "messages": [{"role": "user", "content": secret_text}]})

    def task_seen() -> dict | None:
        tasks = httpx.get(f"{base}/api/tasks", auth=auth, timeout=10).json()
        return next((t for t in tasks.values() if job_id in str(t.get("kwargs"))), None)

    task = wait_until(task_seen, 60, "Flower to see the sent task")
    assert task["kwargs"] == f"project=triage job={job_id}"
    pages = [httpx.get(f"{base}/api/tasks", auth=auth, timeout=10).text,
             httpx.get(f"{base}/task/{task['uuid']}", auth=auth, timeout=10).text,
             httpx.get(f"{base}/broker", auth=auth, timeout=30).text]
    assert all(secret_text not in page and PASSWORD not in page for page in pages)
    assert PASSWORD not in out.read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--address", "0.0.0.0"], "is reachable from other hosts"),
    (["--basic-auth", "nopassword"], "takes user:password"),
])
def test_flower_refuses_an_open_address_without_a_password(tmp_path: Path, args: list[str], message: str) -> None:
    env = clean_env(FLEET_CONFIG=str(make_config(tmp_path)))
    done = subprocess.run(fleet_cmd("flower", "--port", str(free_port()), *args), env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    [line] = [text for text in done.stderr.splitlines() if text.startswith("E_")]
    assert line.startswith("E_INPUT_INVALID ") and message in line


# -- the example's public secrets ---------------------------------------------------------------
def test_the_example_secrets_are_recognised_in_a_copy_anywhere(example_copy: Path) -> None:
    assert public_secret_projects(load_settings(example_copy, env={})) == sorted(
        load_settings(EXAMPLE_CONFIG, env={}).projects)
    assert public_secret_projects(load_settings(make_config(example_copy.parent), env={})) == []


@pytest.mark.parametrize("command", [["worker", "--concurrency", "1"], ["dispatcher"]])
@pytest.mark.parametrize("marker", [None, "redis://127.0.0.1:1/0"])
def test_public_secrets_on_a_broker_nobody_local_started_are_refused(
        example_copy: Path, command: list[str], marker: str | None) -> None:
    env = clean_env(FLEET_CONFIG=str(example_copy), FLEET_BROKER_URL=TEST_REDIS_URL,
                    FLEET_KEY_PREFIX=f"t-{uuid.uuid4().hex[:10]}:", FLEET_ADMISSION_METRICS_PORT="0")
    if marker is not None:  # a marker naming another broker blesses nothing
        env[LOCAL_BROKER_ENV] = marker
    done = subprocess.run(fleet_cmd(*command), env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    [line] = [text for text in done.stderr.splitlines() if text.startswith("E_")]
    assert line.startswith("E_AUTH ") and "public secrets" in line
    assert all(name in line for name in load_settings(EXAMPLE_CONFIG, env={}).projects)


def test_public_secrets_on_a_broker_fleet_up_started_run_with_a_warning(tmp_path: Path,
                                                                        example_copy: Path) -> None:
    settings = load_settings(example_copy, env={}, admission={"metrics_port": 0})
    fleet = LocalFleet(settings, private_broker=True, log_dir=str(tmp_path), config_path=str(example_copy),
                       extra_env={"FLEET_ADMISSION_METRICS_PORT": "0"}, log_level="INFO")
    with fleet:
        assert fleet.env[LOCAL_BROKER_ENV] == fleet.env["FLEET_BROKER_URL"]
        for name in ("dispatcher-0", "worker-0"):
            log = tmp_path / f"{name}.log"
            wait_until(lambda log=log: "public secrets" in log.read_text() or fleet.check(), 120,
                       f"the warning of {name}")
        assert fleet.check() == []
    for name in ("dispatcher-0", "worker-0"):
        text = (tmp_path / f"{name}.log").read_text()
        assert "WARNING" in text and "E_AUTH" not in text
