"""The prep watchdog on a real Redis: what stalled before hand-over is sent again, what went on
is left alone, a live claim blocks a second preparation, a poison message ends E_INTERNAL."""

import json

from fleet.core.codes import Code
from fleet.prep.watchdog import MAX_RESENDS, PrepClaim, watch_once
from tests.support.prep_records import setup, submitted


def test_stalled_jobs_are_sent_again_and_handed_over_ones_dropped(redis_client, key_prefix):
    _settings, keys, results = setup(redis_client, key_prefix)
    submitted(results, keys, "stalled")
    submitted(results, keys, "went-on", state="pending")
    submitted(results, keys, "not-due", due=10_000.0)
    sent = []
    assert watch_once(results, sent.append, now=100.0, unclaimed_s=600) == ["triage/stalled"]
    assert [s["job"]["id"] for s in sent] == ["stalled"]
    assert redis_client.zscore(keys.prepping("triage"), "triage/stalled") == 700.0  # looked at again later
    assert redis_client.zscore(keys.prepping("triage"), "triage/went-on") is None
    assert redis_client.zscore(keys.prepping("triage"), "triage/not-due") == 10_000.0


def test_a_live_claim_blocks_a_second_preparation_and_the_watchdog(redis_client, key_prefix):
    _settings, keys, results = setup(redis_client, key_prefix)
    submitted(results, keys, "busy")
    first = PrepClaim(redis_client, keys, "triage/busy", "worker-a", ttl_s=30)
    assert first.acquire()
    assert not PrepClaim(redis_client, keys, "triage/busy", "worker-b", ttl_s=30).acquire()
    sent = []
    assert watch_once(results, sent.append, now=10**10, unclaimed_s=600) == []
    first.release()
    assert redis_client.zscore(keys.prepping("triage"), "triage/busy") is None
    assert not redis_client.exists(keys.prep("triage/busy"))


def test_a_job_whose_workers_keep_dying_ends_internal(redis_client, key_prefix):
    _settings, keys, results = setup(redis_client, key_prefix)
    submitted(results, keys, "poison")
    sent = []
    for n in range(MAX_RESENDS + 1):
        redis_client.zadd(keys.prepping("triage"), {"triage/poison": 0})
        results.record("triage/poison", prep_claimed="1")  # a worker claimed it, then its claim lapsed
        watch_once(results, sent.append, now=100.0 + n, unclaimed_s=600)
    assert len(sent) == MAX_RESENDS
    envelope = results.get("triage/poison")
    assert envelope is not None and envelope.code == Code.E_INTERNAL


def test_a_job_only_waiting_in_a_queue_is_resent_but_never_failed(redis_client, key_prefix):
    _settings, keys, results = setup(redis_client, key_prefix)
    submitted(results, keys, "queued")
    sent = []
    for n in range(MAX_RESENDS + 3):
        redis_client.zadd(keys.prepping("triage"), {"triage/queued": 0})
        watch_once(results, sent.append, now=100.0 + n, unclaimed_s=600)
    assert len(sent) == MAX_RESENDS + 3 and results.get("triage/queued") is None


def test_a_due_job_is_sent_once_per_look(redis_client, key_prefix):
    _settings, keys, results = setup(redis_client, key_prefix)
    submitted(results, keys, "due")
    sent = []
    watch_once(results, sent.append, now=100.0, unclaimed_s=600)
    watch_once(results, sent.append, now=100.0, unclaimed_s=600)  # e.g. another dispatcher
    assert len(sent) == 1


def test_a_lapsed_claim_cannot_release_its_successors(redis_client, key_prefix):
    _settings, keys, results = setup(redis_client, key_prefix)
    old = PrepClaim(redis_client, keys, "triage/job", "worker-a", ttl_s=30)
    assert old.acquire()
    redis_client.delete(keys.prep("triage/job"))  # a's claim lapsed
    new = PrepClaim(redis_client, keys, "triage/job", "worker-b", ttl_s=30)
    assert new.acquire()
    old.release()
    assert redis_client.get(keys.prep("triage/job")) == b"worker-b"
    new.release()
    assert not redis_client.exists(keys.prep("triage/job"))


def test_entries_that_are_not_the_projects_jobs_are_dropped_never_sent(redis_client, key_prefix):
    """A project's producer may write its own watchdog zset and its own job records: a member
    naming another project's job, or a record whose stored message names another job, must not
    make the watchdog resend (and count against) someone else's job."""
    _settings, keys, results = setup(redis_client, key_prefix)
    theirs = "reports/theirs"
    signed = {"project": "reports", "job": {"id": "theirs"}, "nonce": "n", "ts": "1", "sig": "x"}
    results.record(theirs, state="submitted", project="reports", signed=json.dumps(signed),
                   prep_claimed="1")
    redis_client.zadd(keys.prepping("triage"), {theirs: 0, "no-ref-at-all": 0})
    # triage's own record, carrying a message of reports' job (or none that parses)
    results.record("triage/borrowed", state="submitted", project="triage", signed=json.dumps(signed))
    results.record("triage/garbled", state="submitted", project="triage", signed="{not json")
    redis_client.zadd(keys.prepping("triage"), {"triage/borrowed": 0, "triage/garbled": 0})
    submitted(results, keys, "own")
    sent = []
    assert watch_once(results, sent.append, now=100.0, unclaimed_s=600) == ["triage/own"]
    assert [s["job"]["id"] for s in sent] == ["own"]
    assert redis_client.zrange(keys.prepping("triage"), 0, -1) == [b"triage/own"]
    assert results.job_record(theirs).get("prep_resends") is None
    assert results.job_record(theirs).get("prep_claimed") == "1"


def test_entries_that_do_not_decode_never_stop_the_pass_for_other_projects(redis_client, key_prefix):
    """A producer writes its own watchdog zset and job records as any bytes it likes: a member or
    a record field that is not UTF-8 is dropped, and the projects after it are still watched
    (before, the decode error ended the whole pass every round: a stalled prep of 'research',
    after 'triage' in the settings, was never sent again)."""
    _settings, keys, results = setup(redis_client, key_prefix)
    redis_client.zadd(keys.prepping("triage"), {b"\xff\xfe": 0})
    redis_client.hset(keys.job("triage/bytes"), mapping={"state": b"\xff", "signed": b"\xfe"})
    redis_client.zadd(keys.prepping("triage"), {"triage/bytes": 0})
    signed = {"project": "research", "job": {"id": "stalled"}, "nonce": "n", "ts": "1", "sig": "x"}
    results.record("research/stalled", state="submitted", project="research", signed=json.dumps(signed))
    redis_client.zadd(keys.prepping("research"), {"research/stalled": 0})
    sent = []
    assert watch_once(results, sent.append, now=100.0, unclaimed_s=600) == ["research/stalled"]
    assert redis_client.zcard(keys.prepping("triage")) == 0
