"""One log line when the broker goes away and one when it is back, per component of a process.

A Redis restart of a few seconds used to write a WARNING for every live event dropped and every
lease renewal missed (thousands per outage on a busy worker) and tracebacks for connection errors
that are expected while it lasts. ``OutageLog`` stands for one component of a process (live
events, lease keepers, ...): the first connection error logs one WARNING naming the component and
the error's type; while the outage lasts, further errors are only counted; the first success after
it logs one WARNING saying how long it lasted and how many things were missed meanwhile (the
operator's measure of what the outage cost). No traceback: these errors are expected.

Only connection errors (``BROKER_LOST``) are outages; any other Redis error is the caller's to
report as before. Thread-safe: inference threads share one instance per component.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

BROKER_LOST = (redis.ConnectionError, redis.TimeoutError)


class OutageLog:
    def __init__(self, logger: logging.Logger, component: str, missed: str) -> None:
        self._log = logger
        self.component = component
        self.missed_what = missed  # what is counted while it lasts ("live events dropped")
        self._lock = threading.Lock()
        self.since: float | None = None
        self.missed = 0

    def failed(self, exc: BaseException) -> None:
        """A connection error: the first of an outage is logged, the others counted."""
        with self._lock:
            self.missed += 1
            if self.since is not None:
                return
            self.since = time.monotonic()
        self._log.warning("%s: broker unavailable (%s); carrying on without it until it is back",
                          self.component, type(exc).__name__)

    def answered(self) -> None:
        """A call succeeded: the end of an outage, if one was under way, is logged."""
        if self.since is None:  # the common case, without the lock
            return
        with self._lock:
            if self.since is None:
                return
            lasted, missed = time.monotonic() - self.since, self.missed
            self.since, self.missed = None, 0
        self._log.warning("%s: broker back after %.1f s; %d %s meanwhile",
                          self.component, lasted, missed, self.missed_what)
