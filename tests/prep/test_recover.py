"""The look for lost prep messages (fleet/prep/recover.py) on a real Redis: only a submitted job
with no message in the broker and no claim is made due at once; a restarted server is noticed by
its new run_id even when no call failed. Fails when a job that is queued, claimed or handed over
is made due, or when a restart goes unnoticed."""

import redis

from fleet.prep.recover import BrokerReturns, look_for_lost
from fleet.prep.watchdog import PrepClaim
from tests.support.fleet_harness import RestartableRedis
from tests.support.prep_records import setup, submitted

LATER = 10_000.0


def test_only_a_job_whose_message_is_nowhere_is_made_due(redis_client, key_prefix):
    _settings, keys, results = setup(redis_client, key_prefix)
    for job_id in ("lost", "queued", "claimed"):
        submitted(results, keys, job_id, due=LATER)
    submitted(results, keys, "went-on", state="pending", due=LATER)
    claim = PrepClaim(redis_client, keys, "triage/claimed", "worker-a", ttl_s=30)
    assert claim.acquire()
    try:
        lost = look_for_lost(results, lambda: {"triage/queued"}, now=100.0)
    finally:
        claim.release()
    assert lost == ["triage/lost"]
    assert redis_client.zscore(keys.prepping("triage"), "triage/lost") == 100.0
    assert redis_client.zscore(keys.prepping("triage"), "triage/queued") == LATER


def test_nothing_waiting_reads_nothing_from_the_broker(redis_client, key_prefix):
    _settings, _keys, results = setup(redis_client, key_prefix)
    assert look_for_lost(results, lambda: (_ for _ in ()).throw(AssertionError("read")), now=1.0) == []


def test_a_restart_is_noticed_by_its_new_run_id(broker: RestartableRedis):
    client = redis.Redis.from_url(broker.url)
    returns = BrokerReturns(client)
    assert returns.came_back()  # the first look: a process starting
    assert not returns.came_back()
    broker.stop()
    broker.start()
    client.connection_pool.disconnect()  # as a client that never saw an error
    assert returns.came_back()
    assert not returns.came_back()
    client.close()


def test_a_failed_call_counts_as_away(redis_client):
    returns = BrokerReturns(redis_client)
    returns.came_back()
    returns.failed(redis.ConnectionError("gone"))
    assert returns.came_back()

