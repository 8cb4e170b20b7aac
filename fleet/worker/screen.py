"""What a worker accepts off its queues: the fleet's own tasks in the shape the fleet sends them,
nothing of Celery's own machinery (docs/security.md, "What a producer's message may contain").

A project's producer may push raw messages onto its own queues, and Celery acts on much of what a
message carries before and after the task runs: it runs any task it has registered (its
built-ins included: ``celery.accumulate``, ``celery.group``, ``celery.chord_unlock``, ``celery.map``
...), sends the message's callbacks, errbacks, chain and chord when the task ends (to whatever
queue each names, with the worker's broker rights), retries ``celery.chord_unlock`` forever, holds
a message with an ``eta`` in memory until it is due, and answers to ``reply_to``. Before this
screen a single message for a built-in task nesting 20 x 50 callbacks that named another
project's queue put 1,000 messages there, and a ``celery.chord_unlock`` retried itself every 2 s
for good.

``ScreeningConsumer`` (a worker's ``worker_consumer``, fleet/worker/app.py) looks at every task
message before Celery does anything with it (``MessageScreen.admits``) and refuses it, unless:

- its task is one the worker registered for the fleet (``fleet.prep``, ``fleet.cancel``,
  ``fleet.infer``, and ``fleet.tool`` on a tool worker): not Celery's built-ins (which
  ``drop_builtins`` also unregisters), not a project's tool function (a tool runs only inside
  ``fleet.tool``), not a protocol-1 message;
- its headers are only those Celery's own ``send_task`` writes (``ALLOWED_HEADERS``), with
  ``shadow``, ``eta``, ``group``, ``group_index``, ``replaced_task_nesting``, ``stamped_headers``
  and ``stamps`` empty (a header Celery does not know still lands in the task's request, where
  ``callbacks`` or ``chord`` would act);
- its body is a JSON ``[args, kwargs, embed]`` whose embed has no callbacks, errbacks, chain or
  chord.

Its ``reply_to`` is cleared on the way in (Celery's ``send_task`` writes one; nothing of the fleet
answers to it). A refused message is acknowledged (never given back, never retried, nothing of it
runs), counted in ``fleet_worker_refused_messages_total{queue,reason}``, written to the operator's
rejections stream (``fleet rejections``: code ``E_MESSAGE_REFUSED``, the queue it came from, the
reason) and logged as one WARNING per queue and reason a minute (with the count since), so a flood
costs a line a minute, not a line a message. Nothing is written into any project's job, results
or events: the message's claims are its sender's.

Failure cases: a message whose acknowledgement fails (the broker went away) stays in the broker's
unacked set, is given back later and refused again; a rejection stream the broker refuses is a
WARNING (the count and the log line stand).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import redis
from celery.worker.consumer import Consumer
from vine import promise

from fleet.core.codes import Code
from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.worker.queues import SHOWN_CHARS, collect_queue, project_queue
from fleet.worker.transport import QUEUE_STAMP

log = logging.getLogger(__name__)

# What Celery's send_task writes into a protocol-2 message's headers, and kombu's mark of a
# message it gave back; nothing else is accepted.
ALLOWED_HEADERS = frozenset({
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
    "replaced_task_nesting", "stamped_headers", "stamps", "redelivered"})
# Headers the fleet never sets: each makes Celery do something for the sender (rename the task
# in logs, hold the message until a time, take part in a group or canvas).
EMPTY_HEADERS = ("shadow", "eta", "group", "group_index", "replaced_task_nesting",
                 "stamped_headers", "stamps")
CANVAS = ("callbacks", "errbacks", "chain", "chord")
EMBED_KEYS = frozenset(CANVAS)
LOG_EVERY_S = 60.0


def refusal(headers: Any, payload: Callable[[], Any], tasks: Collection[str]) -> str | None:
    """Why a message is refused (a short fixed reason), None when it is admitted; ``payload``
    decodes its body (raising for a body that is not the accepted JSON)."""
    if not isinstance(headers, dict) or not isinstance(headers.get("id"), str):
        return "not a protocol-2 task message"
    if headers.get("task") not in tasks:
        return "not a fleet task"
    if not set(headers) <= ALLOWED_HEADERS:
        return "unknown header"
    if any(headers.get(name) for name in EMPTY_HEADERS):
        return "canvas or eta header"
    try:
        body = payload()
    except Exception:  # any decoding failure: Celery would not run it either
        return "undecodable body"
    if not (isinstance(body, (list, tuple)) and len(body) == 3 and isinstance(body[0], list)
            and isinstance(body[1], dict) and isinstance(body[2], dict)):
        return "not an [args, kwargs, embed] body"
    embed = body[2]
    if not set(embed) <= EMBED_KEYS or any(embed.get(name) for name in CANVAS):
        return "callbacks, errbacks, chain or chord"
    return None


class MessageScreen:
    """A worker's screen: the fleet's task names it admits and where refusals are told."""

    def __init__(self, settings: Settings, client: redis.Redis, tasks: Collection[str],
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self.settings = settings
        self.client = client
        self.tasks = frozenset(tasks)
        self.on_refused = on_refused  # (queue, reason): the worker's metrics
        self._lock = threading.Lock()
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # last line, refused since

    def admits(self, message: Any) -> bool:
        """True: Celery may go on with ``message`` (its reply_to cleared). False: it was refused,
        acknowledged and told (module docstring)."""
        reason = refusal(message.headers, message.decode, self.tasks)
        if reason is None:
            if isinstance(message.properties, dict):
                message.properties["reply_to"] = ""
            return True
        queue = str((message.delivery_info or {}).get(QUEUE_STAMP) or "?")
        try:
            message.ack()
        except Exception as exc:  # the broker: it comes back later and is refused again
            log.warning("a refused message from queue %s could not be acknowledged (%s)", queue,
                        type(exc).__name__)
        self._tell(message.headers, queue, reason)
        return False

    def _tell(self, headers: Any, queue: str, reason: str) -> None:
        values = headers if isinstance(headers, dict) else {}
        task, task_id = (str(values.get(k, "?"))[:SHOWN_CHARS] for k in ("task", "id"))
        if self.on_refused is not None:
            self.on_refused(queue, reason)
        text = f"{Code.E_MESSAGE_REFUSED.value} {reason}: task {task} from queue {queue}"
        try:
            self.client.xadd(Keys(self.settings.key_prefix).rejections,
                             {"job_id": task_id, "project": self._project_of(queue),
                              "queue": queue, "code": Code.E_MESSAGE_REFUSED.value,
                              "reason": text, "ts": f"{time.time():.3f}"},
                             maxlen=self.settings.results_stream_maxlen, approximate=True)
        except redis.RedisError as exc:
            log.warning("a refusal could not be written to the rejections stream (%s)",
                        type(exc).__name__)
        self._log(queue, reason, text)

    def _project_of(self, queue: str) -> str:
        """The project whose producer could have put a message on ``queue`` ("" for the fleet's
        own queues: only its processes write there)."""
        for project in self.settings.projects:
            if queue in (project_queue(project), collect_queue(project)):
                return project
        return ""

    def _log(self, queue: str, reason: str, text: str) -> None:
        now = time.monotonic()
        with self._lock:
            last, since = self._logged.get((queue, reason), (float("-inf"), 0))
            if now - last < LOG_EVERY_S:
                self._logged[(queue, reason)] = (last, since + 1)
                return
            self._logged[(queue, reason)] = (now, 0)
        more = f" (and {since} more like it in the last minute)" if since else ""
        log.warning("refused a message before running anything: %s%s", text, more)


class ScreeningConsumer(Consumer):  # type: ignore[misc]
    """Celery's worker consumer with every task message screened first (module docstring); the
    app must carry its ``fleet_screen`` (fleet/worker/tasks.py ``register_tasks``)."""

    def create_task_handler(self, promise: Any = promise) -> Callable[[Any], Any]:
        handle = super().create_task_handler(promise)
        screen: MessageScreen = self.app.fleet_screen

        def on_task_received(message: Any) -> Any:
            if screen.admits(message):
                return handle(message)
            return None

        return on_task_received


CONSUMER = f"{__name__}:ScreeningConsumer"


def drop_builtins(app: Any) -> list[str]:
    """Unregister Celery's built-in tasks (``celery.*``, added by ``celery.app.builtins`` when the
    app is finalized) from a worker's app: the fleet uses none of them. Returns their names."""
    app.finalize(auto=True)
    names = sorted(name for name in app.tasks if name.startswith("celery."))
    for name in names:
        app.tasks.unregister(name)
    return names
