"""Queue names, routing and how a worker reads a fleet task's message: the names every sender and
worker share, kept apart from the Celery app (fleet/worker/app.py) and the tasks
(fleet/worker/tasks.py), which both import them.

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
  tool queues      one per registered tool of each project that runs its tools
                   (``tool_queues``, fleet/infer/tools.py)

``make_router`` is the only place that knows which task goes to which queue; ``home_queues``
names the queues a prep or cancel task may arrive on (the tasks check it, fleet/worker/tasks.py).

How a task is shown and where it came from
  Every sender passes ``shown(project, job_id, kind)``: Celery puts that short ``kwargsrepr``
  ("project=A job=X") into the sent event instead of the keyword arguments, which carry the
  signed job and its messages, and the task's kind as its ``argsrepr`` (``prep``, ``collect``,
  ``cancel``, ``turn``: Flower's args column). On the worker every fleet task runs as a
  ``ShownRequest``, which puts the same, made by the worker from the task's routing arguments and
  the queue it came from (never the sender's own repr), wherever the worker shows a task:
  received/started events, logs, and its answers to ``celery inspect active / reserved /
  scheduled / query_task`` (Flower's page of one worker). Its closing event says what the task
  came to (fleet/worker/outcome.py: CONTINUED for a turn that handed its job on, the code and its
  meaning for a job that ended with one).
  ``QueuedRequest`` keeps the queue the fleet's transport stamped into the message
  (fleet/worker/transport.py), which ``arrived_on`` reads: a message whose stamp is missing (it
  did not come through the fleet's transport) arrived on no queue at all.
  ``prep_backlog`` counts the prep messages waiting in the broker, which Flower's broker page
  shows and the dispatcher store does not; ``prep_refs_in_broker`` names the jobs they are for
  (queued or delivered and not yet acknowledged), which the prep watchdog reads after the broker
  came back (fleet/prep/recover.py).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from celery.worker.request import Request
from kombu.transport.redis import PRIORITY_STEPS, Channel

from fleet.core.config import Settings
from fleet.core.keys import job_ref
from fleet.worker.outcome import JobEnded, ended_event
from fleet.worker.transport import QUEUE_STAMP

PREP_TASK = "fleet.prep"
INFER_TASK = "fleet.infer"
CANCEL_TASK = "fleet.cancel"
INFER_QUEUE = "fleet.infer"
# Prep tasks that claim a project this fleet does not know land here, so a prep worker still
# rejects them (E_AUTH) instead of leaving them in a queue nobody consumes.
UNROUTED_QUEUE = "fleet.unrouted"


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


def shown(project: str, job_id: str, kind: str) -> dict[str, str]:
    """send_task options that stand in for a task's arguments wherever Celery shows them: what
    the task is (``task_kind``) and for whom. The worker shows the same (``ShownRequest``), made
    from the message; Flower shows whichever of the two events came last."""
    return {"argsrepr": kind, "kwargsrepr": f"project={project} job={job_id}"}


def collects(signed: Any) -> bool:
    """Whether a prep task's signed job has sources to collect (its collect queue)."""
    job = signed.get("job") if isinstance(signed, dict) else None
    return isinstance(job, dict) and bool(job.get("sources"))


def prep_kind(signed: Any) -> str:
    return "collect" if collects(signed) else "prep"


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

    return shown(short(project), short(job_id), "")["kwargsrepr"]


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


def task_kind(name: str, queue: str | None) -> str:
    """What a fleet task is, shown as its arguments (Flower's args column): ``prep``, ``collect``
    (a prep task off a collect queue), ``cancel`` or ``turn`` (one model turn of a job)."""
    if name == PREP_TASK:
        return "collect" if queue is not None and queue.endswith(".collect") else "prep"
    return {CANCEL_TASK: "cancel", INFER_TASK: "turn"}.get(name, "?")


