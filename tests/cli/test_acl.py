"""Redis ACL users (``fleet acl``) on a private redis-server started with them: a project's
producer reaches its own project only, and the whole fleet works with every process on its own
user (producer, worker, dispatcher; the simulator stands in for vLLM)."""

from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from rich.console import Console

from fleet.cli.batch import run_batch
from fleet.client import Client
from fleet.core.codes import Code
from fleet.core.config import load_settings
from fleet.core.exposure import unrestricted_default_user, warn_shared_broker
from fleet.core.keys import Keys, job_ref
from fleet.core.usage import TurnUsage, UsageLedger, hour_of
from fleet.core.usagereport import totals
from fleet.local.embedded import start_redis
from fleet.local.processes import LocalFleet
from fleet.worker.app import create_app
from fleet.worker.queues import INFER_TASK, PREP_TASK, project_queue
from tests.support.acl_broker import A, AclBroker, B, broker
from tests.support.fleet_harness import make_config
from tests.support.processes import kill_tree
from tests.support.waiting import wait_until

__all__ = ["broker"]  # the ACL broker fixture, in place of the root conftest's


def denied(call) -> bool:
    """True when the ACL refused the call; any other error came from running it."""
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError:
        return False
    return False


def test_a_producer_reaches_nothing_of_another_project_nor_the_fleet(broker: AclBroker) -> None:
    keys = Keys(broker.settings.key_prefix)
    q = f"{broker.settings.key_prefix}q:"
    with Client(broker.settings_for(f"fleet-producer-{A}", A)) as a:
        job_id = a.submit({"project": A, "messages": [{"role": "user", "content": "hi"}]})
        assert a.status(job_id)["state"] == "submitted"
    producer_b = broker.client(f"fleet-producer-{B}")
    theirs = job_ref(A, job_id)
    attempts = {
        "read A's record": lambda: producer_b.hgetall(keys.job(theirs)),
        "overwrite A's record": lambda: producer_b.hset(keys.job(theirs), "state", "x"),
        "read A's result": lambda: producer_b.get(keys.result(theirs)),
        "read A's events": lambda: producer_b.xrange(keys.events(theirs)),
        "read A's results": lambda: producer_b.xrange(keys.results(A)),
        "cancel A's job": lambda: producer_b.set(keys.cancel(theirs), "1"),
        "pre-seed A's idempotency key": lambda: producer_b.set(keys.idem(A, "k"), "mine"),
        "push onto fleet.infer": lambda: producer_b.lpush(f"{q}fleet.infer", "{}"),
        "push onto A's queue": lambda: producer_b.lpush(f"{q}{project_queue(A)}", "{}"),
        "write the dispatcher store": lambda: producer_b.hset(f"{keys.dispatch}item:x", "prompt", 1),
        "read the dispatcher store": lambda: producer_b.hgetall(f"{keys.dispatch}state"),
        "claim a nonce": lambda: producer_b.set(keys.nonce(A, "n"), "x"),
        # what A sent to a backend: read (did A send this prompt?) or forged (steer A's routing)
        "read what A sent": lambda: producer_b.get(keys.sent(A, "0" * 64, "gpu-b")),
        "forge what A sent": lambda: producer_b.set(keys.sent(A, "0" * 64, "gpu-b"), "99999"),
        # quotas (the dispatcher store): spend A's, give its own back, drop a reservation
        "spend A's quota": lambda: producer_b.hincrby(f"{keys.dispatch}quota:{A}:m:1", "t", 10**6),
        "free its own quota": lambda: producer_b.decrby(f"{keys.dispatch}quota:{B}:d:20261202", 10**6),
        "drop its own reservation": lambda: producer_b.hdel(f"{keys.dispatch}qres", f"{B}/j"),
        "read A's quota": lambda: producer_b.get(f"{keys.dispatch}quota:{A}:mo:202612"),
        # an API key's own quota (the gateway's KEYQUOTA): spend one of A's keys', free its own
        "spend an A key's quota": lambda: producer_b.hincrby(
            f"{keys.prefix}kquota:{{{A}}}:sha256:00000000:m:1", "t", 10**6),
        "free its own key's quota": lambda: producer_b.delete(f"{keys.prefix}kquota:{{{B}}}:sha256:00000000:d:1"),
        # the exact-repeat cache: read A's answers, plant one for A, or for itself
        "read A's kept answers": lambda: producer_b.hgetall(keys.rcache(A, "e")),
        "plant an answer for A": lambda: producer_b.hset(keys.rcache(A, "e"), "0" * 64, "{}"),
        "plant an answer for itself": lambda: producer_b.hset(keys.rcache(B, "e"), "0" * 64, "{}"),
        "hold A's computing lock": lambda: producer_b.set(keys.rcache(A, "run:" + "0" * 64), "x"),
        # queue jobs' runs and waiters: name itself A's computing job, or wait for its answer
        "take A's queue run": lambda: producer_b.set(keys.rcache(A, "jrun:" + "0" * 64), f"{B}/j"),
        "wait on A's answer": lambda: producer_b.sadd(keys.rcache(A, "jwait:" + "0" * 64), f"{B}/j"),
        "take its own run": lambda: producer_b.set(keys.rcache(B, "jrun:" + "0" * 64), f"{B}/j"),
        "read the rejections": lambda: producer_b.xrange(keys.rejections),
        "list keys": lambda: producer_b.keys("*"),
        "flush": lambda: producer_b.flushdb(),
        "change ACLs": lambda: producer_b.execute_command("ACL", "SETUSER", f"fleet-producer-{B}", "~*"),
    }
    allowed = [what for what, call in attempts.items() if not denied(call)]
    assert allowed == []
    # ... while its own keys answer
    assert producer_b.set(keys.idem(B, "k"), "mine") and producer_b.get(keys.idem(B, "k")) == b"mine"
    producer_b.close()


