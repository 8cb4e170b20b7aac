"""What one worker or dispatcher process holds: settings, one Redis connection pool and the
objects built on it. Built once per process (per Celery app) and injected into the tasks, so no
module keeps a global client of its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import redis
from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.core.models import Envelope
from fleet.core.redisconn import redis_client
from fleet.core.results import ResultStore
from fleet.core.usage import TurnUsage, UsageLedger

if TYPE_CHECKING:  # the heavy modules are imported on first use, in the worker that needs them
    from fleet.infer.vllm import VllmClient
    from fleet.prep.collect import Collector
    from fleet.prep.tokens import TokenCounter
    from schedulers.store.redis_store import RedisStore


@dataclass(frozen=True)
class OnBackend:
    """One backend as a turn sees it (``Runtime.on_backend``)."""

    settings: Settings
    vllm: VllmClient
    counter: TokenCounter


@dataclass
class Runtime:
    settings: Settings
    on_publish: Callable[[Envelope], None] | None = None  # each final envelope this process writes
    # Celery's send_task (name, kwargs=..., queue=...): a worker sends a tool round's tasks with it
    send_task: Callable[..., object] | None = None
    on_turn: Callable[[TurnUsage], None] | None = None  # each model turn this process counted

    @cached_property
    def redis(self) -> redis.Redis:
        return redis_client(self.settings, health_check_interval=30, socket_keepalive=True)

    @cached_property
    def lease_redis(self) -> Redis:
        """The lease keeper's client: short timeouts and no retries, so one call to a Redis that
        drops packets cannot block past the keeper's own 90%-of-TTL rule (fleet/worker/lease.py)."""
        timeout_s = max(0.2, min(2.0, self.settings.admission.lease_ttl_s / 10))
        return redis_client(self.settings, socket_timeout=timeout_s,
                            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))

    @cached_property
    def keys(self) -> Keys:
        return Keys(self.settings.key_prefix)

    @cached_property
    def results(self) -> ResultStore:
        return ResultStore(self.redis, self.keys, self.settings, on_publish=self.on_publish)

    @cached_property
    def ledger(self) -> UsageLedger:
        return UsageLedger(self.redis, self.keys, self.settings.usage, on_count=self.on_turn)

    @cached_property
    def store(self) -> RedisStore:
        from schedulers.store import make_store

        return make_store(self.settings, self.redis)

    @cached_property
    def lease_store(self) -> RedisStore:
        """The admission store on the lease keeper's client (renewals)."""
        from schedulers.store import make_store

        return make_store(self.settings, self.lease_redis)

    @cached_property
    def counter(self) -> TokenCounter:
        from fleet.prep.tokens import TokenCounter

        backend = self.settings.backend
        return TokenCounter(backend.url, backend.model, self.redis, self.keys)

    def on_backend(self, name: str) -> OnBackend:
        """What a turn granted on backend ``name`` streams with: its settings (``backend`` is that
        entry), its HTTP client and its token counter, each built once per process and backend.
        KeyError for a name the settings do not have ('': the first backend)."""
        settings = self.settings.on_backend(name)
        if settings is self.settings:
            return OnBackend(settings, self.vllm, self.counter)
        views = self.__dict__.setdefault("_backends", {})
        if settings.backend.name not in views:
            from fleet.infer.vllm import VllmClient
            from fleet.prep.tokens import TokenCounter

            backend = settings.backend
            views[backend.name] = OnBackend(
                settings,
                VllmClient(backend.url, backend.model, api_key=backend.api_key, timeouts=settings.timeouts),
                TokenCounter(backend.url, backend.model, self.redis, self.keys))
        return views[settings.backend.name]

    def backend_clients(self) -> list[VllmClient]:
        """Every backend client this process built (to close them)."""
        views = self.__dict__.get("_backends", {})
        return [self.vllm, *(view.vllm for view in views.values())]

    @cached_property
    def collector(self) -> Collector:
        from fleet.prep.collect import Collector

        return Collector(self.settings.collect)

    @cached_property
    def vllm(self) -> VllmClient:
        from fleet.infer.vllm import VllmClient

        backend = self.settings.backend
        return VllmClient(
            backend.url, backend.model, api_key=backend.api_key, timeouts=self.settings.timeouts
        )
