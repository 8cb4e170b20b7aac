"""The dispatcher process: admits pending jobs into the backend, one atomic decision at a time.

Loop (``run_dispatcher``):
  1. reap expired leases (their jobs go back in line at their original place), and put in line
     the continuations whose not-before time (a backoff) came (``promote_due``);
  2. drop pending jobs whose deadline passed (``expire_deadlines``) and hand each id to
     ``on_expired`` (the caller publishes E_DEADLINE);
  3. ``admit_many`` while it grants (up to ``GRANTS_PER_CALL`` grants per call: one Lua script
     call on Redis), calling ``send(grant)`` for each (the caller enqueues the inference task
     with the job id and the fence);
  (0. with a ``gate`` (fleet/worker/dispatch.py: no live inference worker) that holds, step 3
     admits gateway requests only (``store.admit_gateway_only``: they stream in the gateway and
     need no inference worker), so a slot a release frees goes to a gateway request waiting for
     one; queued jobs stay in line, and the round ends with the gate's reason (the store counts
     the rounds that passed a queued job over as held by 'no_workers');)
  4. block on the wake list (BLPOP) until a submit, a release, a readmit, an expiry or a lifted
     backend hold pushes to it, or until the next time-based event: lease expiry, pending
     deadline, bucket refill, spacing, a continuation's not-before time, or
     ``admission.max_wait_s`` at most (<= 4 s, below redis-py's socket timeout). Nothing
     sleep-polls; a freed slot is refilled as soon as the release's wake reaches a dispatcher.
     A round woken before that timeout skips step 1 (one Redis round trip less between a
     release and the next admission): the timeout never passes the earliest lease expiry E it
     read, and no lease granted or renewed later can expire before E (each lasts
     ``lease_ttl_s`` from its grant or renewal, and E was at most that far away). Nor does it
     pass the earliest not-before time it read; a continuation deferred later pushes a wake, and
     the round that wake starts reads its not-before time into the next timeout (1 ms when it
     has already come), so a due continuation is promoted a round late at worst.

What it logs at INFO: start, stop, hold reasons as they change and a summary line a minute
(schedulers/activity.py), errors; each admission only at DEBUG.

Beside it, a thread scrapes the backend (schedulers/scrape.py) when ``admission.backend_gate`` is on,
and prometheus_client serves ``/metrics`` on ``admission.metrics_port`` (0 = off). Any number of
dispatchers may run against one Redis: the store's Lua script is the only place that decides. Only
the metrics leader among them exports the fleet-wide figures (schedulers/metrics.py); each needs its
own metrics port (a busy one is a warning and that dispatcher runs without /metrics).

Failure cases:
- ``send`` raises (broker down): the lease is given back at once with ``requeue`` (the job
  returns to its place in line), the round ends and the dispatcher backs off before the next.
  If even the requeue fails, the lease expires after ``lease_ttl_s`` and the job is admitted
  again: nothing is lost and no capacity leaks.
- Redis unreachable or slow (ConnectionError, TimeoutError, any RedisError) in reap, expiry,
  admission or the wait: one log line, a back-off (0.5 s doubling to 5 s, reset after a good
  round) on the stop event, and the loop goes on. The dispatcher never exits on a Redis blip.
- ``on_expired`` raises: logged; that job stays in line and the next round reports it
  again (a job is reported before it leaves the line, so a dispatcher dying in between loses
  no final result: the publish is first-wins).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import kombu.exceptions
import redis
from prometheus_client.registry import Collector

from fleet.core.config import Settings
from fleet.core.keys import Keys
from schedulers.activity import Activity
from schedulers.backoff import Backoff
from schedulers.metrics import (
    BrokerPersistenceCollector,
    DispatcherMetrics,
    MetricsLeader,
    ResultCodeCollector,
    serve_metrics,
)
from schedulers.scrape import make_http, run_scraper
from schedulers.serverinfo import ServerCheck
from schedulers.store import make_store
from schedulers.store.base import AdmissionStore, AdmitResult, Grant

log = logging.getLogger(__name__)

SEND_ERRORS = (kombu.exceptions.OperationalError, redis.RedisError, OSError)
GRANTS_PER_CALL = 8  # grants one store call may decide (Redis: one ADMIT script call)


def admit_all(
    store: AdmissionStore,
    send: Callable[[Grant], None],
    now: float,
    metrics: DispatcherMetrics | None = None,
    gateway_only: bool = False,
) -> AdmitResult:
    """Admit while the store grants, up to ``GRANTS_PER_CALL`` grants per store call; returns the
    round's final (holding) result, or ``AdmitResult(None, "send_failed")`` after a grant that
    could not be sent (it and the grants of the same call not sent yet are requeued). With
    ``gateway_only`` (the worker gate holds) each call is ``admit_gateway_only``."""
    admit = store.admit_gateway_only if gateway_only else store.admit_many
    while True:
        results = admit(now, GRANTS_PER_CALL)
        if not send_grants(store, send, [r.grant for r in results if r.grant is not None], metrics):
            return AdmitResult(None, "send_failed")
        if results[-1].grant is None:
            return results[-1]


def send_grants(store: AdmissionStore, send: Callable[[Grant], None], grants: list[Grant],
                metrics: DispatcherMetrics | None = None) -> bool:
    """``send`` each grant in order; False after one that could not be sent (it and the ones
    after it are requeued: back at their place in line). The gateway's round sends with it too."""
    for index, grant in enumerate(grants):
        if not _send(send, grant, metrics):
            for unsent in grants[index:]:
                store.requeue(unsent.job_id, unsent.fence)
            return False
    return True


