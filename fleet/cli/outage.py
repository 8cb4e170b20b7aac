"""Riding out a broker outage in the live views (``fleet top``, ``fleet tail``).

An operator watches these exactly while something is wrong, so a Redis that stops answering must
not end them: the view says "broker unavailable since HH:MM:SS, retrying" (once, in ``tail``'s
case; in every frame, in ``top``'s), keeps asking about once a second, and says when the broker
is back and after how long. Only the connection errors of ``UNREACHABLE`` are ridden out; any
other error still ends the command with its code. A one-shot command (``top --once``) does not
wait: it prints the one E_BROKER_UNAVAILABLE line and exits 2.
"""

from __future__ import annotations

import time
from datetime import datetime


class Outage:
    """Since when the broker has not answered (``since`` None: it answers)."""

    def __init__(self) -> None:
        self.since: float | None = None

    def failed(self) -> bool:
        """A call failed; True when that begins an outage (the moment to say so once)."""
        if self.since is not None:
            return False
        self.since = time.time()
        return True

    def answered(self) -> bool:
        """A call succeeded; True when that ends an outage (the moment to say it is back)."""
        was_down = self.since is not None
        self.lasted_s = time.time() - self.since if self.since is not None else 0.0
        self.since = None
        return was_down

    def down_text(self) -> str:
        assert self.since is not None
        return f"broker unavailable since {_clock(self.since)}, retrying"

    def back_text(self) -> str:
        return f"broker back at {_clock(time.time())} after {self.lasted_s:.0f} s"


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S")
