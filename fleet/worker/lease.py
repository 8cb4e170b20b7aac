"""Keeps an admitted job's lease alive while its inference runs, and watches for cancel.

A daemon thread renews the lease every ``ttl / 3`` and checks the job's cancel flag twice a
second. Either failure sets the shared ``cancel`` event, which the streaming code checks between
reads, so the vLLM stream is closed (and the sequence freed) within about a second:
  - a cancel request of the job's project   -> ``cancelled`` is True (``cancel_requested`` checks
    the request's signature: fleet/core/seal.py; the inference task's check also answers True
    once the job has a final result, published by a worker that ended it while it was admitted)
  - renew refused (lease expired, fence stale) -> ``lost`` is True: the job was handed back to
    the dispatcher; this worker must not publish a result for it.
  - no successful renewal for 90% of the TTL (Redis unreachable) -> ``lost`` as well: the lease
    may already have expired elsewhere, so the stream is closed rather than risk two runs.
The first renewal is the claim the inference task makes before entering (schedulers/store/base.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from fleet.core.outagelog import BROKER_LOST, OutageLog
from fleet.infer.vllm import Cancel
from schedulers.store.base import AdmissionStore

log = logging.getLogger(__name__)
_OUTAGE = OutageLog(log, "lease keepers", "lease checks missed")

CANCEL_CHECK_S = 0.5


class LeaseKeeper:
    def __init__(self, store: AdmissionStore, cancel_requested: Callable[[], bool],
                 job_id: str, fence: int, ttl_s: float,
                 on_renew: Callable[[], None] | None = None) -> None:
        self.store = store
        # After each renewal: the inference worker records its turn's progress in the usage
        # ledger there (fleet/core/usage.py), so a worker killed mid-stream leaves what it saw.
        self.on_renew = on_renew
        self.cancel_requested = cancel_requested
        self.job_id = job_id
        self.fence = fence
        self.ttl_s = ttl_s
        self.renew_every_s = max(ttl_s / 3, 0.05)
        self.cancel = Cancel()  # wakes a blocked upstream read at once (fleet/infer/vllm.py)
        self.lost = False
        self.cancelled = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{job_id[:8]}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _lose(self, why: str) -> None:
        log.warning("lease lost job=%s fence=%d: %s", self.job_id, self.fence, why)
        self.lost = True
        self.cancel.set()

    def _after_renew(self) -> None:
        """``on_renew``; bookkeeping only: whatever it raises, the lease and the stream go on."""
        if self.on_renew is None:
            return
        try:
            self.on_renew()
        except redis.RedisError as exc:
            log.warning("lease keeper for job=%s: progress not recorded (%r)", self.job_id, exc)
        except Exception:
            log.exception("lease keeper for job=%s: progress not recorded", self.job_id)

    def _run(self) -> None:
        last_ok = time.monotonic()
        next_renew = last_ok + self.renew_every_s
        while not self._stop.wait(min(CANCEL_CHECK_S, self.renew_every_s)):
            try:
                if self.cancel_requested():
                    self.cancelled = True
                    self.cancel.set()
                    return
                if time.monotonic() >= next_renew:
                    asked = time.monotonic()  # the server counts the TTL from about here
                    next_renew = asked + self.renew_every_s
                    if not self.store.renew(self.job_id, self.fence, time.time()):
                        self._lose("renew refused")
                        return
                    last_ok = asked
                    self._after_renew()
            except BROKER_LOST as exc:
                # Keep streaming through a Redis blip: the lease TTL covers several misses. One
                # line per outage for all keepers of the process, not one per keeper and check.
                _OUTAGE.failed(exc)
            except redis.RedisError as exc:
                log.warning("lease keeper for job=%s: redis error %s", self.job_id, exc)
            except Exception:  # a dead keeper would stream on unrenewed
                log.exception("lease keeper for job=%s failed", self.job_id)
                self._lose("keeper failed")
                return
            else:
                _OUTAGE.answered()
            if time.monotonic() - last_ok > 0.9 * self.ttl_s:
                self._lose("no renewal for 90% of the lease TTL")
                return