def test_a_producer_reads_its_own_usage_only_and_writes_none(broker: AclBroker) -> None:
    """The usage ledger: the fleet's users count, a producer reads its own project's hours and
    nothing else, and cannot change them (nor plant a turn marker that would keep a turn of its
    own from being counted)."""
    keys, usage = Keys(broker.settings.key_prefix), broker.settings.usage
    worker = broker.client("fleet-worker")
    now = time.time()
    turns = [TurnUsage(project, f"j-{project}", 1, 1, "OK", prompt_tokens=70, answer_tokens=9,
                       ended_at=now) for project in (A, B)]
    assert UsageLedger(worker, keys, usage).count(turns) == 2
    producer_a = broker.client(f"fleet-producer-{A}")
    mine = totals(UsageLedger(producer_a, keys, usage).read(A, now - 3600, now + 3600))
    assert (mine["requests"], mine["prompt_tokens"], mine["answer_tokens"]) == (1, 70, 9)
    own_hour, their_hour = keys.usage_hour(A, hour_of(now)), keys.usage_hour(B, hour_of(now))
    script = UsageLedger(producer_a, keys, usage)
    attempts = {
        "read B's usage": lambda: producer_a.hgetall(their_hour),
        "read B's usage through the ledger": lambda: script.read(B, now - 3600, now + 3600),
        "count a turn of its own": lambda: producer_a.hincrby(own_hour, "queue|local|requests", -1),
        "delete its own hour": lambda: producer_a.delete(own_hour),
        "shorten its own hour's TTL": lambda: producer_a.expire(own_hour, 1),
        "plant a turn marker": lambda: producer_a.set(keys.usage_turn(A, "next", 9, 1), "1"),
        "read a turn marker": lambda: producer_a.get(keys.usage_turn(A, f"j-{A}", 1, 1)),
        "plant a progress entry": lambda: producer_a.set(keys.usage_open(A, "own"), '{"fence": 1}'),
        "read a progress entry": lambda: producer_a.get(keys.usage_open(A, f"j-{A}")),
        "run the ledger's script": lambda: script._script(
            keys=[own_hour, keys.usage_turn(A, "own", 1, 1), keys.usage_open(A, "own")],
            args=[60, 60, 1, "queue|local|requests", 5]),
    }
    allowed = [what for what, call in attempts.items() if not denied(call)]
    assert allowed == []
    assert totals(UsageLedger(worker, keys, usage).read(A, now - 3600, now + 3600))["requests"] == 1
    producer_a.close()
    worker.close()


