"""The gateway's Prometheus figures, served on its own port at ``/metrics``: requests by project and
code, queue wait and time to first token by project, tokens by project and kind, the connections
open and those closed by the connection limits (fleet/gateway/connections.py), and the usage
ledger's counters of the model turns this gateway counted (fleet/core/usage.py). One registry
per gateway (not prometheus_client's global one), so several gateways in one test process do not
collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleet.core.codes import Code
from fleet.core.models import Usage
from fleet.worker.metrics import UsageMetrics

WAIT_BUCKETS_S = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120)
TTFT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("fleet_gateway_requests", "Gateway requests by project and code",
                                ["project", "code"], registry=self.registry)
        self.queue_wait = Histogram("fleet_gateway_queue_wait_seconds", "Wait for admission",
                                    ["project"], buckets=WAIT_BUCKETS_S, registry=self.registry)
        self.ttft = Histogram("fleet_gateway_ttft_seconds", "Request received to first token",
                              ["project"], buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.tokens = Counter("fleet_gateway_tokens", "Tokens of gateway requests",
                              ["project", "kind"], registry=self.registry)
        self.connections_open = Gauge("fleet_gateway_connections_open", "Client connections open",
                                      registry=self.registry)
        self.connections_closed = Counter(
            "fleet_gateway_connections_closed", "Client connections closed by the connection limits",
            ["reason"], registry=self.registry)
        self.failovers = Counter(
            "fleet_gateway_failovers", "Requests a backend cut that went back through admission, by the "
            "backend that cut them and how they went on (continue: the reasoning kept; restart)",
            ["project", "backend", "how"], registry=self.registry)
        self.usage = UsageMetrics(self.registry)

    def failed_over(self, project: str, backend: str, how: str) -> None:
        self.failovers.labels(project, backend, how).inc()

    def finished(self, project: str, code: Code) -> None:
        self.requests.labels(project, code.value).inc()

    def request(self, project: str, code: Code, waited_s: float | None, first_token_s: float | None,
                usage: Usage) -> None:
        self.finished(project, code)
        if waited_s is not None:
            self.queue_wait.labels(project).observe(waited_s)
        if first_token_s is not None:
            self.ttft.labels(project).observe(first_token_s)
        self.tokens.labels(project, "prompt").inc(usage.prompt_tokens)
        self.tokens.labels(project, "completion").inc(usage.completion_tokens)
        self.tokens.labels(project, "reasoning").inc(usage.reasoning_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
