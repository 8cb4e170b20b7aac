"""The Celery application: queues, routing and reliability settings, all in this one place.

Queues
  fleet.<project>  one per project: producers' jobs land here; prep workers verify, count,
                   trim and plan, then hand the job to the dispatcher store (never to vLLM)
  fleet.<project>.collect
                   the same for jobs that carry sources to collect: slow, I/O- and CPU-heavy
                   work on its own queues (``fleet worker --role collect``), so a backlog of
                   collection never delays the preparation of ready jobs
                   and ``fleet.cancel`` tasks: a project's signed request to cancel one of its jobs
  fleet.unrouted   prep tasks claiming a project this fleet does not know (rejected E_AUTH)
  fleet.infer      inference tasks, sent only by a dispatcher after it admitted the job and
                   issued a lease; consumed by inference workers (threads pool, one thread per
                   streaming request)

Reliability
  acks_late + reject_on_worker_lost: a message is acknowledged only after its task returned, so a
  dead worker's task is delivered again. The Redis transport's visibility timeout
  (``visibility_timeout_s``, default 12 h) is longer than the longest reasoning attempt, so a task
  still running is never handed to a second worker by the broker. A re-delivered inference task
  carries its old fencing token and is dropped; the job itself was already re-admitted when its
  lease expired (see schedulers/store/base.py).
  prefetch 1: a worker reserves no more than it runs.
  Broker loss: workers retry the broker connection forever and keep running tasks while it is
  gone (``worker_cancel_long_running_tasks_on_connection_loss`` off: an inference stream needs
  vLLM, not the broker); fleet/worker/transport.py removes the kombu failure that made a worker
  exit when Redis restarted.
  Broker keys (queues, unacked sets) live under ``<key_prefix>q:`` (kombu's global_keyprefix), so
  several fleets or test runs can share one Redis.

Monitoring
  Flower sees tasks because workers send task events and producers send "sent" events; the task
  names are ``fleet.prep`` / ``fleet.infer``. Every sender passes ``shown(project, job_id)``: Celery
  puts that short ``kwargsrepr`` ("project=A job=X") into the sent event instead of the keyword
  arguments, which carry the signed job and its messages. On the worker every fleet task runs as
  a ``ShownRequest``, which puts the same line, made by the worker from the task's routing
  arguments (never the sender's own repr), wherever the worker shows a task: received/started
  events, logs, and its answers to ``celery inspect active / reserved / scheduled /
  query_task`` (Flower's page of one worker). ``flower_argv`` keeps Flower on loopback unless it
  asks for a password.
  A task whose job ended with a non-OK final envelope raises ``JobEnded`` (the code as its text),
  so Flower and the task-failed event show FAILURE and the code; it is listed in the tasks'
  ``throws`` (an expected outcome: no traceback in the log) and, like any task that raised, its
  message is acknowledged - never redelivered, never retried. Flower's broker page counts Celery
  queues only: a prepared job waits for admission in the dispatcher store, no Celery queue (see
  ``prep_backlog``, ``fleet queues`` and ``fleet_dispatch_pending``).
"""

from __future__ import annotations

import importlib
import ipaddress
from typing import Any

from celery import Celery
from celery.worker.request import Request
from kombu import Exchange, Queue
from kombu.transport.redis import PRIORITY_STEPS, Channel

from fleet.core.codes import Code
from fleet.core.config import Settings, load_settings
from fleet.core.errors import ConfigError
from fleet.core.redisconn import celery_transport_options
from fleet.worker.transport import QUEUE_STAMP, SENTINEL_TRANSPORT, TRANSPORT

PREP_TASK = "fleet.prep"
INFER_TASK = "fleet.infer"
CANCEL_TASK = "fleet.cancel"
INFER_QUEUE = "fleet.infer"
# Prep tasks that claim a project this fleet does not know land here, so a prep worker still
# rejects them (E_AUTH) instead of leaving them in a queue nobody consumes.
UNROUTED_QUEUE = "fleet.unrouted"


class JobEnded(Exception):
    """A task's job ended with a non-OK final envelope; the text starts with the code."""


def task_outcome(outcome: str, job_id: str) -> str:
    """A task's return value, ``"<outcome> job=<id>"`` (Celery's "succeeded" log line and Flower's
    result column then name the job); raises ``JobEnded`` when ``outcome`` is a non-OK code."""
    if outcome in Code._value2member_map_ and not Code(outcome).ok:
        raise JobEnded(f"{outcome} job={job_id}")
    return f"{outcome} job={job_id}"


