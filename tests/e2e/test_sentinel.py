"""Redis Sentinel: one broker URL shape for every part (fleet/core/redisconn.py), and a failover
in the middle of a batch through the real fleet (docs/operations.md, "High availability").

The failover test runs on loopback: one master, one replica and three Sentinels
(fleet/local/topology.py), a dispatcher, two Celery workers and ``fleet sim`` as processes, all
given only the ``sentinel://...`` URL. The master is killed with ``kill -9`` while jobs run; the
Sentinels promote the replica and every part must find it by itself.

What a failover may lose: Redis replicates asynchronously, so a write the old master acknowledged
in the last moment before it died and had not yet sent to the replica is gone. A job whose record
or Celery message was such a write has no envelope: the test names every job without one, with
the state its record shows on the new master (none at all: the submission itself was lost), and
fails if it is not one of those.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis

from fleet.core.codes import Code
from fleet.core.config import load_settings
from fleet.core.errors import ConfigError
from fleet.core.redisconn import celery_transport_options, mask_url, parse_sentinel_url, redis_client
from fleet.local.topology import MASTER_NAME, RedisNode, SentinelGroup
from fleet.worker.app import create_app
from tests.support.fleet_harness import FleetProbe, Harness, make_config
from tests.support.waiting import wait_until

CAP = 4


def sentinel_group() -> SentinelGroup:
    """The topology's master, replica and Sentinels, the replica's first full sync started at once
    (Redis waits ``repl-diskless-sync-delay``, 5 s by default, for more replicas to share it)."""
    return SentinelGroup(data_args=["--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0"])


def test_a_sentinel_url_names_its_sentinels_db_and_the_masters_credentials() -> None:
    parsed = parse_sentinel_url("sentinel://app:s%40cret@10.0.0.1:26379/3;sentinel://10.0.0.2;"
                                "sentinel://10.0.0.3:26380")
    assert parsed.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("10.0.0.3", 26380))
    assert (parsed.db, parsed.username, parsed.password) == (3, "app", "s@cret")


@pytest.mark.parametrize("url, message", [
    ("sentinel://h1:26379;redis://h2:6379", "starts with sentinel://"),
    ("sentinel://:26379", "names no host"),
    ("sentinel://h1:26379/zero", "db of a Sentinel URL is a number"),
    ("sentinel://h1:26379;sentinel://h2:26379/3", "go on its first sentinel:// part"),
])
def test_a_malformed_sentinel_url_is_a_config_error_naming_the_fault(
        tmp_path, url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_settings(make_config(tmp_path), env={"FLEET_BROKER_URL": url})
    assert "broker_url" in str(caught.value)


def test_every_password_of_a_sentinel_url_is_masked() -> None:
    shown = mask_url("sentinel://a:one@h1:1;sentinel://b:two@h2:2/0")
    assert "one" not in shown and "two" not in shown and "h2:2" in shown


def test_celery_gets_the_master_name_only_for_a_sentinel_url(tmp_path) -> None:
    plain = load_settings(make_config(tmp_path))
    assert celery_transport_options(plain) == {}
    sentinel = load_settings(make_config(tmp_path), env={
        "FLEET_BROKER_URL": "sentinel://127.0.0.1:1;sentinel://127.0.0.1:2/0",
        "FLEET_REDIS_MASTER_NAME": "m1", "FLEET_REDIS_SENTINEL_PASSWORD": "pw"})
    options = create_app(sentinel).conf.broker_transport_options
    assert options["master_name"] == "m1" and options["sentinel_kwargs"] == {"password": "pw"}
    assert options["global_keyprefix"] == f"{sentinel.key_prefix}q:"


# -- the failover, through the real fleet ---------------------------------------------------------
@pytest.mark.slow
def test_the_fleets_clients_follow_a_failover_and_reload_their_scripts(tmp_path) -> None:
    """A client from the factory writes through a Lua script, the master dies, and the same client
    (same Script objects) goes on against the promoted replica."""
    with sentinel_group() as group:
        settings = load_settings(make_config(tmp_path, broker_url=group.url,
                                             redis={"master_name": MASTER_NAME}))
        client = redis_client(settings)
        script = client.register_script("return redis.call('INCR', KEYS[1])")
        key = f"{settings.key_prefix}counter"
        assert script(keys=[key]) == 1
        wait_until(lambda: _replicated(group, key), 10, "the replica to have the counter")
        old, _ = group.kill_master()
        # NOSCRIPT on the new master: loaded again, then run. Until every Sentinel has taken the
        # promotion in, one may still answer "no master" (MasterNotFoundError, a ConnectionError):
        # the fleet's loops retry such errors, and so does the test, the same client throughout.
        assert _retrying(lambda: script(keys=[key])) == 2
        assert group.master().port != old.port
        client.close()


def _retrying(call: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _replicated(group: SentinelGroup, key: str) -> bool:
    others = [n for n in group.nodes if n.alive() and n.port != group.master_port()]
    return all(redis.Redis(port=n.port).get(key) is not None for n in others)


def _ask(project: str, n: int) -> dict:
    return {"project": project, "messages": [{"role": "user", "content": f"job {n}: [sim:think=600] [sim:answer=20]"}],
            "thinking_budget": 2000, "content_reserve": 256}


class Supervisor:
    """Restarts any fleet process that exits, as the deploy's restart policy would, and counts it."""

    def __init__(self, fleet: Harness) -> None:
        self.fleet, self.restarted = fleet, Counter[str]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.restarted.update(self.fleet.fleet.restart_exited())

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.mark.slow
def test_kill_9_of_the_master_mid_batch_every_job_ends_once_under_the_cap(tmp_path) -> None:
    """Every client finds the new master, nothing is done twice, the cap holds, and no process
    exits: the workers ride the failover out on fleet/worker/transport.py's SentinelTransport (the
    supervisor, a deploy's restart policy, only counts what would have needed it)."""
    with sentinel_group() as sentinels:
        config = make_config(tmp_path, broker_url=sentinels.url, redis={"master_name": MASTER_NAME},
                             backend={"max_num_seqs": CAP}, admission={"lease_ttl_s": 3},
                             retry={"backoff_base_s": 0.2, "backoff_max_s": 0.5})
        with Harness(config, sim_speed=100, workers=2, dispatchers=1) as fleet, Supervisor(fleet) as supervisor:
            probe = FleetProbe(fleet)
            projects = sorted(fleet.settings.projects)
            ids = [fleet.client.submit(_ask(projects[n % len(projects)], n)) for n in range(40)]
            wait_until(lambda: sum(probe.envelope_counts().values()) >= 5, 120, "the first envelopes")
            old, _failover_s = sentinels.kill_master()
            lost = _lost_submissions(fleet, ids)
            kept = [j for j in ids if j not in lost]
            wait_until(lambda: all(probe.envelope_counts()[j] >= 1 for j in kept), 120,
                       "an envelope for every job the failover kept")
            counts = probe.envelope_counts()
            assert {j: counts[j] for j in kept} == dict.fromkeys(kept, 1)
            codes = Counter(fleet.client.result(j, timeout=10).code for j in kept)
            assert set(codes) == {Code.OK}, codes
            # the backend's own count over the whole run, failover included
            assert probe.sim_stats()["max_running_seen"] <= CAP
            wait_until(lambda: probe.snapshot().in_flight == 0, 30, "every lease to be released")
            assert len(lost) <= 2, f"the failover lost {lost}"
            assert sentinels.master().port != old.port
            assert not supervisor.restarted, f"processes exited on the failover: {supervisor.restarted}"


