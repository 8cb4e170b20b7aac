"""Projects on one broker cannot reach each other's jobs (per-project namespaces, the workers'
seal, signed cancel requests, rejections keyed by the whole message): a real fleet, two projects'
real Clients, and a hostile project B that has only its own secret and the public Client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from typing import Any

import pytest
import redis

import fleet.client as client_module
from fleet.client import Client
from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.errors import NotFound
from fleet.core.keys import job_ref
from fleet.core.signing import sign
from fleet.worker.app import create_app
from fleet.worker.dispatch import make_send
from fleet.worker.queues import CANCEL_TASK, PREP_TASK, project_queue
from schedulers.dispatcher import admit_all
from schedulers.store.base import PendingItem
from tests.support.fleet_harness import FleetProbe, Harness, make_config, write_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

A, B = "reports", "triage"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    config = make_config(tmp_path_factory.mktemp("ns"), admission={"lease_ttl_s": 5})
    with Harness(config) as harness:
        yield harness


@pytest.fixture
def probe(fleet: Harness) -> FleetProbe:
    return FleetProbe(fleet)


def own(settings: Settings, project: str) -> Settings:
    """What a project's producer holds: its own project (and secret) only."""
    return settings.model_copy(update={"projects": {project: settings.projects[project]}})


@pytest.fixture
def clients(fleet: Harness):
    a, b = Client(own(fleet.settings, A)), Client(own(fleet.settings, B))
    yield a, b
    a.close()
    b.close()


def ask(project: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"project": project, "messages": [{"role": "user", "content": text}],
            "thinking_budget": 2000, **extra}


def test_another_projects_job_id_is_another_job(clients, probe) -> None:
    a, b = clients
    job_id = a.submit(ask(A, "From A. [sim:think=400] [sim:answer=20]", id="shared-1"))
    assert b.submit(ask(B, "From B. [sim:think=50] [sim:answer=20]", id="shared-1")) == job_id
    got_a, got_b = a.result(job_id, timeout=120), b.result(job_id, timeout=120)
    assert got_a is not None and got_b is not None
    assert (got_a.project, got_a.code) == (A, Code.OK), got_a.message
    assert (got_b.project, got_b.code) == (B, Code.OK), got_b.message
    sent = [json.dumps(body["messages"]) for body in probe.sim_requests("shared-1")]
    assert sum("From A." in text for text in sent) == 1
    assert sum("From B." in text for text in sent) == 1


def test_a_second_submission_of_an_id_never_overwrites_the_first(clients, probe) -> None:
    a, _ = clients
    first = a.submit(ask(A, "First. [sim:think=50] [sim:answer=20]", id="twice-1"))
    a.submit(ask(A, "Second. [sim:think=50] [sim:answer=20]", id="twice-1"))
    envelope = a.result(first, timeout=120)
    assert envelope is not None and envelope.code == Code.OK, envelope
    sent = [json.dumps(body["messages"]) for body in probe.sim_requests("twice-1")]
    assert any("First." in text for text in sent)
    assert not any("Second." in text for text in sent)


def test_status_shows_no_other_project_and_no_signed_message(clients) -> None:
    a, b = clients
    job_id = a.submit(ask(A, "Status. [sim:think=50] [sim:answer=20]"))
    assert a.result(job_id, timeout=120) is not None
    with pytest.raises(NotFound):  # B has no such job
        b.status(job_id)
    mine = a.status(job_id)
    assert mine["state"] == "final" and mine["project"] == A
    assert not {"signed", "job", "nonce", "seal", "digest"} & set(mine)


def test_another_project_cannot_cancel_a_job(clients, probe) -> None:
    a, b = clients
    job_id = a.submit(ask(A, "Keep me. [sim:think=1500] [sim:answer=20]"))
    wait_until(lambda: probe.h.client.status(f"{A}/{job_id}").get("state") == "running", 60,
               "A's job to run")
    with pytest.raises(NotFound):  # B has no such job
        b.cancel(job_id)
    # B signs a cancel request with its own secret, writes it where A's would go and asks A's
    # prep workers to act on it: nobody acts on a request A did not sign.
    forged = json.dumps(sign({"cancel": job_id, "project": A}, A, own(probe.h.settings, B)
                             .projects[B].secret))
    b.redis.set(b.keys.cancel(job_ref(A, job_id)), forged)
    b._celery.send_task(CANCEL_TASK, kwargs={"project": A, "job_id": job_id},
                        queue=project_queue(A))
    envelope = a.result(job_id, timeout=120)
    assert envelope is not None and envelope.code == Code.OK, envelope.message


def test_a_copied_nonce_cannot_make_a_job_look_rejected(clients, monkeypatch) -> None:
    a, b = clients
    sent: list[dict[str, Any]] = []
    real_sign = client_module.sign

    def keep(*args: Any, **kwargs: Any) -> dict[str, Any]:
        sent.append(real_sign(*args, **kwargs))
        return sent[-1]

    monkeypatch.setattr(client_module, "sign", keep)
    job_id = a.submit(ask(A, "Genuine. [sim:think=1500] [sim:answer=20]"))
    genuine = sent[-1]
    forged = dict(genuine, sig="0" * 64,
                  job=dict(genuine["job"], messages=[{"role": "user", "content": "forged"}]))
    b._celery.send_task(PREP_TASK, kwargs={"project": A, "job_id": job_id, "signed": forged},
                        queue=project_queue(A))
    envelope = a.result(job_id, timeout=120)
    assert envelope is not None and envelope.code == Code.OK, envelope.message