def project_queue(project: str) -> str:
    return f"fleet.{project}"


def collect_queue(project: str) -> str:
    return f"fleet.{project}.collect"


def home_queues(settings: Settings, project: Any) -> frozenset[str]:
    """The queues a prep or cancel task naming ``project`` may arrive on: the project's queue and
    its collect queue; for a project this fleet does not know, the unrouted queue only."""
    if isinstance(project, str) and project in settings.projects:
        return frozenset({project_queue(project), collect_queue(project)})
    return frozenset({UNROUTED_QUEUE})


def prep_queues(settings: Settings) -> list[str]:
    return [project_queue(p) for p in settings.projects] + [UNROUTED_QUEUE]


def collect_queues(settings: Settings) -> list[str]:
    return [collect_queue(p) for p in settings.projects]


def tool_queues(settings: Settings) -> list[str]:
    """Every queue a tool worker consumes: each registered tool's, of each project that runs
    its tools (fleet/infer/tools.py)."""
    return sorted({tool.queue_for(name) for name, p in settings.projects.items()
                   if p.tools == "run" for tool in p.tool_registry.values()})


def shown(project: str, job_id: str) -> dict[str, str]:
    """send_task options that stand in for a task's arguments wherever Celery shows them."""
    return {"argsrepr": "()", "kwargsrepr": f"project={project} job={job_id}"}


SHOWN_CHARS = 80  # of a project or job id as shown: a hostile sender's value is cut there


def task_shown(kwargs: Any) -> str:
    """``project=A job=X`` for a fleet task's keyword arguments (prep/cancel: project, job_id;
    infer: ref), whatever else they carry; made by the worker, so the sender cannot choose it."""
    values = kwargs if isinstance(kwargs, dict) else {}
    project, job_id = values.get("project"), values.get("job_id")
    ref = values.get("ref")
    if isinstance(ref, str) and "/" in ref:
        project, job_id = ref.split("/", 1)

    def short(value: Any) -> str:
        return value[:SHOWN_CHARS] if isinstance(value, str) else "?"

    return shown(short(project), short(job_id))["kwargsrepr"]


class QueuedRequest(Request):
    """A Request that keeps the queue the transport stamped into the message
    (fleet/worker/transport.py): Celery copies only a few named keys of a message's delivery_info
    into ``task.request.delivery_info``, and would drop it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the same dict as _request_dict["delivery_info"], which reaches a pool process
        self._delivery_info[QUEUE_STAMP] = (self._message.delivery_info or {}).get(QUEUE_STAMP)


def arrived_on(request: Any) -> str | None:
    """The queue a running task's message was taken from, as the transport stamped it (None: a
    message that did not come through the fleet's transport)."""
    queue = (getattr(request, "delivery_info", None) or {}).get(QUEUE_STAMP)
    return queue if isinstance(queue, str) else None


class ShownRequest(QueuedRequest):
    """A fleet task as its worker shows it: ``task_shown`` instead of the arguments everywhere
    (events, logs, ``inspect`` answers), whatever the sender put into argsrepr/kwargsrepr."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._argsrepr = "()"
        self._kwargsrepr = task_shown(self._kwargs)
        self._request_dict["argsrepr"] = self._argsrepr  # what the task's own log lines use
        self._request_dict["kwargsrepr"] = self._kwargsrepr

    def info(self, safe: bool = False) -> dict[str, Any]:
        return super().info(safe=True)  # inspect active/reserved/...: never the arguments


def flower_argv(*, port: int, address: str, basic_auth: str | None) -> list[str]:
    """Flower's command line: a non-loopback ``address`` needs ``basic_auth`` ("user:password",
    several comma separated), which goes to Flower's own basic_auth option."""
    argv = ["flower", f"--port={port}", f"--address={address}"]
    if basic_auth is not None:
        if not all(user and password for user, _, password in
                   (entry.partition(":") for entry in basic_auth.split(","))):
            raise ConfigError("flower --basic-auth takes user:password (several comma separated)")
        argv.append(f"--basic-auth={basic_auth}")
    elif not _loopback(address):
        raise ConfigError(f"flower --address {address} is reachable from other hosts: give --basic-auth "
                          "user:password (or FLOWER_BASIC_AUTH), or keep the default 127.0.0.1")
    return argv