# What a producer must not run: code of its own. The review's script wrote its job key and then
# looped (``while true do end``); SCRIPT KILL cannot stop a script that has written, so every
# client of the shared broker got BUSY until SHUTDOWN NOSAVE. These texts return at once.
OWN_SCRIPT = "redis.call('SET', KEYS[1], 'x') return 1"
OWN_LIBRARY = "#!lua name=own\nredis.register_function('own', function() return 1 end)"


def test_a_producer_cannot_load_or_run_code_of_its_own(broker: AclBroker) -> None:
    """Loading a script and running it by its SHA1 is EVAL in two steps: a producer may do
    neither, nor run a text someone else loaded, nor define a function."""
    keys = Keys(broker.settings.key_prefix)
    own_key = keys.job(job_ref(B, "own-code"))
    operator = broker.client("fleet-operator")
    sha = operator.script_load(OWN_SCRIPT)  # as if any other user had loaded that text
    producer = broker.client(f"fleet-producer-{B}")
    attempts = {
        "SCRIPT LOAD": lambda: producer.script_load(OWN_SCRIPT),
        "EVAL": lambda: producer.eval(OWN_SCRIPT, 1, own_key),
        "EVAL_RO": lambda: producer.eval_ro("return 1", 1, own_key),
        "EVALSHA of a loaded text": lambda: producer.evalsha(sha, 1, own_key),
        "EVALSHA_RO": lambda: producer.evalsha_ro(sha, 1, own_key),
        "FUNCTION LOAD": lambda: producer.function_load(OWN_LIBRARY),
        "FCALL": lambda: producer.fcall("own", 0),
        "SCRIPT FLUSH": lambda: producer.script_flush(),
        "SCRIPT KILL": lambda: producer.script_kill(),
    }
    allowed = [what for what, call in attempts.items() if not denied(call)]
    operator.script_flush()
    operator.close()
    producer.close()
    assert allowed == []


def test_a_producer_has_no_costly_command_even_on_its_own_keys(broker: AclBroker) -> None:
    """The producer's commands are named one by one (fleet/cli/acl.py): what would make the
    shared broker work long or allocate much for one call is not among them, own keys or not."""
    keys = Keys(broker.settings.key_prefix)
    first, second = keys.idem(B, "costly-1"), keys.idem(B, "costly-2")
    producer = broker.client(f"fleet-producer-{B}")
    assert producer.set(first, "a" * 1000) and producer.set(second, "b" * 1000)
    attempts = {
        "LCS": lambda: producer.lcs(first, second),
        "SORT": lambda: producer.sort(first),
        "SUNIONSTORE": lambda: producer.sunionstore(first, [second]),
        "ZUNIONSTORE": lambda: producer.zunionstore(first, [second]),
        "BITOP": lambda: producer.bitop("AND", first, second),
        "LRANGE": lambda: producer.lrange(first, 0, -1),
        "COPY": lambda: producer.copy(first, second, replace=True),
        "SCAN": lambda: producer.scan(0),
        "OBJECT": lambda: producer.object("encoding", first),
        "MEMORY USAGE": lambda: producer.memory_usage(first),
        "CLIENT PAUSE": lambda: producer.client_pause(1),
    }
    allowed = [what for what, call in attempts.items() if not denied(call)]
    producer.delete(first, second)
    producer.close()
    assert allowed == []


