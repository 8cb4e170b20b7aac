"""The tool of ``fleet bench continuations``' tool scenario: a Celery task the bench fleet's
workers import (``tool_imports``). It sleeps ``seconds`` and reports how many sequences the
simulator was running meanwhile."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
from celery import shared_task

SLEEP_S = float(os.environ.get("FLEET_BENCH_TOOL_S", "2.0"))


@shared_task(name="fleet.bench.sleep_tool")
def sleep_tool(**arguments: Any) -> dict[str, Any]:
    time.sleep(SLEEP_S)
    stats = httpx.get(f"{os.environ['FLEET_BACKEND_URL']}/sim/stats", timeout=10).json()
    return {"slept_s": SLEEP_S, "sim_running_after": stats["running"], "asked": arguments}
