"""A worker's runtime in one process with the real pieces (the test Redis, job records, a
``fleet sim`` process), for tests that drive the task functions directly (not through Celery).

Its fixtures (``sim``, ``rt``, ``tool_rt``) are loaded for every test folder by the root conftest
(``pytest_plugins``); a module may define its own ``sim``. The helpers submit a job the way the
client and the prep task do, admit it, run it and read its envelope."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from fleet.core.config import EXAMPLE_CONFIG, Settings, load_settings
from fleet.core.keys import Keys, job_ref
from fleet.core.models import Envelope
from fleet.core.signing import sign
from fleet.worker.jobs.infer import infer_job
from fleet.worker.jobs.prep import prep_job
from fleet.worker.runtime import Runtime
from tests.support.testenv import TEST_REDIS_URL

SPEED = 40.0


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    server = pytest.importorskip("fleet.sim.server")
    proc = server.start_sim_process(speed=SPEED, seed=7, think_min_tokens=150,
                                    think_max_tokens=300, answer_min_tokens=10,
                                    answer_max_tokens=30)
    try:
        yield proc.base_url
    finally:
        proc.stop()


LEASE_TTL_S = 5.0


def runtime(sim: str, key_prefix: str, reports: dict[str, Any] | None = None,
            backend: dict[str, Any] | None = None, admission: dict[str, Any] | None = None,
            others: dict[str, dict[str, Any]] | None = None,
            backends: list[str] | None = None) -> Iterator[Runtime]:
    """A worker's runtime on the test Redis and ``sim``; ``reports``: more project settings;
    ``others``: more projects, by name, with their settings; ``backends``: several entries of
    these names instead of one, each ``sim`` with ``backend``'s settings."""
    cfg: Settings = load_settings(
        EXAMPLE_CONFIG, env={}, broker_url=TEST_REDIS_URL, key_prefix=key_prefix,
        backend={"url": sim, **(backend or {})},
        admission={"backend_gate": False, "lease_ttl_s": LEASE_TTL_S, **(admission or {})},
        security={"worker_secret": f"test-worker-{uuid.uuid4().hex}"},
        retry={"backoff_base_s": 0.0, "backoff_max_s": 0.0},
        timeouts={"first_token_s": 5, "idle_s": 5, "attempt_s": 60},
        projects={"reports": {"secret": f"test-reports-{uuid.uuid4().hex}", **(reports or {})},
                  **{name: {"secret": f"test-{name}-{uuid.uuid4().hex}", **more}
                     for name, more in (others or {}).items()}},
    )
    if backends:
        entries = [cfg.backend.model_copy(update={"name": name}) for name in backends]
        cfg = cfg.model_copy(update={"backend": entries[0], "backends": entries})
    made = Runtime(cfg)
    yield made
    made.vllm.close()
    made.redis.close()


@pytest.fixture
def rt(sim: str, key_prefix: str, redis_client: redis.Redis) -> Iterator[Runtime]:
    yield from runtime(sim, key_prefix)


def submit(rt: Runtime, text: str, project: str = "reports", **extra: Any) -> str:
    """What the client and the prep task do: the job ends pending in the store."""
    job_id = uuid.uuid4().hex[:12]
    content = f"Task {job_id}: {text}"  # the simulator counts /K markers per first message
    raw = {"id": job_id, "project": project, "messages": [{"role": "user", "content": content}],
           **extra}
    signed = sign(raw, project, rt.settings.projects[project].secret)
    assert prep_job(rt, project, job_id, signed) == "pending"
    return job_ref(project, job_id)


def admit(rt: Runtime, ref: str, now: float) -> int:
    grant = rt.store.admit_next(now).grant
    assert grant is not None and grant.job_id == ref
    return grant.fence


def envelope(rt: Runtime, ref: str) -> Envelope | None:
    return rt.results.get(ref)


DOCUMENT = " ".join(f"line {n} of the shared document." for n in range(1_200))


def prepare(rt: Runtime, messages: list[dict[str, Any]], **extra: Any) -> tuple[str, int, int]:
    """(job ref, prompt tokens, uncached tokens) of the job's pending item; ``extra``: more job
    fields."""
    job_id = uuid.uuid4().hex[:12]
    raw = {"id": job_id, "project": "reports", "messages": messages, **extra}
    assert prep_job(rt, "reports", job_id, sign(raw, "reports", rt.settings.projects["reports"].secret)) == "pending"
    client: redis.Redis = rt.redis
    ref = job_ref("reports", job_id)
    item = client.hget(Keys(rt.settings.key_prefix).dispatch + "items", ref)
    fields = (item.decode() if isinstance(item, bytes) else str(item)).split(" ")
    return ref, int(fields[3]), int(fields[13])


def run(rt: Runtime, ref: str) -> None:
    """Admit the job and run it: its prompt goes to the backend."""
    assert infer_job(rt, ref, "reports", admit(rt, ref, time.time())) == "OK"


QUERY = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}


BIG_RESULT = "invoice " * 2400  # below MAX_RESULT_CHARS


@pytest.fixture
def tool_rt(sim: str, key_prefix: str, redis_client: redis.Redis) -> Iterator[Runtime]:
    """Project ``reports`` runs ``search_docs`` (trusted); the backend's max_model_len leaves a
    prompt of at most 3600 tokens next to max_tokens 400."""
    yield from runtime(sim, key_prefix, backend={"max_model_len": 4000}, reports={
        "tools": "run", "allowed_tools": ["search_docs"], "thinking_budget": 200,
        "content_reserve": 200, "tool_registry": {"search_docs": {
            "task": "tests.search_docs", "parameters": QUERY, "untrusted": False,
            "timeout_s": 30}}})


class Sent:
    """The inference worker's send_task: records the tool tasks it sends."""

    def __init__(self) -> None:
        self.tasks: list[dict[str, Any]] = []

    def __call__(self, name: str, kwargs: dict[str, Any], **options: Any) -> None:
        self.tasks.append({"name": name, **kwargs, **options})


def submit_asking(rt: Runtime, text: str) -> str:
    return submit(rt, text, tools=[{"type": "function", "function": {"name": "search_docs"}}],
                  tool_choice="auto")
