"""A worker asked for its tasks (``celery inspect active / reserved``, Flower's page of one
worker) shows ``project=... job=...`` and never a job's text: a real Celery worker on the test
Redis, one thread busy on a job whose URL source stalls, the next job waiting behind it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.client import Client
from fleet.core.config import load_settings
from fleet.worker.app import create_app
from fleet.worker.queues import collect_queue
from tests.support.fleet_harness import make_config
from tests.support.processes import kill_tree
from tests.support.testenv import delete_prefix
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PROJECT = "reports"


class StallingSite:
    """Accepts HTTP connections and answers none of them until ``close``."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def site() -> Iterator[StallingSite]:
    stalling = StallingSite()
    yield stalling
    stalling.close()


def job(site: StallingSite, text: str) -> dict[str, Any]:
    return {"project": PROJECT, "kind": "collect",
            "messages": [{"role": "user", "content": text}],
            "sources": [{"type": "url", "url": f"http://127.0.0.1:{site.port}/slow"}]}


def test_inspect_shows_no_job_text(tmp_path: Path, site: StallingSite) -> None:
    config = make_config(tmp_path, collect={"allow_networks": ["127.0.0.1/32"],
                                            "read_timeout_s": 600, "connect_timeout_s": 600})
    settings = load_settings(config, env={})
    node = f"privacy-{uuid.uuid4().hex[:8]}@test"
    # One thread, two messages: the first job's prep stalls on its source (active), the second
    # waits in the worker (reserved).
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "fleet.worker.app", "worker", "-P", "threads",
         "-c", "1", "--prefetch-multiplier", "2", "-Q", collect_queue(PROJECT), "-n", node,
         "--without-mingle", "--without-gossip", "--loglevel", "WARNING"],
        env={**os.environ, "FLEET_CONFIG": str(config)}, start_new_session=True)
    client = Client(settings)
    app = create_app(settings)
    inspect = app.control.inspect(destination=[node], timeout=2.0)
    try:
        secrets = [f"private-text-{n}-{uuid.uuid4().hex}" for n in range(2)]
        ids = [client.submit(job(site, text)) for text in secrets]

        def both_seen() -> tuple[dict, dict] | None:
            active, reserved = inspect.active() or {}, inspect.reserved() or {}
            if len(active.get(node, [])) == 1 and len(reserved.get(node, [])) == 1:
                return active, reserved
            return None

        active, reserved = wait_until(both_seen, 120, "one task active and one reserved")
        answers = json.dumps([active, reserved, inspect.query_task(*ids) or {}])
        for text in secrets:
            assert text not in answers
        assert "signed" not in answers and "messages" not in answers
        shown = {active[node][0]["kwargs"], reserved[node][0]["kwargs"]}
        assert shown == {f"project={PROJECT} job={job_id}" for job_id in ids}
    finally:
        kill_tree(worker)
        delete_prefix(client.redis, settings.key_prefix)
        client.close()
        app.close()
