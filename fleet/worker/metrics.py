"""A worker process's Prometheus registry: what its tasks finished, per project.

Observed once per final envelope this process publishes (the ``on_publish`` hook of its
``ResultStore``), so every job is counted by exactly one worker:

  fleet_worker_results_total{project,code}          final envelopes by message code
  fleet_worker_tokens_total{project,kind}           prompt, reasoning and answer tokens (all attempts)
  fleet_worker_ttft_seconds{project}                first token of the last attempt, from its start
  fleet_worker_latency_seconds{project}             submission to final envelope
  fleet_worker_attempts{project}                    attempts per inference job
  fleet_worker_continued_tokens_total{project,backend}
                                                    reasoning tokens a job's final attempt continued
                                                    instead of generating again (a cut reasoning,
                                                    routing.continue_cut_turns), on its backend
  fleet_worker_refused_messages_total{queue,reason} broker messages refused before anything ran
                                                    (fleet/worker/screen.py), per queue taken from
  fleet_usage_turns_total{project,code}             model turns counted in the usage ledger by
                                                    this process (fleet/core/usage.py), by the
                                                    turn's own code (not the job's final one)
  fleet_usage_tokens_total{project,kind}            their tokens: prompt, cached, reasoning,
                                                    answer, loop_cut (the same figures as the
                                                    ledger's, counted when the ledger counted)

Served by prometheus_client on ``worker_metrics_port`` (0 = off; a busy port is a WARNING and the
worker runs on without /metrics, as a dispatcher does). One registry per process: this covers the
``threads`` and ``solo`` pools, where every task runs in the process that serves /metrics. A
``prefork`` pool runs tasks in child processes whose figures the parent cannot see; it is not
supported (a WARNING at start, no endpoint): run prefork prep workers without metrics, or give
the inference and prep roles threads workers.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import worker_init
from prometheus_client import CollectorRegistry, Counter, Histogram

from fleet.core.models import Envelope
from fleet.core.usage import TurnUsage
from schedulers.metrics import serve_registry

log = logging.getLogger(__name__)

TTFT_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
LATENCY_BUCKETS_S = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
ATTEMPT_BUCKETS = (1, 2, 3, 4, 5, 8)
PREFORK_POOLS = ("prefork", "processes")


class UsageMetrics:
    """The ledger's figures as Prometheus counters in one process's registry (a worker's, a
    gateway's): ``fleet_usage_turns_total{project,code}`` and
    ``fleet_usage_tokens_total{project,kind}``, counted when the ledger counted the turn (so a
    resent count is not counted twice here either). Per process: sum them over the fleet."""

    KINDS = ("prompt_tokens", "cached_tokens", "reasoning_tokens", "answer_tokens", "loop_cut_tokens")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.turns = Counter("fleet_usage_turns", "Model turns counted in the usage ledger",
                             ["project", "code"], registry=registry)
        self.tokens = Counter("fleet_usage_tokens", "Tokens of the model turns counted in the usage ledger",
                              ["project", "kind"], registry=registry)

    def observe(self, turn: TurnUsage) -> None:
        self.turns.labels(turn.project, turn.code).inc()
        fields = {name.rsplit("|", 1)[1]: value for name, value in turn.fields().items()}
        for kind in self.KINDS:
            if fields.get(kind):
                self.tokens.labels(turn.project, kind.removesuffix("_tokens")).inc(fields[kind])


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.results = Counter("fleet_worker_results", "Final envelopes published by this worker",
                               ["project", "code"], registry=r)
        self.tokens = Counter("fleet_worker_tokens", "Tokens of finished jobs (prompt, reasoning, answer)",
                              ["project", "kind"], registry=r)
        self.ttft = Histogram("fleet_worker_ttft_seconds", "Time to first token of the final attempt",
                              ["project"], buckets=TTFT_BUCKETS_S, registry=r)
        self.latency = Histogram("fleet_worker_latency_seconds", "Submission to final envelope",
                                 ["project"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.attempts = Histogram("fleet_worker_attempts", "Attempts per inference job",
                                  ["project"], buckets=ATTEMPT_BUCKETS, registry=r)
        self.continued = Counter("fleet_worker_continued_tokens",
                                 "Reasoning tokens final attempts continued instead of generating again",
                                 ["project", "backend"], registry=r)
        self.refused = Counter("fleet_worker_refused_messages",
                               "Broker messages refused before anything ran (E_MESSAGE_REFUSED)",
                               ["queue", "reason"], registry=r)

        self.usage = UsageMetrics(r)

    def observe_turn(self, turn: TurnUsage) -> None:
        self.usage.observe(turn)

    def observe_refused(self, queue: str, reason: str) -> None:
        self.refused.labels(queue, reason).inc()

    def observe(self, envelope: Envelope) -> None:
        project, usage, timings = envelope.project, envelope.usage, envelope.timings
        self.results.labels(project, envelope.code.value).inc()
        answer = max(0, usage.completion_tokens - usage.reasoning_tokens)
        for kind, count in (("prompt", usage.prompt_tokens), ("reasoning", usage.reasoning_tokens),
                            ("answer", answer)):
            self.tokens.labels(project, kind).inc(count)
        if timings.first_token_s is not None:
            self.ttft.labels(project).observe(timings.first_token_s)
        if timings.total_s is not None:
            self.latency.labels(project).observe(timings.total_s)
        if envelope.attempts:
            self.attempts.labels(project).observe(len(envelope.attempts))
            final = envelope.attempts[-1]
            if final.continued_tokens:
                self.continued.labels(project, final.backend).inc(final.continued_tokens)


def serve_when_started(app: Celery, metrics: WorkerMetrics, port: int, host: str = "127.0.0.1") -> None:
    """Serve ``metrics`` on ``port`` once a worker of ``app`` starts (never in Flower or a producer,
    which build the same app); 0 = off. ``host``: the ``metrics_host`` setting (loopback by default)."""
    if not port:
        return

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return  # another app's worker in this process (tests)
        pool = sender.pool_cls
        pool_name = pool if isinstance(pool, str) else f"{pool.__module__}.{pool.__qualname__}"
        if any(name in pool_name for name in PREFORK_POOLS):
            log.warning("worker_metrics_port is set but the %s pool runs tasks in child processes "
                        "whose figures this process cannot serve; no worker /metrics", pool_name)
            return
        serve_registry(metrics.registry, port, "worker", host)

    worker_init.connect(on_worker_init, weak=False)
