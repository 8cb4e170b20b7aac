"""The Lua scripts on a real Redis: every key a script touches is one it declared in KEYS (what
Redis Cluster requires), and each script is registered once per store or client, not per call.

The key check watches the server with MONITOR while a workload runs every script: Redis lists the
commands a script runs (``[0 lua]``) next to the EVALSHA that ran them (after it in Redis 7.0,
before it in some other versions: a probe finds out), and COMMAND GETKEYS names the keys of each
command."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from fleet.core.codes import Code
from fleet.core.config import EXAMPLE_CONFIG, RepeatCacheSettings, load_settings
from fleet.core.keys import Keys
from fleet.core.lua import source
from fleet.core.models import Envelope
from fleet.core.repeatcache import Entry, RepeatCache
from fleet.core.results import ResultStore
from fleet.core.usage import TurnUsage, UsageLedger
from fleet.infer.retrying import RetryBudget
from fleet.prep.watchdog import PrepClaim, watch_once
from fleet.worker.heartbeat import beat, live_workers
from schedulers.policy.limits import Limits
from schedulers.policy.quota import Quota
from schedulers.store.base import BackendLimits, PendingItem, StoreConfig
from schedulers.store.keyquota import KeyQuotas
from schedulers.store.redis_store import COMPOSED, RedisStore

LUA_FOLDERS = ("schedulers.store", "fleet.core", "fleet.prep", "fleet.infer", "fleet.worker")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b", '"': '"', "\\": "\\"}


def _unquote(text: str) -> str:
    """Undo the quoting MONITOR applies to each argument (\\xHH and C escapes)."""
    return re.sub(r"\\(x[0-9a-fA-F]{2}|.)",
                  lambda m: chr(int(m.group(1)[1:], 16)) if len(m.group(1)) == 3 else _ESCAPES[m.group(1)],
                  text)


def _parse(line: str) -> tuple[bool, list[str]]:
    """(whether a script ran it, its arguments) of one MONITOR line."""
    head, _, rest = line.partition("] ")
    return head.endswith(" lua"), [_unquote(a) for a in _QUOTED.findall(rest)]


def _keys_of(client: redis.Redis, argv: list[str]) -> set[str]:
    try:
        return {k.decode() if isinstance(k, bytes) else k for k in client.command_getkeys(*argv)}
    except redis.ResponseError:  # a command without keys
        return set()


def _workload(client: redis.Redis, prefix: str) -> None:
    """Every script at least once: the dispatcher store's life cycle, heartbeats, publish, prep,
    retry budget."""
    now = [1_000.0]
    quotas = {"a": Quota(tokens_per_minute=10**6, max_in_flight=5),
              "b": Quota(requests_per_minute=100, tokens_per_day=10**9)}
    store = RedisStore(client, Keys(prefix), StoreConfig(gate=True, lease_ttl_s=10.0, quotas=quotas),
                       clock=lambda: now[0])
    store.record_backend(now[0], "", {})
    store.add_pending(PendingItem("a1", "a", 500, 400, deadline=5_000.0))
    store.add_pending_many([PendingItem("b1", "b", 9_000, 400, band="interactive"),
                            PendingItem("c1", "c", 100, 100), PendingItem("c2", "c", 100, 100)])
    grants = [store.admit_next(now[0]).grant for _ in range(2)]
    assert all(grants)
    first, second = (g for g in grants if g is not None)
    assert store.claim(first.job_id, first.fence, "w1", now[0])
    assert store.renew(first.job_id, first.fence, now[0])
    assert store.settle(first.job_id, first.fence, 10)  # its quota reservation (SETTLE)
    assert store.release(first.job_id, first.fence)
    assert store.requeue(second.job_id, second.fence)
    third = store.admit_next(now[0]).grant
    assert third is not None
    now[0] += 60.0
    store.record_backend(now[0], "", {})
    assert store.reap_expired(now[0]) == [third.job_id]
    assert store.cancel_pending("c2")
    store.add_pending(PendingItem("d1", "d", 100, 100, deadline=now[0] - 1))
    assert store.expire_deadlines(now[0]) == ["d1"]
    store.admit_many(now[0], 2)  # project d has no queue left: ADMIT prunes it
    store.record_backend(now[0], "", {})
    store.add_pending_many([PendingItem("e1", "e", 100, 100), PendingItem("e2", "e", 100, 100)])
    for _ in range(2):  # continuations: back in line at once, after a backoff, cancelled waiting
        grant = store.admit_next(now[0]).grant
        assert grant is not None
        assert store.readmit(grant.job_id, grant.fence, 300, now[0] + 5.0, now[0])
    assert store.grow(grant.job_id, 50_000)  # a tool result came in while it waits
    assert store.cancel_pending(grant.job_id)  # UNDEFER
    now[0] += 10.0
    store.record_backend(now[0], "", {})
    assert store.promote_due(now[0]) != []
    grant = store.admit_next(now[0]).grant
    assert grant is not None and store.readmit(grant.job_id, grant.fence, 300, now[0], now[0])
    # the gateway's way in (ADD + ADMIT + CLAIM), with no live inference worker: gateway only
    store.record_backend(now[0], "", {})
    results_, fence = store.enter_gateway(PendingItem("g1", "g", 100, 100, deadline=now[0] + 30),
                                          "gateway-1", now[0], True, 8)
    assert fence and any(r.grant is not None and r.grant.job_id == "g1" for r in results_)
    # a dispatcher's round while its worker gate holds (GWADMIT alone): gateway requests only
    store.enter_gateway(PendingItem("g2", "g", 100, 100, deadline=now[0] + 30), "gateway-1", now[0],
                        True, 0)
    assert "g2" in [r.grant.job_id for r in store.admit_gateway_only(now[0], 8) if r.grant is not None]

    settings = load_settings(EXAMPLE_CONFIG, env={})
    keys = Keys(prefix)
    beat(client, keys, "w1@host#1-ab")  # an inference worker's heartbeat, the dispatcher's gate
    assert live_workers(client, keys) == 1
    results = ResultStore(client, keys, settings)
    assert results.publish(Envelope.failure("j1", "p", Code.E_INTERNAL, "x"))
    assert results.publish(Envelope.failure("j2", "p", Code.E_INTERNAL, "x"), stream=None)
    signed = {"project": "triage", "job": {"id": "j3"}, "nonce": "n", "ts": "1", "sig": "x"}
    results.record("triage/j3", state="submitted", project="triage", signed=json.dumps(signed))
    client.zadd(keys.prepping("triage"), {"triage/j3": 0})
    assert watch_once(results, lambda _m: None, now=100.0, unclaimed_s=600) == ["triage/j3"]
    claim = PrepClaim(client, keys, "p/j4", "w1", ttl_s=30)
    assert claim.acquire()
    assert claim.renew_once()
    claim.release()

    budget = RetryBudget(client, keys, "p", ratio=0.5, clock=lambda: now[0])
    budget.first_attempt()
    assert budget.try_spend()

    ledger = UsageLedger(client, keys, settings.usage)
    assert ledger.count([TurnUsage("p", "j5", 1, 1, "OK", prompt_tokens=5)]) == 1

    key_quotas = KeyQuotas(client, keys)  # a gateway key's own quota: reserve, then settle
    assert key_quotas.reserve("p", "sha256:00000000", Quota(tokens_per_minute=10_000), "p/g9", 100, 100,
                              now[0]) is None
    assert key_quotas.settle("p", "p/g9", 50)

    cache = RepeatCache(client, keys, "p", RepeatCacheSettings(enabled=True, max_entries=1))
    for digest in ("d1", "d2"):  # the second evicts the first (max_entries)
        assert cache.put(digest, Entry("a", "", [], "stop", {}, "", now[0], now[0] + 60))
    assert cache.stats()["evictions"] == 1
    # queue jobs' runs (RCACHE_END): a runner, two waiters; one takes over, then the answer is kept
    assert cache.take_run("d3", "p/r") is None and cache.take_run("d3", "p/w1") == "p/r"
    cache.add_waiter("d3", "p/w1")
    cache.add_waiter("d3", "p/w2")
    taken = cache.end_run("d3", "p/r", kept=False)
    assert len(taken) == 1 and taken[0] in ("p/w1", "p/w2")
    assert cache.end_run("d3", taken[0], kept=True) == [w for w in ("p/w1", "p/w2") if w != taken[0]]
    # and a waiting job joins the store deferred (ADD with a not-before time)
    store.add_pending(PendingItem("f1", "f", 100, 100, not_before=now[0] + 30))
    assert store.promote_due(now[0] + 31) == ["f1"]


def _backends_workload(client: redis.Redis, prefix: str) -> None:
    """The dispatcher store's scripts with three backends: per-backend counters (bstate), scrapes
    and eligibility-class queues, each lease ending another way."""
    now = [1_000.0]
    config = StoreConfig.with_backends(
        [BackendLimits(name, Limits(max_num_seqs=2)) for name in ("gpu-a", "gpu-b", "small")],
        gate=True, lease_ttl_s=10.0, quotas={"a": Quota(tokens_per_minute=10**6, max_in_flight=4)})
    store = RedisStore(client, Keys(prefix), config, clock=lambda: now[0])
    for name in ("gpu-a", "gpu-b", "small"):
        store.record_backend(now[0], "", {}, name)
    store.add_pending_many([PendingItem(f"j{i}", "abc"[i % 3], 500, 400, eligible=(3, 2, 4)[i % 3],
                                        deadline=5_000.0) for i in range(6)])
    grants = [r.grant for r in store.admit_many(now[0], 8) if r.grant is not None]
    assert {g.backend for g in grants} == {"gpu-a", "gpu-b", "small"}
    first, second, third, fourth, *_ = grants
    assert store.claim(first.job_id, first.fence, "w1", now[0])
    assert store.release(first.job_id, first.fence)
    assert store.requeue(second.job_id, second.fence)
    assert store.readmit(third.job_id, third.fence, 300, now[0] + 5.0, now[0])
    assert store.grow(third.job_id, 2_000)
    now[0] += 20.0
    for name in ("gpu-a", "gpu-b", "small"):
        store.record_backend(now[0], "", {}, name)
    assert store.promote_due(now[0]) == [third.job_id]
    assert fourth.job_id in store.reap_expired(now[0])
    store.add_pending(PendingItem("d1", "d", 100, 100, deadline=now[0] - 1, eligible=2))
    assert store.expire_deadlines(now[0]) == ["d1"]
    assert store.cancel_pending(second.job_id)
    results, fence = store.enter_gateway(PendingItem("g1", "g", 100, 100, deadline=now[0] + 30, eligible=6),
                                         "gateway-1", now[0], True, 8)
    assert fence
    store.admit_gateway_only(now[0], 8)
    assert store.recount() == {}


def test_every_script_touches_only_the_keys_it_declares_with_several_backends(fresh_client, key_prefix) -> None:
    after = _script_lines_follow_evalsha(fresh_client, key_prefix)
    lines = _monitor_lines(fresh_client, key_prefix, lambda c: _backends_workload(c, key_prefix))
    problems, _ran = undeclared_keys(fresh_client, lines, after)
    assert problems == []
    assert cross_slot_keys(lines) == []


def _all_shas() -> dict[str, str]:
    """sha1 -> file of every script as the loader registers it (the store's behind its prelude
    and the scripts it uses)."""
    shas = {}
    for package in LUA_FOLDERS:
        folder = resources.files(package) / "lua"
        prelude = "prelude" if (folder / "prelude.lua").is_file() else None
        for path in folder.iterdir():
            if path.name.endswith(".lua") and path.name != "prelude.lua":
                name = path.name.removesuffix(".lua")
                text = source(package, name, prelude, COMPOSED.get(name, ()) if package == "schedulers.store" else ())
                shas[hashlib.sha1(text.encode()).hexdigest()] = f"{package}/lua/{path.name}"
    return shas


def _monitor_lines(client: redis.Redis, prefix: str, work: Callable[[redis.Redis], None]) -> list[list[str]]:
    """The commands Redis ran while ``work`` ran, as (by_script, argv) in MONITOR's order."""
    marker = f"{prefix}end-of-work"
    with client.monitor() as monitor:
        connection: Any = monitor.connection
        worker = redis.Redis(connection_pool=client.connection_pool)
        work(worker)
        worker.echo(marker)
        lines = []
        while marker not in (line := _text(connection.read_response())):
            lines.append(line)
        return lines


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _script_lines_follow_evalsha(client: redis.Redis, prefix: str) -> bool:
    probe = client.register_script("return redis.call('EXISTS', KEYS[1])")
    probe(keys=[f"{prefix}probe"])  # loaded now, so the monitored run is one EVALSHA
    lines = _monitor_lines(client, prefix, lambda c: probe(keys=[f"{prefix}probe"], client=c))
    return not _parse(lines[0])[0]


