"""Helpers for the gateway tests: configs with minted API keys, and a lone ``fleet gateway`` process."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fleet.core.apikeys import mint
from fleet.local.embedded import free_port
from fleet.local.processes import wait_http
from tests.support.fleet_harness import make_config, write_config

# The metrics key every config of config_with_keys admits on the gateway's /metrics (unless the
# test sets gateway.metrics_keys itself), and the header that sends it.
METRICS_KEY, METRICS_ENTRY = mint()
METRICS_AUTH = {"Authorization": f"Bearer {METRICS_KEY}"}


def config_with_keys(tmp: Path, projects: dict[str, dict[str, Any]] | None = None, **sections: Any
                     ) -> tuple[Path, dict[str, str]]:
    """The test config plus one fresh gateway key for each project (project -> key); a
    ``projects`` entry updates that project's settings. ``METRICS_KEY`` reads /metrics."""
    path = make_config(tmp, **sections)
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    keys = {}
    for name, project in data["projects"].items():
        key, entry = mint()
        project["api_keys"] = [entry]
        project.update((projects or {}).get(name, {}))
        keys[name] = key
    data.setdefault("gateway", {}).setdefault("metrics_keys", [METRICS_ENTRY])
    write_config(path, data)
    return path, keys


def set_keys(path: Path, project: str, entries: list[str]) -> None:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    data["projects"][project]["api_keys"] = entries
    write_config(path, data)


@contextmanager
def lone_gateway(config: Path, nofile: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``fleet gateway`` on its own (no dispatcher, no backend): nothing is ever admitted.
    ``nofile``: the process's open-file limit (soft and hard), as a small ``ulimit -n`` sets it."""
    port = free_port()

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["FLEET_CONFIG"] = str(config)
    log = config.with_name("gateway.log")
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "fleet", "gateway", "--port", str(port)],
                                   env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=limit if nofile is not None else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", timeout_s=60, alive=lambda: process.poll() is None)
        assert process.poll() is None, log.read_text()
        yield url, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
