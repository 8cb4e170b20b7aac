"""The Celery application: the broker, its queues and the reliability settings, all in this one
place; the worker's app (the fleet's tasks registered) and Flower's command line.

Queue names and routing are in fleet/worker/queues.py, the tasks in fleet/worker/tasks.py.
``create_app`` is what producers, the gateway and the dispatcher send with: it loads no task
module. ``worker_app`` is a worker's: ``create_app`` with the tasks registered, Celery's built-in tasks
unregistered and every message screened before Celery acts on it (fleet/worker/screen.py).

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
  names are ``fleet.prep`` / ``fleet.infer`` / ``fleet.cancel`` / ``fleet.tool``. What a task shows
  instead of its arguments (``shown``, ``ShownRequest``) is in fleet/worker/queues.py.
  ``flower_argv`` keeps Flower on loopback unless it asks for a password.
  A task whose job ended with a non-OK final envelope raises ``JobEnded`` (fleet/worker/outcome.py),
  so Flower and the task-failed event show FAILURE and the code; a turn that handed its job on
  shows as CONTINUED; ``flower_argv`` sets the Tasks page's columns (``FLOWER_TASK_COLUMNS``).
  Flower's broker page counts Celery queues only: a prepared job waits for admission in the
  dispatcher store, no Celery queue (see ``prep_backlog``, ``fleet queues`` and
  ``fleet_dispatch_pending``). Gateway requests are no Celery tasks: Flower never sees them.

Failure cases: a ``flower_argv`` that would expose Flower without a password, or a malformed
``basic_auth``, raises ConfigError.
"""

from __future__ import annotations

import importlib
import ipaddress
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from fleet.core.config import Settings, load_settings
from fleet.core.errors import ConfigError
from fleet.core.redisconn import celery_transport_options
from fleet.worker.queues import INFER_QUEUE, collect_queues, make_router, prep_queues, tool_queues
from fleet.worker.transport import SENTINEL_TRANSPORT, TRANSPORT

# Flower's Tasks page, in this order: the task, what it is (prep, collect, cancel, turn: its
# args), for whom (project, job: its kwargs), its state (CONTINUED for a turn that handed its job
# on), its result (code, turn, attempts, tokens, backend; a failed job's code and meaning), then
# when, how long, where (fleet/worker/outcome.py)
FLOWER_TASK_COLUMNS = "name,args,kwargs,state,result,received,runtime,worker,uuid"


def flower_argv(*, port: int, address: str, basic_auth: str | None) -> list[str]:
    """Flower's command line: the fleet's task columns; a non-loopback ``address`` needs
    ``basic_auth`` ("user:password", several comma separated), which goes to Flower's own
    basic_auth option."""
    argv = ["flower", f"--port={port}", f"--address={address}", f"--tasks_columns={FLOWER_TASK_COLUMNS}"]
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
            # kombu 5.7 scans for messages past their visibility timeout on only every 10th
            # empty poll (every 10th 10 s sweep in the event loop): a dead worker's message came
            # back after minutes. One scan per chance, as before: one SET NX and one ZRANGE.
            "unacked_restore_throttle": 1,
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
    # Imported here, not at the top: the tasks load the worker's own modules (its metrics, the
    # inference and prep code), which a producer sending with ``create_app`` must not load.
    from fleet.worker.screen import CONSUMER, drop_builtins
    from fleet.worker.tasks import register_tasks

    app = create_app(settings or load_settings())
    register_tasks(app, tools=tools)
    if tools:
        for module in app.fleet_settings.tool_imports:  # type: ignore[attr-defined]
            importlib.import_module(module)  # registers the projects' tool tasks (shared_task)
    # Celery's built-in tasks (celery.chord_unlock, celery.group, ...) run nothing the fleet
    # needs and would run for anyone who names them; the screening consumer refuses every
    # message that is not a fleet task anyway (fleet/worker/screen.py)
    drop_builtins(app)
    app.conf.worker_consumer = CONSUMER
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