def _loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def prep_backlog(settings: Settings, client: Any) -> dict[str, int]:
    """Prep messages waiting in the broker per project (its queue and its collect queue, every
    priority level kombu keeps apart): work Flower's broker page shows and the dispatcher store
    does not, since a job reaches the store only once prepared."""
    prefix = f"{settings.key_prefix}q:"
    steps = [""] + [f"{Channel.sep}{step}" for step in PRIORITY_STEPS if step]
    pipe = client.pipeline(transaction=False)
    for project in settings.projects:
        for queue in (project_queue(project), collect_queue(project)):
            for step in steps:
                pipe.llen(f"{prefix}{queue}{step}")
    counts = iter(pipe.execute())
    per_queue = 2 * len(steps)
    return {project: sum(next(counts) for _ in range(per_queue)) for project in settings.projects}


def make_router(settings: Settings):  # type: ignore[no-untyped-def]
    """Celery router: the only place that knows which task goes to which queue."""
    known = set(settings.projects)

    def route_task(name: str, args: Any, kwargs: dict[str, Any], options: Any, task: Any = None,
                   **_: Any) -> dict[str, str] | None:
        if name == PREP_TASK:
            project = kwargs.get("project")
            if project not in known:
                return {"queue": UNROUTED_QUEUE}
            signed = kwargs.get("signed")
            job = signed.get("job") if isinstance(signed, dict) else None
            collects = isinstance(job, dict) and bool(job.get("sources"))
            return {"queue": collect_queue(project) if collects else project_queue(project)}
        if name == CANCEL_TASK:
            project = kwargs.get("project")
            return {"queue": project_queue(project) if project in known else UNROUTED_QUEUE}
        if name == INFER_TASK:
            return {"queue": INFER_QUEUE}
        return None

    return route_task


def _queue(name: str) -> Queue:
    """A queue with an exchange of its own: kombu keeps a binding set per exchange
    (``_kombu.binding.<exchange>``), so each queue's declaration touches only keys named after it
    and a project's producer needs no write access to a set other projects share (fleet/cli/acl.py)."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def broker_transport(url: str) -> str | None:
    """The kombu transport for a broker URL: the fleet's Redis transports for ``redis://``,
    ``rediss://`` and ``sentinel://`` (fleet/worker/transport.py), kombu's own choice otherwise."""
    scheme = url.strip().split("://", 1)[0].lower()
    if scheme == "sentinel":
        return SENTINEL_TRANSPORT
    return TRANSPORT if scheme in ("redis", "rediss") else None


def create_app(settings: Settings) -> Celery:
    app = Celery("fleet", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            "global_keyprefix": f"{settings.key_prefix}q:",
            **celery_transport_options(settings),
        },
        broker_transport=broker_transport(settings.broker_url),
        # a worker never gives up on its broker (docs/operations.md: broker loss)
        broker_connection_retry=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_channel_error_retry=True,
        task_routes=(make_router(settings),),
        task_queues=[_queue(q) for q in [INFER_QUEUE, *prep_queues(settings),
                                          *collect_queues(settings), *tool_queues(settings)]],
        task_default_queue=INFER_QUEUE,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    app.fleet_settings = settings  # type: ignore[attr-defined]
    return app


def worker_app(settings: Settings | None = None, tools: bool = True) -> Celery:
    """The app a worker runs: the Celery app with the fleet's tasks registered, and the projects'
    tool tasks (``tool_imports``) when ``tools``. A worker that consumes project queues must not
    import them unless it runs tools too (``fleet worker --role all``): Celery runs any task it
    knows whatever queue the message came on, and a producer may push onto its own queue, so a
    prep worker that knew a tool's task would run it for anyone who names it."""
    from fleet.worker.tasks import register_tasks  # tasks import the heavy modules

    app = create_app(settings or load_settings())
    register_tasks(app, tools=tools)
    if tools:
        for module in app.fleet_settings.tool_imports:  # type: ignore[attr-defined]
            importlib.import_module(module)  # registers the projects' tool tasks (shared_task)
    return app


_APPS: dict[str, Celery] = {}


def __getattr__(name: str) -> Any:
    # `celery -A fleet.worker.app ...` (Flower, inspect) looks up `app` here; built on demand so
    # that importing this module never reads the configuration as a side effect.
    if name in ("app", "celery"):
        if "app" not in _APPS:
            _APPS["app"] = worker_app()
        return _APPS["app"]
    raise AttributeError(name)