def _send(send: Callable[[Grant], None], grant: Grant, metrics: DispatcherMetrics | None) -> bool:
    """Hand one grant to ``send``; False when it failed (the caller requeues it). If Redis is
    down too, the requeue's RedisError reaches the loop and the lease simply expires."""
    log.debug(
        "admitted %s project=%s fence=%d prompt=%d kv=%d long=%s waited=%.3fs",
        grant.job_id,
        grant.project,
        grant.fence,
        grant.prompt_tokens,
        grant.kv_tokens,
        grant.long,
        grant.waited_s,
    )
    if metrics is not None:
        metrics.admitted(grant)
    try:
        send(grant)
    except SEND_ERRORS as exc:
        log.warning("sending %s failed (%r); back in line", grant.job_id, exc)
        return False
    except Exception:  # a bug in send: same handling, with the traceback
        log.exception("sending %s failed; back in line", grant.job_id)
        return False
    return True


def wait_timeout_s(store: AdmissionStore, result: AdmitResult, now: float, max_s: float) -> float:
    """How long to block on the wake list: until the next time-based event, at most ``max_s``."""
    timeout_s = max_s
    if result.hold_reason == "conflict":
        return 0.0
    if result.retry_in_s is not None:
        timeout_s = min(timeout_s, result.retry_in_s)
    for event_at in (store.next_expiry(), store.next_deadline(), store.next_not_before()):
        if event_at is not None:
            timeout_s = min(timeout_s, event_at - now)
    return max(timeout_s, 0.001)


def expire_deadlines(
    store: AdmissionStore, now: float, on_expired: Callable[[str], None] | None
) -> list[str]:
    """Report each pending job past its deadline to ``on_expired`` (its final envelope), then
    drop them from the line. Reported first: a dispatcher that dies in between leaves items whose
    job already ended, which the next round drops (or an inference worker drops at once, should
    one be admitted meanwhile); dropped first, the job would have no final result. A job whose
    report fails stays in line, and the next round reports it again."""
    reported: list[str] | None = None
    if on_expired is not None:
        reported = []
        for job_id in store.due_deadlines(now):
            try:
                on_expired(job_id)
                reported.append(job_id)
            except Exception:  # one failed report must not stop the others or the loop
                log.exception("reporting the expired deadline of %s failed; it stays in line", job_id)
    expired = store.expire_deadlines(now, reported)
    for job_id in expired:
        log.info("deadline passed while pending: %s", job_id)
    return expired


def housekeeping(
    store: AdmissionStore,
    clock: Callable[[], float],
    on_expired: Callable[[str], None] | None,
    reap: bool = True,
) -> None:
    """Steps 1 and 2: reap expired leases and promote due continuations (when ``reap``), expire
    pending deadlines. A held round does them too (its wait counts on them being done)."""
    if reap:
        store.reap_expired(clock())
        store.promote_due(clock())
    expire_deadlines(store, clock(), on_expired)


def dispatch_round(
    store: AdmissionStore,
    send: Callable[[Grant], None],
    clock: Callable[[], float],
    metrics: DispatcherMetrics | None = None,
    on_expired: Callable[[str], None] | None = None,
    reap: bool = True,
    gateway_only: bool = False,
) -> AdmitResult:
    """One pass of the loop before its wait: reap and promote (unless ``reap`` is False: no
    lease can have expired yet, no continuation come due), expire deadlines, admit (gateway
    requests only with ``gateway_only``)."""
    housekeeping(store, clock, on_expired, reap)
    return admit_all(store, send, clock(), metrics, gateway_only)