def undeclared_keys(client: redis.Redis, lines: list[str], after: bool) -> tuple[list[str], set[str]]:
    """(every undeclared key access, as 'script: command key'; the shas that ran). ``after``:
    a script's commands follow its EVALSHA in ``lines`` (else they precede it)."""
    shas, ran, problems = _all_shas(), set(), []
    calls: list[tuple[list[str], list[list[str]]]] = []  # (evalsha argv, the commands it ran)
    inner: list[list[str]] = []
    for line in lines:
        by_script, argv = _parse(line)
        if by_script:
            (calls[-1][1] if after and calls else inner).append(argv)
        elif argv and argv[0].upper() == "EVALSHA":
            calls.append((argv, [] if after else inner))
            inner = []
    for argv, commands in calls:
        sha, declared = argv[1], set(argv[3:3 + int(argv[2])])
        ran.add(sha)
        for command in commands:
            for key in sorted(_keys_of(client, command) - declared):
                problems.append(f"{shas.get(sha, sha)}: {command[0]} {key}")
    return problems, ran


@pytest.fixture
def fresh_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_every_script_touches_only_the_keys_it_declares(fresh_client, key_prefix) -> None:
    after = _script_lines_follow_evalsha(fresh_client, key_prefix)
    lines = _monitor_lines(fresh_client, key_prefix, lambda c: _workload(c, key_prefix))
    problems, ran = undeclared_keys(fresh_client, lines, after)
    assert problems == []
    assert sorted(_all_shas().get(sha, sha) for sha in set(_all_shas()) - ran) == []  # every script ran