def test_a_producer_cannot_watch_other_projects_keys_through_client_tracking(broker: AclBroker) -> None:
    """Key permissions do not filter the invalidations of CLIENT TRACKING ON BCAST: a producer
    allowed it would be told every key any project writes (``job:{reports/<id>}`` the moment
    the other project submits). Its connection commands are named one by one, and no CLIENT
    subcommand that watches, lists or acts on other connections is among them."""
    producer = broker.client(f"fleet-producer-{B}")
    attempts = {
        "CLIENT TRACKING ON BCAST": lambda: producer.execute_command("CLIENT", "TRACKING", "ON", "BCAST"),
        "CLIENT TRACKING ON REDIRECT": lambda: producer.execute_command(
            "CLIENT", "TRACKING", "ON", "REDIRECT", "1", "BCAST"),
        "CLIENT CACHING": lambda: producer.execute_command("CLIENT", "CACHING", "YES"),
        "CLIENT TRACKINGINFO": lambda: producer.execute_command("CLIENT", "TRACKINGINFO"),
        "CLIENT GETREDIR": lambda: producer.execute_command("CLIENT", "GETREDIR"),
        "CLIENT LIST": lambda: producer.client_list(),
        "CLIENT INFO": lambda: producer.client_info(),
        "CLIENT KILL": lambda: producer.execute_command("CLIENT", "KILL", "ID", "1"),
        "CLIENT UNBLOCK": lambda: producer.execute_command("CLIENT", "UNBLOCK", "1"),
        "CLIENT NO-EVICT": lambda: producer.execute_command("CLIENT", "NO-EVICT", "ON"),
        "CLIENT REPLY": lambda: producer.execute_command("CLIENT", "REPLY", "ON"),
    }
    allowed = [what for what, call in attempts.items() if not denied(call)]
    producer.close()
    assert allowed == []


def test_a_producer_cannot_send_tasks_to_other_queues(broker: AclBroker) -> None:
    app = create_app(broker.settings_for(f"fleet-producer-{B}", B))
    with pytest.raises(Exception, match="permission"):
        app.send_task(INFER_TASK, kwargs={"ref": f"{A}/x", "project": A, "fence": 1})
    with pytest.raises(Exception, match="permission"):
        app.send_task(PREP_TASK, kwargs={"project": A, "job_id": "x", "signed": {}},
                      queue=project_queue(A))


def test_the_fleet_works_with_every_process_on_its_own_user(broker: AclBroker, tmp_path) -> None:
    fleet = LocalFleet(broker.settings, workers=0, dispatchers=0, sim_speed=50.0)
    fleet.start()
    operator = broker.client("fleet-operator")
    operator.acl_log_reset()
    # the fixture's own project secrets reach the children the way an operator's would
    projects = json.dumps({name: p.model_dump(mode="json") for name, p in broker.settings.projects.items()})
    try:
        fleet.spawn("dispatcher", ["dispatcher", "--log-level", "WARNING"],
                    {"FLEET_BROKER_URL": broker.url("fleet-dispatcher"),
                     "FLEET_ADMISSION_METRICS_PORT": "0", "FLEET_PROJECTS": projects})
        fleet.spawn("worker", ["worker", "--concurrency", "4", "--log-level", "WARNING",
                               "--hostname", f"acl-{uuid.uuid4().hex[:6]}@%h"],
                    {"FLEET_BROKER_URL": broker.url("fleet-worker"), "FLEET_PROJECTS": projects})
        settings = broker.settings_for(f"fleet-producer-{A}", A)
        # jobs of A left queued by earlier tests of the module run first: count from their end
        wait_until(lambda: _every_job_final(operator, broker.settings.key_prefix, A), 60,
                   "earlier tests' jobs to end")
        with Client(settings) as client:
            ledger = UsageLedger(client.redis, Keys(settings.key_prefix), settings.usage)
            before = totals(ledger.read(A, time.time() - 7200, time.time() + 3600))
            job_id = client.submit({"project": A, "thinking_budget": 500, "messages": [
                {"role": "user", "content": "Hello. [sim:think=50] [sim:answer=20]"}]})
            envelope = client.result(job_id, timeout=120)
            assert envelope is not None and envelope.code == Code.OK, envelope
            queued = client.submit({"project": A, "messages": [
                {"role": "user", "content": "Never mind. [sim:stall=1000000] [sim:think=50]"}]})
            assert client.cancel(queued)
            cancelled = client.result(queued, timeout=120)
            assert cancelled is not None and cancelled.code == Code.E_CANCELLED, cancelled
            _idempotent_submit_and_a_batch(client, tmp_path)
            # the worker counted every model turn in A's ledger, which A's own user reads
            after = totals(ledger.read(A, time.time() - 7200, time.time() + 3600))
        counted = {name: after[name] - before.get(name, 0) for name in after}
        assert counted["code:OK"] == 6, counted  # the jobs that answered, one turn each
        assert counted["requests"] - counted["code:OK"] == counted.get("code:E_CANCELLED", 0) <= 1
        # the rules name every command the producer's path sends: the ACL refused it nothing
        # (but redis-py's CLIENT SETINFO on Redis 7.2 and later, which it ignores: fleet/cli/acl.py)
        refused = [(entry["username"], entry["object"]) for entry in operator.acl_log(count=100)
                   if entry["object"] != "client|setinfo"]
        assert refused == [], refused
    finally:
        operator.close()
        fleet.close()