def _lost_submissions(fleet: Harness, ids: list[str]) -> list[str]:
    """Jobs whose record the new master does not have (acknowledged by the old master, never
    replicated): nothing can deliver them an envelope."""
    found: list[list[str]] = []

    def read() -> bool:
        try:
            found.append([j for j in ids if not fleet.client.results.job_record(fleet.client.ref(j))])
        except redis.RedisError:
            return False
        return True

    wait_until(read, 30, "the new master to answer")
    return found[-1]


def test_a_node_restarts_on_its_port_with_its_aof() -> None:
    node = RedisNode(["--appendonly", "yes", "--appendfsync", "always", "--save", ""]).start()
    try:
        redis.Redis(port=node.port).set("kept", 1)
        node.kill()
        node.start()
        assert redis.Redis(port=node.port).get("kept") == b"1"
    finally:
        node.close()


def test_acl_urls_and_channels_of_a_sentinel_broker(tmp_path) -> None:
    """``fleet acl`` puts each user's credentials where the master's are read (the first part)
    and grants the event channel of the URL's db, not of a db parsed out of the wrong part."""
    from fleet.cli.acl import AclUser, producer_rules

    url = "sentinel://s1:26379/4;sentinel://s2:26379;sentinel://s3:26379"
    user = AclUser("fleet-worker", [], "pw")
    assert user.url(url) == "sentinel://fleet-worker:pw@s1:26379/4;sentinel://s2:26379;sentinel://s3:26379"
    assert parse_sentinel_url(user.url(url)).password == "pw"
    settings = load_settings(make_config(tmp_path), env={"FLEET_BROKER_URL": url})
    assert f"&{settings.key_prefix}q:/4.celeryev/task.sent" in producer_rules(settings, "triage")
