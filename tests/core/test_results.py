import threading
import time
from collections import Counter

import redis

from fleet.core.codes import Code
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.events import EventSink
from fleet.core.keys import Keys
from fleet.core.models import Envelope
from fleet.core.results import ResultFollower, ResultStore


def store(redis_client, key_prefix):
    return ResultStore(redis_client, Keys(key_prefix), load_settings(EXAMPLE_CONFIG, env={}))


def test_publish_is_exactly_once(redis_client, key_prefix):
    results = store(redis_client, key_prefix)
    first = Envelope(job_id="j1", project="reports", code=Code.OK, content="a")
    second = Envelope(job_id="j1", project="reports", code=Code.E_INTERNAL)
    assert results.publish(first) is True
    assert results.publish(second) is False
    assert results.get("reports/j1").code == Code.OK
    assert redis_client.xlen(Keys(key_prefix).results("reports")) == 1


def test_wait_blocks_until_published(redis_client, key_prefix):
    results = store(redis_client, key_prefix)
    started = threading.Event()

    def finish():
        started.wait()
        results.publish(Envelope(job_id="j2", project="triage", code=Code.OK))

    results.record("triage/j2", state="submitted")  # a submitted job has its record
    thread = threading.Thread(target=finish)
    thread.start()
    assert results.wait("triage/j2", 0.01) is None
    started.set()
    envelope = results.wait("triage/j2", 30)
    thread.join()
    assert envelope is not None and envelope.code == Code.OK


def test_rejections_stay_out_of_project_results(redis_client, key_prefix):
    results = store(redis_client, key_prefix)
    results.record("reports/j3", state="submitted", digest="d-mine")
    results.reject("j3", "reports", "bad signature", "d-mine")
    keys = Keys(key_prefix)
    assert results.final("reports/j3").code == Code.E_AUTH  # the submitter sees its own rejection
    assert results.get("reports/j3") is None  # but the job has no final result
    assert redis_client.xlen(keys.results("reports")) == 0
    assert redis_client.xlen(keys.rejections) == 1


def test_a_forged_message_cannot_end_someone_elses_job(redis_client, key_prefix):
    results = store(redis_client, key_prefix)
    results.record("reports/victim", state="pending", digest="d-real")
    results.reject("victim", "reports", "bad signature", "d-forged")  # same job, another message
    assert results.final("reports/victim") is None and results.get("reports/victim") is None
    assert results.publish(Envelope(job_id="victim", project="reports", code=Code.OK))


def test_follower_sees_results_and_rejections(redis_client, key_prefix):
    results = store(redis_client, key_prefix)
    follower = ResultFollower(results, {"reports"})
    results.publish(Envelope(job_id="a", project="reports", code=Code.OK))
    results.record("reports/b", state="submitted", digest="d-b")
    results.reject("b", "reports", "bad signature", "d-b")
    refs = {"reports/a", "reports/b"}
    got = {e.job_id: e.code for e in follower.follow(refs, timeout_s=10, block_ms=50)}
    assert got == {"a": Code.OK, "b": Code.E_AUTH}


def test_result_codes_reach_the_metrics(redis_client, key_prefix):
    from prometheus_client import CollectorRegistry, generate_latest

    from schedulers.dispatcher import ResultCodeCollector

    results = store(redis_client, key_prefix)
    results.publish(Envelope(job_id="x1", project="reports", code=Code.OK))
    results.publish(Envelope(job_id="x2", project="reports", code=Code.OK))
    results.publish(Envelope(job_id="x3", project="triage", code=Code.E_THINK_LOOP))
    registry = CollectorRegistry()
    registry.register(ResultCodeCollector(redis_client, Keys(key_prefix)))
    text = generate_latest(registry).decode()
    assert 'fleet_results_total{code="OK",project="reports"} 2.0' in text
    assert 'fleet_results_total{code="E_THINK_LOOP",project="triage"} 1.0' in text


class CountingRedis(redis.Redis):
    """A client that counts the commands it sends, by name."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: Counter[str] = Counter()

    def execute_command(self, *args, **options):
        self.sent[str(args[0]).upper()] += 1
        return super().execute_command(*args, **options)


def test_wait_reads_the_result_only_when_an_ending_event_arrives(redis_url, redis_client, key_prefix):
    """Progress events (prepared, admitted, reasoning, ...) wake ``wait`` on its XREAD but cost no
    read of the result: before, each one cost four round trips on the queue path."""
    settings = load_settings(EXAMPLE_CONFIG, env={})
    counting = CountingRedis.from_url(redis_url)
    waiter = ResultStore(counting, Keys(key_prefix), settings)
    writer = store(redis_client, key_prefix)
    ref = "triage/j9"
    writer.record(ref, state="submitted")
    sink = EventSink(redis_client, Keys(key_prefix), ref, 60)
    sink.emit("queued")
    got: list[Envelope | None] = []
    thread = threading.Thread(target=lambda: got.append(waiter.wait(ref, 60)))
    thread.start()

    def waiter_back_in_xread(seen: int) -> None:
        deadline = time.monotonic() + 30
        while counting.sent["XREAD"] <= seen and time.monotonic() < deadline:
            time.sleep(0.001)

    waiter_back_in_xread(0)
    for n in range(20):
        seen = counting.sent["XREAD"]
        sink.emit("reasoning", n=n)
        waiter_back_in_xread(seen)  # it woke for this event and waits again
    writer.publish(Envelope(job_id="j9", project="triage", code=Code.OK))
    thread.join(timeout=30)
    assert got and got[0] is not None and got[0].code == Code.OK
    assert counting.sent["XREAD"] >= 20  # it woke for the progress events
    # the result read before waiting and after the final event (and after a quiet 2 s XREAD, should
    # this busy machine stall the writer that long); before: one read per progress event
    assert counting.sent["GET"] <= 4


def test_create_records_a_job_once_even_when_submitted_twice_at_once(redis_client, key_prefix):
    """``create`` is a WATCH/MULTI transaction (no script: producers may run none): of many
    creations of one ref at the same moment exactly one writes, the record is the winner's
    whole, and the prep watchdog holds the ref once."""
    results, keys = store(redis_client, key_prefix), Keys(key_prefix)
    clients = [redis.Redis(connection_pool=redis_client.connection_pool) for _ in range(8)]
    stores = [ResultStore(client, keys, results.settings) for client in clients]
    start = threading.Barrier(len(stores))
    won: list[str] = []

    def submit(number: int) -> None:
        start.wait()
        if stores[number].create("reports/j9", "reports", 50.0, state="submitted", digest=str(number),
                                 plan={"n": number}):
            won.append(str(number))

    threads = [threading.Thread(target=submit, args=(number,)) for number in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1
    record = results.job_record("reports/j9")
    assert record == {"state": "submitted", "digest": won[0], "plan": f'{{"n": {won[0]}}}'}
    assert redis_client.ttl(keys.job("reports/j9")) > 0
    assert redis_client.zrange(keys.prepping("reports"), 0, -1, withscores=True) == [(b"reports/j9", 50.0)]
    assert not results.create("reports/j9", "reports", 60.0, state="x")
    assert results.job_record("reports/j9")["state"] == "submitted"
