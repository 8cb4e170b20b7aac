"""The fleet's four Celery tasks: their registration, the check that a message was taken off a queue
it belongs on, and what a task returns. What each does to its job is in fleet/worker/jobs/, one
module per task; queue names and routing in fleet/worker/queues.py.

Jobs are named by their ref, ``<project>/<id>`` (fleet/core/keys.py).

fleet.prep    (queue fleet.<project> or its collect queue, kwargs project, job_id, signed)
              verify, prepare, hand over to the dispatcher store (fleet/worker/jobs/prep.py)
fleet.cancel  (queue fleet.<project>, kwargs project, job_id; sent by fleet.Client.cancel)
              end a job not running yet on its project's signed request (jobs/cancel.py)
fleet.infer   (queue fleet.infer, kwargs ref, project, fence; sent by a dispatcher)
              ONE model turn under the job's lease, then a final envelope or the next turn
              saved and the job back in line (jobs/infer.py)
fleet.tool    (queue of the tool, kwargs ref, round_number, call_id; sent by an inference worker)
              one call of a job's tool round (jobs/tool.py); registered only on a worker that
              runs tools

Before any of this, a worker screens every message (fleet/worker/screen.py): a task that is not
one of these (Celery's built-ins included), or a message carrying callbacks, errbacks, a chain,
chord, group, eta or headers Celery's send_task does not write, is refused before anything runs.

Each task runs only for a message taken from a queue it belongs on, as the fleet's transport
stamped it on delivery (fleet/worker/transport.py; ``QueueCheckedTask``, the tasks' base class):
fleet.infer from fleet.infer, fleet.prep and fleet.cancel from the queues of the project they name
(its queue or its collect queue; the unrouted queue for a project the fleet does not know),
fleet.tool from a tool queue. Celery runs any task it has registered whatever queue the message
came from, and a producer may push raw messages onto its own project queue (routing key and
delivery_info included, which is why they are never trusted): without this, a fleet.infer
message naming another project's job and a guessed fence ran that job's turn, and a fleet.prep
message naming another project wrote a ``rejected`` event into that project's job. A message off
its queue runs nothing, is acknowledged (never redelivered) and logs one WARNING.

A task whose job ended with a non-OK final envelope raises ``JobEnded`` (the code, the job and
the code's meaning as its text: fleet/worker/outcome.py), so Flower and the task-failed event show
FAILURE and the code; it is listed in the tasks' ``throws`` (an expected outcome: no traceback in
the log) and, like any task that raised, its message is acknowledged - never redelivered, never
retried. What each task returns, and how a turn that handed its job on shows (CONTINUED in
Flower), is in fleet/worker/outcome.py.

Failure cases: every exception inside a task becomes an Envelope (E_INTERNAL at worst), so a bad
job never crashes a worker, poisons a queue or stays without a final result.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from celery import Celery, Task

from fleet.core.keys import job_ref, split_ref
from fleet.core.models import Envelope
from fleet.worker.heartbeat import beat_when_ready
from fleet.worker.jobs.cancel import cancel_job
from fleet.worker.jobs.common import new_owner
from fleet.worker.jobs.infer import run_turn
from fleet.worker.jobs.prep import prep_job, riding_out_broker_loss
from fleet.worker.jobs.tool import tool_job
from fleet.worker.metrics import WorkerMetrics, serve_when_started
from fleet.worker.outcome import JobEnded, task_outcome
from fleet.worker.queues import (
    CANCEL_TASK,
    INFER_QUEUE,
    INFER_TASK,
    PREP_TASK,
    QueuedRequest,
    ShownRequest,
    arrived_on,
    home_queues,
    tool_queues,
)
from fleet.worker.repeats import on_final
from fleet.worker.runtime import Runtime
from fleet.worker.screen import MessageScreen

log = logging.getLogger(__name__)


TOOL_TASK = "fleet.tool"
WRONG_QUEUE = "wrong-queue"  # the outcome of a task refused by ``QueueCheckedTask``


class QueueCheckedTask(Task):
    """A fleet task: it runs only for a message taken from one of ``belongs_on``'s queues, as the
    transport stamped it; otherwise it runs nothing, returns ``WRONG_QUEUE`` (its message is
    acknowledged) and logs one WARNING. A producer may push raw messages onto its own project
    queue, and Celery runs any registered task whatever queue it came from; the queue the
    message names itself is the sender's word (module docstring)."""

    def belongs_on(self, kwargs: dict[str, Any]) -> Collection[str]:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Celery's tracer calls a task that has its own __call__ instead of its ``run``, after it
        # pushed the request (with the stamped delivery_info): nothing else to do but run it.
        queue = arrived_on(self.request)
        if queue in self.belongs_on(kwargs):
            return self.run(*args, **kwargs)
        ref = kwargs.get("ref") or job_ref(str(kwargs.get("project")), str(kwargs.get("job_id")))
        log.warning("%s task for job=%.80s taken from queue %.80s, where it never belongs: not run",
                    self.name, ref, queue)
        return WRONG_QUEUE