def test_the_check_sees_an_undeclared_key(fresh_client, key_prefix) -> None:
    """The check above can fail: a script writing a key it built itself is caught."""
    after = _script_lines_follow_evalsha(fresh_client, key_prefix)
    sneaky = fresh_client.register_script("redis.call('SET', KEYS[1] .. ':other', '1') return 1")
    sneaky(keys=[f"{key_prefix}k"])
    lines = _monitor_lines(fresh_client, key_prefix, lambda c: sneaky(keys=[f"{key_prefix}k"], client=c))
    problems, _ran = undeclared_keys(fresh_client, lines, after)
    assert problems == [f"{sneaky.sha}: SET {key_prefix}k:other"]


# Keys of one call that may sit in another slot than KEYS[1], by script and KEYS position (1-based):
# publish.lua's shared code counter and project stream. Its header says what a Redis Cluster move
# does with them; any other split is a defect.
CROSS_SLOT_ALLOWED = {"fleet.core/lua/publish.lua": {4, 5}}


def cross_slot_keys(lines: list[str]) -> list[str]:
    """Every declared key of an EVALSHA in ``lines`` whose hash slot differs from its KEYS[1]'s,
    beyond CROSS_SLOT_ALLOWED, as 'script: KEYS[n] key'."""
    shas, problems = _all_shas(), []
    for line in lines:
        by_script, argv = _parse(line)
        if by_script or not argv or argv[0].upper() != "EVALSHA" or int(argv[2]) == 0:
            continue
        name, declared = shas.get(argv[1], argv[1]), argv[3:3 + int(argv[2])]
        slot = key_slot(declared[0].encode())
        allowed = CROSS_SLOT_ALLOWED.get(name, set())
        problems += [f"{name}: KEYS[{n}] {key}" for n, key in enumerate(declared, start=1)
                     if key_slot(key.encode()) != slot and n not in allowed]
    return problems


