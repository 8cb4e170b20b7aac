"""Prometheus ``/metrics`` in vLLM's names, read from the engine at scrape time.

Gauges and counters are not kept twice: a custom collector reads ``Engine.stats`` and the prefix
cache counters when scraped. Histograms are observed when a request finishes. All series carry the
labels ``model_name`` (the served model name) and ``engine`` ("0"), except the info gauge
``vllm:cache_config_info``, which carries, as vLLM's does, ``engine`` and one label per cache
setting, every value as text: the profile's block size, its pool in whole blocks
(``num_gpu_blocks``; ``kv_cache_size_tokens`` = blocks x block size, the pool in tokens),
``kv_cache_max_concurrency`` (pool / max_model_len), KV cache dtype, prefix caching and memory
utilisation. A real vLLM publishes every CacheConfig field; the others are left out. Durations are simulated
seconds, like everything else the simulator reports (divide by ``--speed`` for wall time).

``SimMetrics`` owns its own ``CollectorRegistry`` (no global registry), so a reset simply builds a
new one.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.sim.engine import Engine, Sequence

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000, 500000)
LABELS = ("model_name", "engine")


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.labels = [model_name, "0"]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.labels, value)
        return c

    def _cache_config(self) -> GaugeMetricFamily:
        profile, pool = self.engine.profile, self.engine.pool
        labels = {
            "block_size": str(pool.block_tokens),
            "cache_dtype": profile.cache_dtype,
            "enable_prefix_caching": str(profile.enable_prefix_caching),
            "gpu_memory_utilization": str(profile.gpu_memory_utilization),
            "num_gpu_blocks": str(pool.total),
            "num_cpu_blocks": "None",
            "kv_cache_size_tokens": str(pool.total * pool.block_tokens),
            "kv_cache_max_concurrency": str(pool.total * pool.block_tokens / profile.max_model_len),
            "engine": self.labels[1],
        }
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(labels))
        g.add_metric(list(labels.values()), 1.0)
        return g

    def collect(self) -> Iterator[Metric]:
        e, st = self.engine, self.engine.stats
        yield self._cache_config()
        yield self._gauge("vllm:num_requests_running", "Requests in model execution batches.",
                          len(e.running))
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be processed.",
                          len(e.waiting))
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          e.kv_usage)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                            st.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            st.generation_tokens)
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.",
                            e.cache.queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.",
                            e.cache.hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemptions.",
                            st.preemptions)
        ok = CounterMetricFamily("vllm:request_success", "Count of finished requests by reason.",
                                 labels=(*LABELS, "finished_reason"))
        for reason in sorted({"stop", "length", "abort", *st.finished_by_reason}):
            ok.add_metric([*self.labels, reason], st.finished_by_reason.get(reason, 0))
        yield ok


class SimMetrics:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.labels = {"model_name": model_name, "engine": "0"}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets)
            return h.labels(**self.labels)  # type: ignore[return-value]

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.",
                         LATENCY_BUCKETS_S)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                        REQUEST_BUCKETS_S)
        self.queue = hist("vllm:request_queue_time_seconds", "Time spent waiting.",
                          REQUEST_BUCKETS_S)
        self.prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.",
                           TOKEN_BUCKETS)
        self.generation = hist("vllm:request_generation_tokens", "Generated tokens per request.",
                               TOKEN_BUCKETS)

    def observe_finished(self, seq: Sequence) -> None:
        if seq.finish_t is None:
            return
        self.e2e.observe(seq.finish_t - seq.arrival_t)
        if seq.first_token_t is not None:
            self.ttft.observe(seq.first_token_t - seq.arrival_t)
        if seq.admitted_t is not None:
            self.queue.observe(seq.admitted_t - seq.arrival_t)
        self.prompt.observe(seq.prompt_len)
        self.generation.observe(seq.generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)