def test_a_record_not_sealed_by_the_workers_runs_nothing(fleet, clients, probe) -> None:
    a, _ = clients
    job_id, ref = "forged-1", job_ref(A, "forged-1")
    job = ask(A, "Run me without prep. [sim:think=50]", id=job_id)
    job_json = json.dumps({**job, "submitted_at": time.time()})
    a.redis.hset(a.keys.job(ref), mapping={
        "project": A, "kind": "infer", "state": "pending", "job": job_json,
        "plan": json.dumps({"thinking_budget": 100, "content_reserve": 100, "max_tokens": 200,
                            "prompt_tokens": 10, "fits": True, "room_tokens": 1000,
                            "max_model_len": 262144}),
        "seal": "0" * 64, "fence_tag": ""})
    probe.store().add_pending(PendingItem(job_id=ref, project=A, prompt_tokens=10,
                                          max_new_tokens=200))
    envelope = a.result(job_id, timeout=120)
    assert envelope is not None and envelope.code == Code.E_AUTH, envelope
    assert "seal" in envelope.message
    assert probe.sim_requests(job_id) == []


def test_prep_refuses_a_record_of_another_project(fleet, clients, probe) -> None:
    a, _ = clients
    job_id, ref = "claimed-1", job_ref(A, "claimed-1")
    # what a client without ACLs could plant under A's ref before A's message arrives
    a.redis.hset(a.keys.job(ref), mapping={"project": B, "state": "submitted", "digest": "0"})
    raw = ask(A, "Genuine, but the record is not A's. [sim:think=50]", id=job_id)
    signed = sign(raw, A, fleet.settings.projects[A].secret)
    a._celery.send_task(PREP_TASK, kwargs={"project": A, "job_id": job_id, "signed": signed},
                        queue=project_queue(A))

    def rejected() -> list[bytes]:
        return [f[b"reason"] for _, f in a.redis.xrange(a.keys.rejections)
                if f[b"job_id"] == job_id.encode()]

    reasons = wait_until(rejected, 60, "the prep worker to refuse the job")
    assert reasons == [b"the job record belongs to another project"]
    assert probe.sim_requests(job_id) == []


def test_a_backdated_submitted_at_does_not_jump_the_queue(tmp_path) -> None:
    config = make_config(tmp_path)
    with Harness(config, dispatchers=0) as harness:  # nothing admits: the job stays pending
        probe = FleetProbe(harness)
        before = time.time()
        job_id = harness.client.submit(ask(A, "Old news. [sim:think=50]", submitted_at=1.0))
        ref = job_ref(A, job_id)
        wait_until(lambda: harness.client.status(ref).get("state") == "pending", 60,
                   "the job to be handed to the dispatcher")
        store = probe.store()
        # items[ref] = "project band size prompt max_new kv long enq ..." (schedulers/store/lua/prelude.lua)
        enqueued = float(store._client.hget(store._key("items"), ref).split()[7])
        assert enqueued >= before


def test_a_job_edited_to_claim_a_gateway_after_prep_ends_e_auth(tmp_path) -> None:
    """A producer may write its own job hash; setting ``origin=gateway`` on its prepared job
    used to send the grant to a gateway's list (the job never ran, never ended, and came back
    to take a slot at every lease expiry). The seal covers origin and gateway now."""
    config = make_config(tmp_path, admission={"backend_gate": False, "metrics_port": 0})
    with Harness(config, dispatchers=0) as harness:  # the admission round runs below
        probe = FleetProbe(harness)
        a = Client(own(harness.settings, A))
        try:
            job_id = a.submit(ask(A, "Divert me. [sim:think=50]"))
            ref = job_ref(A, job_id)
            wait_until(lambda: a.status(job_id).get("state") == "pending", 60,
                       "the job to be prepared")
            a.redis.hset(a.keys.job(ref), mapping={"origin": "gateway",
                                                   "gateway": "0123456789abcdef"})
            client = redis.Redis.from_url(harness.settings.broker_url)
            send = make_send(harness.settings, client, create_app(harness.settings))
            admitted = admit_all(probe.store(), send, time.time())  # a dispatcher's round
            assert probe.snapshot().admissions == 1, admitted
            envelope = a.result(job_id, timeout=120)
            assert envelope is not None and envelope.code == Code.E_AUTH, envelope
            assert "seal" in envelope.message
            assert list(client.scan_iter(match=f"{harness.settings.key_prefix}gwgrants:*")) == []
            assert probe.sim_requests(job_id) == []
            client.close()
        finally:
            a.close()


@pytest.mark.parametrize("role", ["worker", "dispatcher", "gateway"])
def test_a_process_without_the_workers_key_does_not_start(tmp_path, role: str) -> None:
    """Workers seal and check, dispatchers check a gateway's seal before the hand-off, the
    gateway seals its requests' records: none of them runs without the key."""
    config = make_config(tmp_path)
    data = tomllib.loads(config.read_text(encoding="utf-8"))
    del data["security"]["worker_secret"]
    write_config(config, data)
    env = {**os.environ, "FLEET_CONFIG": str(config)}
    done = subprocess.run([sys.executable, "-m", "fleet", role], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "worker_secret" in done.stderr
