"""The admission store interface: what the dispatcher, the prep worker and the inference worker
need from the shared dispatcher state. Two implementations ship: ``MemoryStore`` (in-memory twin,
schedulers/memory_store.py) and ``RedisStore`` (atomic Lua scripts, schedulers/redis_store.py).
The same test suite runs against both.

Life of a job in the store:
  add_pending -> [fair pick + admit_next: lease granted, fence issued] -> renew ... -> release
                 \\-> cancel_pending (job removed, never admitted)
  a lease not renewed before its expiry is reaped by ``reap_expired``: the job goes back to
  pending at its original place in line, and the old fence is dead (renew/release with it fail).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

Band = Literal["interactive", "batch"]


@dataclass(frozen=True)
class PendingItem:
    job_id: str
    project: str
    prompt_tokens: int
    max_new_tokens: int
    band: Band = "batch"
    priority: int = 0  # higher first, inside a project's band
    enqueued_at: float = 0.0  # unix seconds; set by the store when 0


@dataclass(frozen=True)
class Grant:
    job_id: str
    project: str
    fence: int
    prompt_tokens: int
    kv_tokens: int
    long: bool
    lease_expires_at: float
    waited_s: float


@dataclass(frozen=True)
class AdmitResult:
    """What one admission round decided: a grant, or why nothing was admitted."""

    grant: Grant | None
    hold_reason: str | None = None  # "empty", "seqs", "kv", "long", "bucket", "spacing", "backend"
    retry_in_s: float | None = None  # when a time-based hold (bucket, spacing) lifts


@dataclass
class StoreSnapshot:
    pending: dict[str, dict[str, int]] = field(default_factory=dict)  # project -> band -> count
    in_flight: int = 0
    reserved_kv_tokens: int = 0
    long_in_flight: int = 0
    admissions: int = 0
    holds: dict[str, int] = field(default_factory=dict)


class AdmissionStore(Protocol):
    def add_pending(self, item: PendingItem) -> None: ...

    def admit_next(self, now: float) -> AdmitResult: ...

    def renew(self, job_id: str, fence: int, now: float) -> bool: ...

    def release(self, job_id: str, fence: int) -> bool: ...

    def reap_expired(self, now: float) -> list[str]: ...

    def cancel_pending(self, job_id: str) -> bool: ...

    def snapshot(self) -> StoreSnapshot: ...

    def wait_for_wake(self, timeout_s: float) -> bool: ...
