"""The backend saturation gate: /metrics parsing, the hold decision, and the scrape that feeds
every dispatcher (httpx MockTransport as the backend, the in-memory store, a fake clock)."""

from __future__ import annotations

import threading

import httpx

from fleet.core.config import AdmissionSettings, Settings
from schedulers.policy.backend_gate import BackendSample, decide, sample_from
from schedulers.scrape import record, run_scraper, scrape_once
from schedulers.store.base import PendingItem, StoreConfig
from schedulers.store.memory_store import MemoryStore

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="local"}} {running}
vllm:num_requests_waiting{{engine="0",model_name="local"}} {waiting}
vllm:kv_cache_usage_perc{{engine="0",model_name="local"}} {kv}
vllm:kv_cache_usage_perc{{engine="1",model_name="local"}} 0.1
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="local"}} {preempt}
vllm:num_preemptions_total{{engine="1",model_name="local"}} 1.0
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="local"}} 12.0
"""

ADMISSION = AdmissionSettings()


def metrics(running=3.0, waiting=0.0, kv=0.5, preempt=2.0) -> str:
    return METRICS.format(running=running, waiting=waiting, kv=kv, preempt=preempt)


def test_parse_sums_engines_and_takes_the_worst_kv_usage() -> None:
    sample = sample_from(metrics(kv=0.7), healthy=True, scraped_at=5.0)
    assert sample == BackendSample(
        5.0, True, running=3.0, waiting=0.0, kv_usage=0.7, preemptions=3.0
    )


def test_parse_ends_lines_at_lf_only() -> None:
    text = ('vllm:num_requests_running{model_name="qwen\u2028next\u0085"} 3\r\n'
            'vllm:num_requests_waiting{model_name="q\u2029"} 2\n')
    sample = sample_from(text, True, 0.0)
    assert (sample.running, sample.waiting) == (3.0, 2.0)


def test_hold_reasons() -> None:
    ok = sample_from(metrics(), True, 0.0)
    assert decide(ok, 3.0, ADMISSION) is None
    assert decide(sample_from(metrics(), False, 0.0), 3.0, ADMISSION) == "health"
    waiting = sample_from(metrics(waiting=2), True, 0.0)
    assert decide(waiting, 3.0, ADMISSION, previous_waiting=1.0) == "waiting"
    assert decide(waiting, 3.0, ADMISSION, previous_waiting=0.0) is None  # one scrape: a blip
    no_wait = AdmissionSettings(hold_on_waiting=False)
    assert decide(waiting, 3.0, no_wait, previous_waiting=1.0) is None
    assert decide(sample_from(metrics(kv=0.97), True, 0.0), 3.0, ADMISSION) == "kv_usage"
    assert decide(sample_from(metrics(preempt=4), True, 0.0), 3.0, ADMISSION) == "preemptions"
    assert decide(sample_from(metrics(preempt=4), True, 0.0), None, ADMISSION) is None


class Backend:
    """A programmable backend for httpx.MockTransport."""

    def __init__(self) -> None:
        self.healthy = True
        self.text = metrics()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200 if self.healthy else 503)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=self.text)
        return httpx.Response(404)


def test_scrape_feeds_the_admission_gate() -> None:
    backend = Backend()
    http = httpx.Client(transport=httpx.MockTransport(backend), base_url="http://vllm")
    store = MemoryStore(StoreConfig(gate=True, scrape_stale_s=5.0), clock=lambda: 100.0)
    store.add_pending(PendingItem("j1", "a", 100, 100))
    store.add_pending(PendingItem("j2", "a", 100, 100))
    assert record(store, scrape_once(http, 100.0), ADMISSION) == ""
    assert store.wait_for_wake(0)  # submit's wake
    assert store.admit_next(100.5).grant is not None
    backend.text = metrics(preempt=5.0)  # preemptions rose since the last scrape
    assert record(store, scrape_once(http, 101.0), ADMISSION) == "preemptions"
    assert store.admit_next(101.5).hold_reason == "backend_preemptions"
    assert record(store, scrape_once(http, 102.0), ADMISSION) == ""  # steady again
    assert store.admit_next(102.5).grant is not None
    backend.text = metrics(preempt=5.0, waiting=1.0)
    assert record(store, scrape_once(http, 102.6), ADMISSION) == ""  # a blip
    assert record(store, scrape_once(http, 102.7), ADMISSION) == "waiting"  # a queue
    backend.healthy = False
    assert record(store, scrape_once(http, 103.0), ADMISSION) == "health"
    assert store.backend()["healthy"] == "0"


def test_unreachable_backend_is_unhealthy() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    http = httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://vllm")
    sample = scrape_once(http, 7.0)
    assert not sample.healthy and sample.error == "ConnectError"
    assert decide(sample, None, Settings().admission) == "health"


class BrokenOnce(MemoryStore):
    """A store whose first ``record_backend`` fails with an unexpected error; the third round
    sets ``stop``."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__(StoreConfig(gate=True))
        self.stop, self.calls = stop, 0

    def record_backend(self, scraped_at: float, hold: str, figures: dict[str, str],
                       name: str | None = None) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a bug")
        super().record_backend(scraped_at, hold, figures, name)
        if self.calls == 3:
            self.stop.set()


def test_scraper_survives_an_unexpected_error(caplog) -> None:
    http = httpx.Client(transport=httpx.MockTransport(Backend()), base_url="http://vllm")
    stop = threading.Event()
    store = BrokenOnce(stop)
    settings = Settings(admission={"scrape_interval_s": 0.01, "metrics_port": 0})
    thread = threading.Thread(target=run_scraper, args=(settings, store, http, stop, lambda: 5.0))
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive() and store.calls == 3
    assert store.backend()["hold"] == ""
    failures = [r for r in caplog.records if r.getMessage() == "backend scrape round failed"]
    assert len(failures) == 1 and failures[0].exc_info is not None


def test_an_outside_estimate_stands_for_its_window_then_drops() -> None:
    from schedulers.scrape import outside_peak, outside_window

    assert outside_window(0.1) == 1.0 and outside_window(1.0) == 2.0
    peak, seen = outside_peak("", 6.0, now=10.0, window_s=1.0)
    assert peak == 6.0
    # two low estimates in a row (late requests) inside the window do not open slots
    peak, seen = outside_peak(seen, 4.0, now=10.3, window_s=1.0)
    peak, seen = outside_peak(seen, 4.0, now=10.6, window_s=1.0)
    assert peak == 6.0
    peak, seen = outside_peak(seen, 4.0, now=11.2, window_s=1.0)
    assert peak == 4.0  # the 6 is older than the window
    assert outside_peak("not json", 2.0, now=1.0, window_s=1.0)[0] == 2.0


def test_the_smaller_claimed_count_is_subtracted() -> None:
    store = MemoryStore(StoreConfig())
    sample = sample_from(metrics(running=7.0), healthy=True, scraped_at=1.0)
    record(store, sample, ADMISSION, claimed_before=3)  # none claimed when the scrape is recorded
    assert float(store.backend()["outside"]) == 7.0
