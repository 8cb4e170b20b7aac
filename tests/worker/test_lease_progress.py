"""The lease keeper's ``on_renew`` hook (the usage ledger's progress entries): called after each
renewal, and bookkeeping only: whatever it raises, the lease is kept and the stream goes on."""

from __future__ import annotations

import pytest
import redis

from fleet.worker.lease import LeaseKeeper
from tests.support.waiting import wait_until


class _Store:
    """Renews every lease (an admission store's ``renew``, the only call a keeper makes)."""

    def __init__(self) -> None:
        self.renewals = 0

    def renew(self, job_id: str, fence: int, now: float) -> bool:
        self.renewals += 1
        return True


def _keeper(store: _Store, on_renew) -> LeaseKeeper:  # type: ignore[no-untyped-def]
    return LeaseKeeper(store, lambda: False, "p/job", 1, ttl_s=0.3, on_renew=on_renew)  # type: ignore[arg-type]


def test_the_hook_runs_after_each_renewal() -> None:
    store, calls = _Store(), []
    with _keeper(store, lambda: calls.append(store.renewals)) as keeper:
        wait_until(lambda: len(calls) >= 3, 10, "three renewals")
    assert calls[:3] == [1, 2, 3] and not keeper.lost and not keeper.cancel.is_set()


@pytest.mark.parametrize("error", [redis.ConnectionError("gone"), RuntimeError("a bug")])
def test_a_hook_that_fails_never_costs_the_lease(error: Exception) -> None:
    store, raised = _Store(), []

    def fail() -> None:
        raised.append(1)
        raise error

    with _keeper(store, fail) as keeper:
        wait_until(lambda: len(raised) >= 3, 10, "three failing hooks")
    assert not keeper.lost and not keeper.cancel.is_set()
