"""The one way a test waits for what another thread or process brings about."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], timeout_s: float = 20.0, what: str = "the condition",
               every_s: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that; fail naming ``what``
    after ``timeout_s`` (a generous safety net, never an assertion about speed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout_s:.0f} s")
        time.sleep(every_s)