def test_the_keys_of_each_script_call_share_a_hash_slot(fresh_client, key_prefix) -> None:
    """What makes a move to Redis Cluster a configuration change: every key a script is given
    hashes to one slot (computed as Cluster does, CRC16 of the hash tag mod 16384)."""
    lines = _monitor_lines(fresh_client, key_prefix, lambda c: _workload(c, key_prefix))
    assert cross_slot_keys(lines) == []
    calls = [argv for by_script, argv in map(_parse, lines) if not by_script and argv]
    ran = {_all_shas().get(argv[1]) for argv in calls if argv[0].upper() == "EVALSHA"}
    assert set(CROSS_SLOT_ALLOWED) <= ran  # the exceptions were exercised, so the rule was applied


def test_the_slot_check_sees_keys_in_two_slots(fresh_client, key_prefix) -> None:
    """The check above can fail: a script given keys of two different hash tags is caught."""
    pair = fresh_client.register_script("return redis.call('EXISTS', KEYS[1], KEYS[2])")
    keys = [f"{key_prefix}{{a}}:x", f"{key_prefix}{{b}}:y"]
    pair(keys=keys)
    lines = _monitor_lines(fresh_client, key_prefix, lambda c: pair(keys=keys, client=c))
    assert cross_slot_keys(lines) == [f"{pair.sha}: KEYS[2] {keys[1]}"]


