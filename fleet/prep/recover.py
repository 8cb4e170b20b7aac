"""After the broker came back: prep messages it lost are sent again at once, not after
``prep_unclaimed_s``.

Redis with AOF ``everysec`` killed mid-batch loses up to a second of writes, and they need not be
the same second for every key: a job's record (state ``submitted``) and its entry in the prep
watchdog's zset may survive while its prep message does not. Such a job is in no queue, no
unacked entry and has no claim; the watchdog (fleet/prep/watchdog.py) would send it again only at
its next look, up to ``prep_unclaimed_s`` (600 s) later.

``run_prep_watchdog`` is the watchdog's loop (a thread of every dispatcher). ``BrokerReturns``
tells it when its broker came back as this process sees it: at
the first pass (a dispatcher starting, perhaps after the whole fleet went down with its broker),
after passes that failed with a connection error, and whenever the server's ``run_id`` changed
(a restart shorter than a pass interval, or a Sentinel failover to another server, which the
client may have ridden out without an error). ``look_for_lost`` then takes every submitted job
that is not handed over, not final, has no live claim and whose message is nowhere in the broker
(``in_broker``, fleet/worker/queues.py ``prep_refs_in_broker``), and makes its watchdog entry due
now: the watchdog's own pass sends it again, with its checks (own message, the atomic take that
lets one dispatcher of several send it, the count of claimed-and-lost sends). Everything else keeps
its normal timer.

Failure cases: a message popped from its queue but not yet written to the unacked hash, or sent
by a producer just after its record was written, can be taken for lost and sent twice; the prep
claim and the job's state make the copy a no-op ("duplicate", fleet/worker/jobs/prep.py). A
server that refuses INFO (a renamed command) is noticed only through failed passes. A project
whose entries cannot be read is logged and passed over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from fleet.core.config import Settings
from fleet.core.keys import split_ref
from fleet.core.outagelog import BROKER_LOST, OutageLog
from fleet.core.results import ResultStore
from fleet.prep.watchdog import HANDED_OVER, WATCH_INTERVAL_S, watch_once

log = logging.getLogger(__name__)

PAGE = 1000  # zset members read per call


class BrokerReturns:
    """When the broker came back, as one process sees it (module docstring)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.run_id: str | None = None
        self.down = False
        self.started = False

    def failed(self, exc: BaseException) -> None:
        """A pass failed; a connection error means the broker is away."""
        if isinstance(exc, BROKER_LOST):
            self.down = True

    def came_back(self) -> bool:
        """True at the first call, after a connection error, and when the server's run_id changed
        since the last call; a Redis error goes up (the pass fails, ``failed`` is told)."""
        run_id = self._run_id()
        back = not self.started or self.down or (run_id is not None and self.run_id is not None
                                                 and run_id != self.run_id)
        self.started, self.down = True, False
        self.run_id = run_id or self.run_id
        return back

    def _run_id(self) -> str | None:
        try:
            info = self.client.info("server")
        except redis.ResponseError:  # INFO renamed or refused: failed passes still tell
            return None
        run_id = info.get("run_id")
        return run_id if isinstance(run_id, str) else None


def look_for_lost(results: ResultStore, in_broker: Callable[[], set[str]], now: float) -> list[str]:
    """Submitted jobs whose prep message is nowhere (no queue, no unacked entry, no claim): their
    watchdog entries are made due at ``now``; returns their refs."""
    waiting = [ref for project in results.settings.projects
               for ref in _unclaimed(results, project)]
    if not waiting:
        return []
    present = in_broker()
    lost = [ref for ref in waiting if ref not in present and _still_waiting(results, ref)]
    for ref in lost:
        results.client.zadd(results.keys.prepping(split_ref(ref)[0]), {ref: now}, xx=True)
    if lost:
        log.warning("prep watchdog: the broker came back without the prep messages of %d jobs; "
                    "sending them again now: %s", len(lost), ", ".join(lost[:20]))
    return lost


def _unclaimed(results: ResultStore, project: str) -> list[str]:
    """The project's watchdog entries that are still waiting for a prep worker's claim."""
    prepping, found, start = results.keys.prepping(project), [], 0
    try:
        while page := results.client.zrange(prepping, start, start + PAGE - 1):
            start += PAGE
            found += [ref for ref in (m.decode(errors="replace") for m in page)
                      if split_ref(ref)[0] == project and _still_waiting(results, ref)]
    except redis.RedisError:
        raise
    except Exception:  # the producer writes this zset and the records: never stop the look
        log.exception("prep watchdog: project %s passed over in the look for lost messages", project)
    return found


def _still_waiting(results: ResultStore, ref: str) -> bool:
    """Not handed over, not final, with its message stored, and no live prep claim (a record
    that cannot be read is the normal pass's to drop)."""
    try:
        record = results.job_record(ref)
    except UnicodeDecodeError:
        return False
    return (record.get("state") not in HANDED_OVER and "signed" in record
            and results.final(ref) is None and not results.client.exists(results.keys.prep(ref)))


def run_prep_watchdog(settings: Settings, results: ResultStore,
                      resend: Callable[[dict[str, Any]], None], stop: threading.Event,
                      in_broker: Callable[[], set[str]] | None = None,
                      on_return: Callable[[float], Any] | None = None) -> None:
    """Every ``WATCH_INTERVAL_S`` a pass; with ``in_broker`` (the refs whose prep message the
    broker holds), first a look for messages the broker lost whenever it came back
    (``look_for_lost``), so those jobs go again now instead of after ``prep_unclaimed_s``; and
    ``on_return(when)`` then too (the dispatcher's look for lost grants,
    fleet/worker/lostgrants.py)."""
    returns = BrokerReturns(results.client)
    outage = OutageLog(log, "prep watchdog", "passes missed")
    while not stop.wait(WATCH_INTERVAL_S):
        try:
            if in_broker is not None and returns.came_back():
                now = time.time()
                look_for_lost(results, in_broker, now)
                if on_return is not None:
                    on_return(now)
            watch_once(results, resend, time.time(), settings.prep_unclaimed_s)
            outage.answered()
        except BROKER_LOST as exc:
            returns.failed(exc)
            outage.failed(exc)
        except redis.RedisError as exc:
            log.warning("prep watchdog: %s", exc)
        except Exception:  # the watchdog must outlive one bad record
            log.exception("prep watchdog pass failed")
