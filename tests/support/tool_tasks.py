"""Tool tasks for the tool-loop tests (tests/e2e/test_tools.py): the fleet's tool workers import
this module (``tool_imports``), which registers them as Celery tasks.

``search_docs`` sleeps ``SEARCH_SLEEP_S`` and reports how many sequences the simulator runs right
then: the proof that the job's inference slot is free while its tool runs. ``run_query`` outlasts
its timeout, ``open_ticket`` fails, ``crash_worker`` kills the worker process that runs it, ``hang``
hangs past its timeout whatever it is told (only Celery's hard time limit stops it).
``big_result`` returns about ``BIG_RESULT_WORDS`` words (tests/e2e/test_backends.py: a tool
round that grows a prompt past one backend's context).
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

SEARCH_SLEEP_S = 0.5
BIG_RESULT_WORDS = 12_000


@shared_task(name="tests.big_result")
def big_result(**arguments: Any) -> str:
    return " ".join(f"row{n % 997:03d}" for n in range(BIG_RESULT_WORDS))


@shared_task(name="tests.search_docs")
def search_docs(**arguments: Any) -> dict[str, Any]:
    time.sleep(SEARCH_SLEEP_S)
    stats = httpx.get(f"{os.environ['FLEET_BACKEND_URL']}/sim/stats", timeout=10).json()
    return {"docs": ["invoice-2024-03.pdf"], "asked": arguments, "sim_running": stats["running"]}


@shared_task(name="tests.run_query")
def run_query(**arguments: Any) -> str:
    time.sleep(5)
    return "too late"


@shared_task(name="tests.open_ticket")
def open_ticket(**arguments: Any) -> str:
    raise RuntimeError("the ticket system is down")


@shared_task(name="tests.crash_worker")
def crash_worker(**arguments: Any) -> str:
    """The tool worker dies mid-tool (the whole process, as a kill -9 or an OOM would)."""
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
    return "never"


def hang_pid_file(key_prefix: str) -> Path:
    """Where ``hang`` writes the pid of the process it runs in (one file per test fleet)."""
    return Path(tempfile.gettempdir()) / f"fleet-hang-{key_prefix.strip(':')}.pid"


@shared_task(name="tests.hang")
def hang(**arguments: Any) -> str:
    """Never returns and swallows the soft time limit, as a tool stuck in a C call would."""
    hang_pid_file(os.environ["FLEET_KEY_PREFIX"]).write_text(str(os.getpid()))
    while True:
        with contextlib.suppress(SoftTimeLimitExceeded):
            time.sleep(60)