class CountingRedis(redis.Redis):
    """A client that counts how often each script text is registered on it."""

    registered: dict[str, int]

    def register_script(self, script: Any) -> Any:
        self.registered[script] = self.registered.get(script, 0) + 1
        return super().register_script(script)


def test_each_script_is_registered_once_per_client(redis_url: str, key_prefix: str) -> None:
    client = CountingRedis.from_url(redis_url)
    client.registered = {}
    results = ResultStore(client, Keys(key_prefix), load_settings(EXAMPLE_CONFIG, env={}))
    for _ in range(3):  # what a prep worker and a dispatcher's watchdog do over and over
        _prep_and_retry(client, results)
    store = RedisStore(client, Keys(key_prefix), StoreConfig(gate=False))
    before = dict(client.registered)
    for n in range(3):
        store.add_pending(PendingItem(f"s{n}", "a", 100, 100))
        grant = store.admit_next(1_000.0).grant
        assert grant is not None and store.release(grant.job_id, grant.fence)
    assert client.registered == before  # the store registered its scripts when it was made
    assert client.registered and set(client.registered.values()) == {1}
    client.close()


def _prep_and_retry(client: redis.Redis, results: ResultStore) -> None:
    keys = results.keys
    claim = PrepClaim(client, keys, "p/job", "w1", ttl_s=30)
    assert claim.acquire()
    claim.release()
    watch_once(results, lambda _m: None, now=0.0, unclaimed_s=600)
    RetryBudget(client, keys, "p", ratio=0.2).first_attempt()


def _lua_files() -> list[Any]:
    return [path for package in LUA_FOLDERS for path in (resources.files(package) / "lua").iterdir()
            if path.name.endswith(".lua")]


@pytest.mark.parametrize("path", _lua_files(), ids=lambda p: p.name)
def test_each_script_opens_with_its_keys_and_builds_no_key_itself(path: Any) -> None:
    text = path.read_text()
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("--"))
    assert text.startswith("--"), "a script opens with its comment block"
    used = set(re.findall(r"KEYS\[(\d+)\]", text.replace(header, "")))
    documented = set(re.findall(r"KEYS\[(\d+)", header))
    assert used <= documented, f"KEYS used but not described: {sorted(used - documented)}"
    # A key is never spelled out or concatenated in a call: it comes from KEYS (or a helper's
    # argument that its caller took from KEYS, which the MONITOR test above checks at run time).
    calls = re.findall(r"redis\.p?call\(\s*'\w+'\s*,\s*([^,)]+)", text.replace(header, ""))
    assert not [c for c in calls if ".." in c or "'" in c or "ARGV" in c]