def run_dispatcher(
    settings: Settings,
    client: redis.Redis,
    send: Callable[[Grant], None],
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.time,
    on_expired: Callable[[str], None] | None = None,
    backoff: Backoff | None = None,
    shared_metrics: Iterable[Collector] = (),
    gate: Callable[[], str] | None = None,
) -> None:
    """Run until ``stop`` is set (it is checked after every wake; ``store.wake()`` hurries it).

    ``on_expired(job_id)`` is called for each pending job dropped because its deadline passed;
    ``backoff`` paces the retries after a Redis error or a failed send (module docstring);
    ``shared_metrics`` are more fleet-wide collectors, exported by the metrics leader only;
    ``gate()`` is asked before each round: a non-empty answer is a hold reason (fleet/worker/
    heartbeat.py's ``no_workers``), and the round reaps leases, promotes due continuations,
    expires deadlines and admits gateway requests only; it ends with that reason.
    """
    stop = stop or threading.Event()
    backoff = backoff or Backoff()
    store = make_store(settings, client)
    keys = Keys(settings.key_prefix)
    leader = MetricsLeader(client, keys.metrics_leader)
    metrics = DispatcherMetrics(store, ResultCodeCollector(client, keys), leader,
                                [BrokerPersistenceCollector(client), *shared_metrics])
    admission = settings.admission
    server = serve_metrics(metrics, admission.metrics_port, settings.metrics_host)
    scraper_stop = threading.Event()
    scrapers = _start_scrapers(settings, store, scraper_stop, clock)
    activity = Activity(store, clock)

    def counted_send(grant: Grant) -> None:
        send(grant)
        activity.admitted += 1

    log.info(
        "dispatcher running: %s, prefix=%s",
        ", ".join(f"{b.name} cap={b.max_num_seqs}" for b in settings.backends), settings.key_prefix
    )
    reap_at = -float("inf")  # no lease expires before this (module docstring: the wait)
    registered = False  # the backends' order checked against the store's (once Redis answers)
    try:
        while not stop.is_set():
            try:
                if not registered:  # a reordered [[backends]] while jobs hold positions: exits
                    store.register_backends()
                    registered = True
                if server is not None:  # one without /metrics must never take the lead
                    leader.renew()
                hold = gate() if gate is not None else ""
                reap = clock() >= reap_at
                result = dispatch_round(store, counted_send, clock, metrics, on_expired, reap,
                                        gateway_only=bool(hold))
                if hold and result.hold_reason not in ("send_failed", "conflict"):
                    result = AdmitResult(None, hold, result.retry_in_s)
                activity.round_ended(result.hold_reason)
                if result.hold_reason == "send_failed":
                    stop.wait(backoff.next_s())
                    continue
                timeout_s = wait_timeout_s(store, result, clock(), admission.max_wait_s)
                reap_at = clock() + timeout_s
                store.wait_for_wake(timeout_s)
                backoff.reset()
            except redis.RedisError as exc:
                reap_at = -float("inf")
                pause_s = backoff.next_s()
                log.warning("redis error in the dispatcher loop (%r); again in %.1fs", exc, pause_s)
                stop.wait(pause_s)
    finally:
        scraper_stop.set()
        for scraper in scrapers:
            scraper.join(timeout=5)
        if server is not None:
            server.shutdown()
        leader.release()
        log.info("dispatcher stopped")


def _start_scrapers(
    settings: Settings, store: AdmissionStore, stop: threading.Event, clock: Callable[[], float]
) -> list[threading.Thread]:
    """A scraper thread per backend entry, each with its own server check; none (only the checks,
    once) without the backend gate."""
    threads = []
    for entry in settings.backends:
        on = settings.on_backend(entry.name)
        check = ServerCheck(on)
        if not settings.admission.backend_gate:
            check.check_once(make_http(on))  # no scraper to hold admissions: refusing = not starting
            continue

        def scrape(on: Settings = on, check: ServerCheck = check) -> None:
            with make_http(on) as http:
                run_scraper(on, store, http, stop, clock, check, backend=on.backend.name)

        thread = threading.Thread(target=scrape, name=f"scraper-{entry.name}", daemon=True)
        thread.start()
        threads.append(thread)
    return threads