class ShownRequest(QueuedRequest):
    """A fleet task as its worker shows it: its kind (``task_kind``) and ``task_shown`` instead of
    the arguments everywhere (events, logs, ``inspect`` answers), whatever the sender put into
    argsrepr/kwargsrepr; its closing event as fleet/worker/outcome.py says (``task-continued``
    for a turn that handed its job on, the code's line for a job that ended with one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._argsrepr = task_kind(self._type, self._delivery_info.get(QUEUE_STAMP))
        self._kwargsrepr = task_shown(self._kwargs)
        self._request_dict["argsrepr"] = self._argsrepr  # what the task's own log lines use
        self._request_dict["kwargsrepr"] = self._kwargsrepr
        self._ended: str | None = None

    def info(self, safe: bool = False) -> dict[str, Any]:
        return super().info(safe=True)  # inspect active/reserved/...: never the arguments

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = exc_info.exception
        exc = exc.exc if isinstance(exc, ExceptionWithTraceback) else exc
        if isinstance(exc, JobEnded):
            self._ended = str(exc)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def send_event(self, type: str, **fields: Any) -> None:
        kind, fields = ended_event(type, fields, self._ended, self._argsrepr)
        super().send_event(kind, **fields)


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


PAGE = 500  # messages read per LRANGE / HSCAN call: a deep queue is never one huge reply


def _lists(settings: Settings, queues: list[str]) -> list[str]:
    """Every Redis list a message of these queues can wait in (every priority level kombu keeps
    apart), under kombu's key prefix."""
    steps = [""] + [f"{Channel.sep}{step}" for step in PRIORITY_STEPS if step]
    return [f"{settings.key_prefix}q:{queue}{step}" for queue in queues for step in steps]


def _prep_lists(settings: Settings) -> list[str]:
    """Every list a prep message of a configured project can wait in (both queues of each)."""
    return _lists(settings, [queue for project in settings.projects
                             for queue in (project_queue(project), collect_queue(project))])


def _stored_messages(client: Any, settings: Settings, lists: list[str]) -> list[bytes]:
    """The raw messages waiting in ``lists`` and every entry of kombu's unacked hash (a worker's
    reserved and running messages, [message, exchange, routing key]). Reads every message once:
    meant for the rare look after a broker restart, not for every pass."""
    found: list[bytes] = []
    for key in lists:
        start = 0
        while page := client.lrange(key, start, start + PAGE - 1):
            found += page
            start += PAGE
    found += [entry for _tag, entry in client.hscan_iter(f"{settings.key_prefix}q:unacked", count=PAGE)]
    return found


def prep_refs_in_broker(settings: Settings, client: Any) -> set[str]:
    """The refs of every job with a prep message in the broker: waiting in a queue or delivered
    and not yet acknowledged. A message that is not a readable prep task is passed over."""
    return {job_ref(str(kwargs["project"]), str(kwargs["job_id"]))
            for kwargs in stored_task_kwargs(_stored_messages(client, settings, _prep_lists(settings)), PREP_TASK)}


def infer_grants_in_broker(settings: Settings, client: Any) -> set[tuple[str, int]]:
    """(job ref, fence) of every ``fleet.infer`` message in the broker: waiting in the inference
    queue or delivered and not yet acknowledged (fleet/worker/lostgrants.py)."""
    found = set()
    for kwargs in stored_task_kwargs(_stored_messages(client, settings, _lists(settings, [INFER_QUEUE])), INFER_TASK):
        try:
            found.add((str(kwargs["ref"]), int(kwargs["fence"])))
        except (KeyError, TypeError, ValueError):
            continue
    return found


def stored_task_kwargs(raws: list[bytes], task: str) -> list[dict[str, Any]]:
    """The keyword arguments of each stored kombu message that is a ``task`` (an unacked entry is
    [message, exchange, routing key]); another task, or bytes that do not parse, are passed over."""
    found = []
    for raw in raws:
        try:
            message = json.loads(raw)
            if isinstance(message, list):
                message = message[0]
            if message["headers"]["task"] != task:
                continue
            body = message["body"]
            if message.get("properties", {}).get("body_encoding") == "base64":
                body = base64.b64decode(body)
            kwargs = json.loads(body)[1]
            if isinstance(kwargs, dict) and all(name in kwargs for name in _NEEDED[task]):
                found.append(kwargs)
        except (ValueError, TypeError, KeyError, IndexError):
            continue
    return found


_NEEDED = {PREP_TASK: ("project", "job_id"), INFER_TASK: ("ref", "fence")}


def make_router(settings: Settings):  # type: ignore[no-untyped-def]
    """Celery router: the only place that knows which task goes to which queue."""
    known = set(settings.projects)

    def route_task(name: str, args: Any, kwargs: dict[str, Any], options: Any, task: Any = None,
                   **_: Any) -> dict[str, str] | None:
        if name == PREP_TASK:
            project = kwargs.get("project")
            if project not in known:
                return {"queue": UNROUTED_QUEUE}
            return {"queue": collect_queue(project) if collects(kwargs.get("signed")) else project_queue(project)}
        if name == CANCEL_TASK:
            project = kwargs.get("project")
            return {"queue": project_queue(project) if project in known else UNROUTED_QUEUE}
        if name == INFER_TASK:
            return {"queue": INFER_QUEUE}
        return None

    return route_task