class OnProjectQueues(QueueCheckedTask):
    """fleet.prep, fleet.cancel: the queues of the project the task names."""

    def belongs_on(self, kwargs: dict[str, Any]) -> Collection[str]:
        return home_queues(self.app.fleet_settings, kwargs.get("project"))


class OnInferQueue(QueueCheckedTask):
    """fleet.infer: fleet.infer only."""

    def belongs_on(self, kwargs: dict[str, Any]) -> Collection[str]:
        return {INFER_QUEUE}


class OnToolQueues(QueueCheckedTask):
    """fleet.tool: the tool queues of the projects that run their tools."""

    def belongs_on(self, kwargs: dict[str, Any]) -> Collection[str]:
        return set(tool_queues(self.app.fleet_settings))


def register_tasks(app: Celery, tools: bool = True) -> None:
    """Register the fleet's tasks on ``app``; ``fleet.tool`` only when this worker runs tools: a
    prep worker that knew it would run it for a message a producer pushed onto its own project
    queue (the call still had to be its own job's, but it ended as "task not registered")."""
    metrics = WorkerMetrics()
    runtime = Runtime(app.fleet_settings, send_task=app.send_task,  # type: ignore[attr-defined]
                      on_turn=metrics.observe_turn)

    def published(envelope: Envelope) -> None:
        """After each final envelope this worker wrote: its metrics, then the exact-repeat cache
        (a job that computed an answer serves the jobs waiting for it: fleet/worker/repeats.py)."""
        metrics.observe(envelope)
        on_final(runtime, envelope)

    runtime.on_publish = published  # before anything publishes: the result store takes it when built
    serve_when_started(app, metrics, runtime.settings.worker_metrics_port, runtime.settings.metrics_host)
    beat_when_ready(app, runtime.redis, runtime.keys, INFER_QUEUE)

    # A non-OK final code raises JobEnded: FAILURE in Flower, no redelivery.
    @app.task(name=PREP_TASK, base=OnProjectQueues, bind=True, acks_late=True, throws=(JobEnded,),
              Request=ShownRequest)
    def prep(task: Task, *, project: str, job_id: str, signed: dict[str, Any]) -> str:
        owner = new_owner()  # one owner across retries: the claim of an attempt cut short is ours
        outcome = riding_out_broker_loss(
            lambda: prep_job(runtime, project, job_id, signed, owner), job_ref(project, job_id),
            runtime.settings.prep_lease_s)
        return task_outcome(outcome, job_id)

    @app.task(name=CANCEL_TASK, base=OnProjectQueues, bind=True, acks_late=True, Request=ShownRequest)
    def cancel(task: Task, *, project: str, job_id: str) -> str:
        return f"{cancel_job(runtime, project, job_id)} job={job_id}"

    @app.task(name=INFER_TASK, base=OnInferQueue, bind=True, acks_late=True, throws=(JobEnded,),
              Request=ShownRequest)
    def infer(task: Task, *, ref: str, project: str, fence: int, backend: str = "") -> str:
        turn = run_turn(runtime, ref, project, fence, backend)
        return task_outcome(turn.outcome, split_ref(ref)[1], turn.detail)

    names = [PREP_TASK, CANCEL_TASK, INFER_TASK] + ([TOOL_TASK] if tools else [])
    # every message is screened before Celery acts on it: only these names, no canvas
    app.fleet_screen = MessageScreen(runtime.settings, runtime.redis, names,  # type: ignore[attr-defined]
                                     on_refused=metrics.observe_refused)
    if not tools:
        return

    @app.task(name=TOOL_TASK, base=OnToolQueues, bind=True, acks_late=True, Request=QueuedRequest)
    def tool(task: Task, *, ref: str, round_number: int, call_id: str) -> str:
        return f"{tool_job(runtime, app.tasks, ref, round_number, call_id)} job={split_ref(ref)[1]}"
