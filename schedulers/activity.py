"""What a dispatcher tells the operator at INFO, so that a quiet log still answers "is it working,
and if not, why is nothing admitted?":

- a hold reason when it changes (``admission held: kv``, ``admission open``), at most once a
  minute per reason: at saturation the reason flips with every release, and the per-minute
  summary counts those flips anyway;
- a summary line every ``every_s`` (60 s): this dispatcher's admissions and holding rounds by
  reason since the last line, and the fleet's in-flight and pending counts from the store.

Rounds that end in "conflict" (another dispatcher took the candidate; tried again at once) or
"send_failed" (logged as a warning where it happens) are counted but never reported as a change.
Per-admission lines are DEBUG (schedulers/dispatcher.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from schedulers.store.base import AdmissionStore

log = logging.getLogger(__name__)

TRANSIENT = ("conflict", "send_failed")
OPEN = "open"  # nothing pending: not a hold an operator needs to hear about


class Activity:
    def __init__(self, store: AdmissionStore, clock: Callable[[], float], every_s: float = 60.0) -> None:
        self._store = store
        self._clock = clock
        self._every_s = every_s
        self._next_summary = clock() + every_s
        self._state: str | None = None
        self._last_logged: dict[str, float] = {}
        self.admitted = 0
        self.holds: Counter[str] = Counter()

    def round_ended(self, hold_reason: str | None) -> None:
        """Note how a round ended; log a changed hold and, when due, the summary."""
        reason = hold_reason or "empty"
        self.holds[reason] += 1
        if reason not in TRANSIENT:
            self._note_state(OPEN if reason == "empty" else reason)
        if self._clock() >= self._next_summary:
            self._summary()

    def _note_state(self, state: str) -> None:
        if state == self._state:
            return
        self._state = state
        now = self._clock()
        last = self._last_logged.get(state)
        if last is not None and now - last < self._every_s:
            return
        self._last_logged[state] = now
        if state == OPEN:
            log.info("admission open: nothing waiting")
        else:
            log.info("admission held: %s", state)

    def _summary(self) -> None:
        snap = self._store.snapshot()
        pending = sum(count for bands in snap.pending.values() for count in bands.values())
        holds = " ".join(f"{reason}={count}" for reason, count in sorted(self.holds.items())) or "none"
        log.info("last %.0f s: admitted=%d holds: %s; now %s, in flight=%d pending=%d",
                 self._every_s, self.admitted, holds, self._state or OPEN, snap.in_flight, pending)
        self.admitted = 0
        self.holds.clear()
        self._next_summary = self._clock() + self._every_s