def _every_job_final(operator: redis.Redis, prefix: str, project: str) -> bool:
    records = [operator.hget(key, "state") for key in operator.scan_iter(f"{prefix}job:{{{project}/*")]
    return all(state == b"final" for state in records)


def _idempotent_submit_and_a_batch(client: Client, folder: Path) -> None:
    """The rest of a producer's path on its own user: an idempotent submit sent twice, a job id
    of its own submitted twice, status and events, then ``fleet batch`` waiting for its results."""
    once = {"project": A, "idempotency_key": f"acl-{uuid.uuid4().hex}", "messages": [
        {"role": "user", "content": "Once. [sim:think=20] [sim:answer=10]"}]}
    job_id = client.submit(once)
    assert client.submit(once) == job_id
    own = {"project": A, "id": f"own-{uuid.uuid4().hex[:8]}", "messages": [
        {"role": "user", "content": "Mine. [sim:think=20] [sim:answer=10]"}]}
    assert client.submit(own) == client.submit(own) == own["id"]
    for submitted in (job_id, own["id"]):
        envelope = client.result(submitted, timeout=120)
        assert envelope is not None and envelope.code == Code.OK, envelope
        assert client.status(submitted)["state"] == "final"
        assert [event["type"] for event in client.events(submitted)][-1] == "final"
    lines = [{"custom_id": f"line-{n}", "messages": [
        {"role": "user", "content": f"Line {n}. [sim:think=20] [sim:answer=10]"}]} for n in range(3)]
    batch, out = folder / "batch.jsonl", folder / "out.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    assert run_batch(client, batch, A, wait=True, out=out, timeout_s=120,
                     console=Console(file=io.StringIO())) == 0
    rows = [json.loads(row) for row in out.read_text(encoding="utf-8").splitlines()]
    assert sorted((row["custom_id"], row["code"]) for row in rows) == [
        (f"line-{n}", "OK") for n in range(3)]


def test_passwords_from_the_settings_survive_a_second_apply(tmp_path: Path) -> None:
    """``acl.passwords`` (or FLEET_ACL_PASSWORDS) and ``acl.password_file`` give users their
    passwords: ``fleet acl --apply`` run twice leaves the handed-out URLs working, and only the
    users given none get new ones; neither ``fleet acl`` nor ``fleet config`` prints a configured
    one (before, ``fleet acl`` printed every configured password in its URL at each run)."""
    server = start_redis()
    worker_pw, producer_pw, file_pw, stale_pw = (secrets.token_urlsafe(18) for _ in range(4))
    password_file = tmp_path / "acl-passwords"
    password_file.write_text(f"# rotated 2026-12-01\nfleet-producer-{A} {file_pw}\n"
                             f"fleet-worker {stale_pw}  # the settings' entry wins\n",
                             encoding="utf-8")
    password_file.chmod(0o600)
    config = make_config(tmp_path, broker_url=server.url,
                         acl={"passwords": {f"fleet-producer-{B}": producer_pw},
                              "password_file": str(password_file)})
    config.chmod(0o600)
    env = {**os.environ, "FLEET_CONFIG": str(config),
           "FLEET_ACL_PASSWORDS": json.dumps({"fleet-worker": worker_pw,
                                              f"fleet-producer-{B}": producer_pw})}
    try:
        runs = [subprocess.run([sys.executable, "-m", "fleet", "acl", "--apply"], env=env,
                               capture_output=True, text=True, timeout=120) for _ in range(2)]
        for run in runs:
            assert run.returncode == 0, run.stderr
        given = {"fleet-worker": worker_pw, f"fleet-producer-{B}": producer_pw,
                 f"fleet-producer-{A}": file_pw}
        host = server.url.removeprefix("redis://")
        for user, password in given.items():
            for run in runs:
                assert password not in run.stdout + run.stderr
                assert f"{user}\t(from settings)\n" in run.stdout
                assert "can read it" not in run.stderr and "readable by others" not in run.stderr
            url = f"redis://{user}:{password}@{host}"
            with redis.Redis.from_url(url) as client:
                assert client.ping()  # authenticated as that user
        # a user given no password got a new one at each run: only the second still works
        operator = [dict(line.split("\t") for line in run.stdout.splitlines() if "\t" in line)
                    ["fleet-operator"] for run in runs]
        assert operator[0] != operator[1]
        with redis.Redis.from_url(operator[1]) as client:
            assert client.acl_whoami() == "fleet-operator"
        with redis.Redis.from_url(operator[0]) as client, pytest.raises(redis.AuthenticationError):
            client.ping()
        assert stale_pw not in runs[0].stdout
        shown = subprocess.run([sys.executable, "-m", "fleet", "config"], env=env,
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr
        secret = load_settings(config, env={}).security.worker_secret
        assert secret and secret not in shown.stdout
        assert worker_pw not in shown.stdout and producer_pw not in shown.stdout
        assert str(password_file) in shown.stdout
    finally:
        server.close()


@pytest.mark.parametrize(("entry", "named"), [
    ("fleet-wroker " + "p" * 20, "fleet-wroker"),  # a typo: that user would get a new password
    ("fleet-worker short", "at least 16"),
    ("fleet-worker", "expected <user> <password>"),
])
def test_a_bad_password_file_is_refused_naming_the_entry(tmp_path: Path, entry: str, named: str) -> None:
    password_file = tmp_path / "acl-passwords"
    password_file.write_text(entry + "\n", encoding="utf-8")
    config = make_config(tmp_path, acl={"password_file": str(password_file)})
    done = subprocess.run([sys.executable, "-m", "fleet", "acl"], env={**os.environ, "FLEET_CONFIG": str(config)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and named in done.stderr
    assert "p" * 20 not in done.stderr + done.stdout


@pytest.mark.parametrize("mode", [0o644, 0o640], ids=["everyone", "group"])
def test_passwords_in_a_file_others_can_read_are_a_warning_never_shown(tmp_path: Path, mode: int) -> None:
    """``acl.passwords`` inline in a fleet.toml that others read (everyone, or its group: the
    fleet's group is how every unit reads the config, and each would learn them; before, only a
    file everyone could read was a warning) and a password file readable by others: each command
    that loads them says so in one WARNING that names the file, never the password."""
    inline_pw, file_pw = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    password_file = tmp_path / "acl-passwords"
    password_file.write_text(f"fleet-worker {file_pw}\n", encoding="utf-8")
    password_file.chmod(0o644)
    config = make_config(tmp_path, acl={"passwords": {"fleet-operator": inline_pw},
                                        "password_file": str(password_file)})
    config.chmod(mode)
    env = {**os.environ, "FLEET_CONFIG": str(config)}
    for command in (["acl"], ["config"]):
        done = subprocess.run([sys.executable, "-m", "fleet", *command], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert any(str(config) in line and "acl.passwords" in line and "can read it" in line
                   for line in done.stderr.splitlines()), done.stderr
        assert inline_pw not in done.stdout + done.stderr and file_pw not in done.stdout + done.stderr
    acl = subprocess.run([sys.executable, "-m", "fleet", "acl"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert any(str(password_file) in line and "readable by others" in line
               for line in acl.stderr.splitlines()), acl.stderr
    assert "fleet-operator\t(from settings)" in acl.stdout
    assert "fleet-worker\t(from settings)" in acl.stdout
    assert "fleet-dispatcher\tredis://fleet-dispatcher:" in acl.stdout  # generated: shown once


def test_a_password_file_keeps_a_hash_inside_a_password(tmp_path: Path) -> None:
    """A ``#`` inside a password is part of it (before, the rest of the line was cut off as a
    comment and the shorter password applied silently); a line starting with ``#`` is a comment."""
    from fleet.cli.acl import read_password_file

    password_file = tmp_path / "acl-passwords"
    password = "abcdefghijklmnopqrst#uvwxyz0123456789"
    starts = "#" + password
    password_file.write_text(f"  # rotated\nfleet-worker {password}  # a comment\n"
                             f"fleet-operator {starts}\n", encoding="utf-8")
    assert read_password_file(password_file) == {"fleet-worker": password, "fleet-operator": starts}


def test_a_process_on_the_all_powerful_default_user_warns(tmp_path: Path) -> None:
    """Without ACL users every producer can read and write every project's keys: a dispatcher
    (like a worker or gateway) started on such a broker says so in one line at start."""
    config = make_config(tmp_path)
    process = subprocess.Popen([sys.executable, "-m", "fleet", "dispatcher"],
                               env={**os.environ, "FLEET_CONFIG": str(config)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    lines: list[str] = []
    assert process.stderr is not None
    threading.Thread(target=lambda: lines.extend(process.stderr or []), daemon=True).start()
    try:
        wait_until(lambda: any("dispatcher running" in line for line in lines), 60,
                   "the dispatcher to start")
        warnings = [line for line in lines if "default user" in line]
        assert len(warnings) == 1 and "WARNING" in warnings[0], lines
        assert "every project's jobs and results" in warnings[0] and "fleet acl" in warnings[0]
    finally:
        kill_tree(process)


def test_the_fleets_own_users_get_no_warning(broker: AclBroker) -> None:
    for user in ("fleet-worker", "fleet-dispatcher", "fleet-operator", f"fleet-producer-{A}"):
        with broker.client(user) as client:
            assert not unrestricted_default_user(client), user
    assert not warn_shared_broker(broker.settings_for("fleet-worker"), broker.client("fleet-worker"),
                                  local_broker=False, role="worker")


def test_a_producer_publishes_its_tasks_sent_events_only(broker: AclBroker) -> None:
    """Flower believes every event on the celeryev channels: a producer may send the "sent"
    event of its own tasks and nothing else (no task failing or handed on, no worker)."""
    producer = broker.client(f"fleet-producer-{B}")
    events = f"{broker.settings.key_prefix}q:/{broker.settings.broker_url.rsplit('/', 1)[-1]}.celeryev/"
    try:
        assert not denied(lambda: producer.publish(events + "task.sent", "{}"))
        for forged in ("task.failed", "task.succeeded", "task.continued", "worker.heartbeat"):
            assert denied(lambda channel=events + forged: producer.publish(channel, "{}")), forged
    finally:
        producer.close()
