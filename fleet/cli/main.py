"""The ``fleet`` command. Each command is a thin shell over a module that does the work; the
commands of the simulator, dispatcher, collection and benchmarks live beside their code and are
registered here, so this file is the whole CLI surface at a glance."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from fleet.core.codes import Code
from fleet.core.config import Settings, load_settings
from fleet.core.errors import (
    BrokerUnavailable,
    BrokerUnsafe,
    ConfigError,
    DependencyMissing,
    FleetError,
    InputInvalid,
    NotFound,
    PublicSecrets,
)
from fleet.core.redisconn import mask_url, redis_client

if TYPE_CHECKING:
    from fleet.client import Client

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="A worker fleet in front of a self-hosted vLLM reasoning model.")
console = Console()
err = Console(stderr=True)


def settings_or_exit() -> Settings:
    try:
        return load_settings()
    except ConfigError as exc:
        err.print(f"[red]config error:[/red] {exc.message}")
        raise typer.Exit(2) from exc


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: two lines a second per backend scrape, none of them news.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def preflight_or_exit(*roles: str) -> None:
    """Stop before taking work when a module a role needs cannot be imported (see preflight.py)."""
    from fleet.worker.preflight import check

    try:
        for role in roles:
            check(role)
    except DependencyMissing as exc:
        typer.echo(f"{exc.code.value} {exc.message}", err=True)  # one line: rich would wrap it
        raise typer.Exit(3) from exc


def secrets_or_exit(role: str, settings: Settings) -> None:
    """Stop before taking work on the example's public secrets, unless fleet up / fleet demo
    started this broker (fleet/core/exposure.py); a warning there. Warn when the broker is
    reached as the all-powerful default user (no ACL users: no isolation between projects)."""
    import redis

    from fleet.core.exposure import broker_is_local, refuse_public_secrets, warn_shared_broker

    local = broker_is_local(settings)
    try:
        refuse_public_secrets(settings, local_broker=local, role=role)
    except PublicSecrets as exc:
        typer.echo(f"{exc.code.value} {exc.message}", err=True)
        raise typer.Exit(3) from exc
    client = redis_client(settings)
    # an unreachable broker is reported by the process itself, the moment it needs it
    with client, contextlib.suppress(redis.RedisError):
        warn_shared_broker(settings, client, local_broker=local, role=role)


def workers_key_or_exit(settings: Settings) -> None:
    """Prep seals with security.worker_secret, inference and the dispatchers' hand-off to a
    gateway check the seal, the gateway seals its requests' records (fleet/core/seal.py)."""
    if not settings.security.worker_secret:
        err.print("[red]config error:[/red] security.worker_secret is not set (docs/security.md)")
        raise typer.Exit(2)


def backend_order_or_exit(role: str, settings: Settings) -> None:
    """A worker or gateway whose [[backends]] are in another order than the dispatchers' store
    would read and write positions naming other backends: it does not start (docs/backends.md).
    A broker it cannot read now is left to the role's own handling of an unreachable Redis."""
    import redis

    from fleet.core.keys import Keys
    from fleet.core.redisconn import redis_client
    from schedulers.store.redis_store import order_conflict, stored_backends

    try:
        client = redis_client(settings, socket_timeout=5, socket_connect_timeout=5)
        try:
            stored = stored_backends(client, Keys(settings.key_prefix))
        finally:
            client.close()
    except redis.RedisError:
        return
    why = order_conflict([b.name for b in settings.backends], stored)
    if why is not None:
        fail(ConfigError(f"{role}: {why}"), 2)


def fail(exc: FleetError, exit_code: int = 1) -> NoReturn:
    """The one line a command prints for an error: its code and message (no rich wrapping)."""
    typer.echo(f"{exc.code.value} {exc.message}", err=True)
    raise typer.Exit(exit_code) from exc


@contextmanager
def broker_errors(settings: Settings) -> Iterator[None]:
    """One line instead of a traceback: a broker that does not answer (E_BROKER_UNAVAILABLE, exit
    2, the URL without its password), a job its project does not have (E_NOT_FOUND, exit 1)."""
    import kombu.exceptions

    from fleet.core.redisconn import UNREACHABLE, broker_unavailable

    try:
        yield
    except BrokerUnavailable as exc:
        fail(exc, 2)
    except (*UNREACHABLE, kombu.exceptions.OperationalError) as exc:
        fail(broker_unavailable(settings.broker_url, exc), 2)
    except NotFound as exc:
        fail(exc)


def client_or_exit():  # type: ignore[no-untyped-def]
    from fleet.client import Client
    from fleet.core.redisconn import broker_unavailable, sentinel_target
    from fleet.local.embedded import redis_answers

    settings = settings_or_exit()
    if not redis_answers(settings.broker_url, **sentinel_target(settings)):
        fail(broker_unavailable(settings.broker_url, ConnectionError("no PING reply")), 2)
    return Client(settings)


def broker_or_exit(role: str, settings: Settings) -> None:
    """Check the broker's persistence before taking work (fleet/core/persistence.py); a broker
    that does not answer yet is not checked (the process waits for it like for any restart)."""
    from fleet.core.exposure import broker_is_local
    from fleet.core.persistence import check_broker
    from fleet.core.redisconn import UNREACHABLE

    client = redis_client(settings, socket_connect_timeout=2, socket_timeout=2)
    try:
        check_broker(settings, client, role=role, local_broker=broker_is_local(settings))
    except BrokerUnsafe as exc:
        fail(exc, 3)
    except UNREACHABLE as exc:
        logging.getLogger("fleet").warning("%s: the broker does not answer yet (%r); its persistence "
                                           "is not checked", role, exc)
    finally:
        client.close()


# -- running the fleet ------------------------------------------------------------------------
@app.command()
def worker(
    role: Annotated[str, typer.Option(
        help="all | prep | collect | infer | tools, or several joined by commas "
             "(infer,prep,collect): which queues to consume")] = "all",
    concurrency: Annotated[int, typer.Option(help="threads (or processes) in this worker")] = 40,
    pool: Annotated[str, typer.Option(help="threads (inference: one thread per stream) or "
                                           "prefork (CPU-bound prep at scale)")] = "threads",
    hostname: Annotated[str, typer.Option(help="Celery node name")] = "fleet@%h",
    log_level: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Run a Celery worker (--pool threads, or prefork) for project queues and/or the inference queue."""
    from fleet.worker.app import worker_app
    from fleet.worker.queues import INFER_QUEUE, collect_queues, prep_queues, tool_queues

    settings = settings_or_exit()
    setup_logging(log_level)
    roles = {"infer", "prep", "collect", "tools"} if role == "all" else set(role.split(","))
    queues = []
    if "infer" in roles:
        queues.append(INFER_QUEUE)
    if "prep" in roles:
        queues += prep_queues(settings)
    if "collect" in roles:
        queues += collect_queues(settings)
    if "tools" in roles:
        queues += tool_queues(settings)
    if not queues or not roles <= {"infer", "prep", "collect", "tools"}:
        raise typer.BadParameter("role must be all, prep, collect, infer or tools, or several "
                                 "joined by commas (tools: no project runs tools)")
    if "tools" in roles and roles & {"prep", "collect"} and settings.tool_imports:
        # A tool's time limits hold only in a prefork pool, and a slow tool beside prep or
        # collect takes the threads those need (docs/tools.md).
        logging.getLogger("fleet").warning(
            "worker --role %s imports tool_imports beside project queues: tools share this pool "
            "and their time limits hold only in a prefork pool. Fine for a local run; in a "
            "deployment run the tools apart (--role tools --pool prefork) and the others with "
            "--role infer, prep or collect", role)
    preflight_or_exit(*sorted(roles))
    broker_or_exit("worker", settings)  # a refusal first: then it is the only line printed
    secrets_or_exit("worker", settings)
    workers_key_or_exit(settings)
    backend_order_or_exit("worker", settings)
    worker_app(settings, tools="tools" in roles).worker_main([
        "worker", "-Q", ",".join(queues), "-P", pool, "-c", str(concurrency), "-E",
        "-n", hostname, "--loglevel", log_level, "--without-mingle", "--without-gossip",
    ])


@app.command()
def dispatcher(log_level: Annotated[str, typer.Option()] = "INFO") -> None:
    """Run a rate-shaping dispatcher (any number may run; admission is atomic in Redis).
    SIGINT, SIGTERM and SIGHUP stop it after the current round (within admission.max_wait_s)."""
    import signal
    import threading

    preflight_or_exit("dispatcher")
    from fleet.worker.dispatch import serve_dispatcher

    settings = settings_or_exit()
    setup_logging(log_level)
    broker_or_exit("dispatcher", settings)
    secrets_or_exit("dispatcher", settings)
    workers_key_or_exit(settings)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve_dispatcher(settings, stop)
    except ConfigError as exc:  # the store's backends in another order (docs/backends.md)
        typer.echo(f"{exc.code.value} {exc.message}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def gateway(
    host: Annotated[str | None, typer.Option(help="default: gateway.host")] = None,
    port: Annotated[int | None, typer.Option(help="default: gateway.port")] = None,
    log_level: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Run the OpenAI-compatible HTTP gateway (chat completions and tasks) on the same admission.
    SIGHUP reloads the API keys and project defaults; SIGINT and SIGTERM stop it."""
    from fleet.gateway.server import serve_gateway

    settings = settings_or_exit()
    setup_logging(log_level)
    secrets_or_exit("gateway", settings)
    workers_key_or_exit(settings)
    backend_order_or_exit("gateway", settings)
    serve_gateway(settings, host, port)


@app.command()
def flower(
    port: Annotated[int, typer.Option()] = 5555,
    address: Annotated[str, typer.Option(
        help="interface to listen on; anything but loopback needs --basic-auth")] = "127.0.0.1",
    basic_auth: Annotated[str | None, typer.Option(
        envvar="FLOWER_BASIC_AUTH", show_envvar=True,
        help="user:password (several comma separated) Flower asks every visitor for")] = None,
) -> None:
    """Run Flower on the fleet's broker (tasks, workers, queues), its Tasks page in the fleet's
    columns: kind, project and job, state (CONTINUED: a turn that handed its job on), result
    (code, turn, attempts, tokens, backend). Job texts never reach Flower (fleet/worker/queues.py,
    fleet/worker/outcome.py)."""
    from fleet.worker.app import flower_argv, worker_app

    try:
        argv = flower_argv(port=port, address=address, basic_auth=basic_auth)
    except ConfigError as exc:
        typer.echo(f"{exc.code.value} {exc.message}", err=True)
        raise typer.Exit(2) from exc
    worker_app(settings_or_exit()).start(argv)


@app.command()
def up(
    speed: Annotated[float, typer.Option(help="simulator speed (when the simulator runs)")] = 1.0,
    workers: Annotated[int, typer.Option()] = 1,
    dispatchers: Annotated[int, typer.Option()] = 1,
    sim: Annotated[bool | None, typer.Option(
        "--sim/--no-sim", help="run on fleet sim / on backend.url (default: the simulator only "
                               "while backend.url is the example's default address)")] = None,
) -> None:
    """Bring the whole fleet up locally until stopped: broker (a private Redis when none is
    configured and none answers), the backend simulator unless a backend is configured, the
    dispatchers, the workers and the HTTP gateway (on gateway.port; 0 = none).

    SIGINT (Ctrl-C), SIGTERM or SIGHUP stops every child and exits 0; a child that exits on its
    own stops the rest and exits 1, printing its name, exit code and last lines to stderr. A
    configured broker that does not answer is one E_BROKER_UNAVAILABLE line (exit 2)."""
    from fleet.local.processes import LocalFleet, backend_for_up, shown_backends

    settings = settings_or_exit()
    backend = backend_for_up(settings, sim)
    fleet = LocalFleet(settings, sim_speed=speed, workers=workers, dispatchers=dispatchers,
                       log_level="INFO", handle_signals=True, backend_url=backend,
                       gateway_port=settings.gateway.port or None)
    with stopped_cleanly(), fleet:
        source = "backend.url" if backend else (
            "fleet sim, --sim" if sim else "fleet sim: backend.url is the example's default; --no-sim uses it")
        console.print(f"broker  {mask_url(fleet.env['FLEET_BROKER_URL'])}\n"
                      f"backend {shown_backends(fleet)} ({source})\n"
                      "Ctrl-C to stop.", markup=False, highlight=False)
        fleet.supervise()


@contextmanager
def stopped_cleanly() -> Iterator[None]:
    """A stop signal ends the command with 0, a child that died with 1 and its report, a broker
    that does not answer with 2 and its one line."""
    from fleet.local.processes import ChildExited, Stopped

    try:
        yield
    except Stopped as exc:
        err.print(f"stopped by {exc}")
    except ChildExited as exc:
        typer.echo(f"{exc.code.value} {exc.message}", err=True)
        raise typer.Exit(1) from exc
    except BrokerUnavailable as exc:
        fail(exc, 2)


@app.command()
def demo(
    jobs: Annotated[int, typer.Option(help="how many jobs to submit")] = 50,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 30.0,
    broker: Annotated[str | None, typer.Option(
        help="Redis URL to run on (default: FLEET_BROKER_URL if set, else a private redis-server)")]
    = None,
    replicas: Annotated[int, typer.Option(
        min=1, max=26,  # demo.MAX_REPLICAS: gpu-a to gpu-z
        help="servers the one configured backend runs as (gpu-a, gpu-b, ...), each a fleet sim")] = 2,
) -> None:
    """Run the fleet end to end on a private Redis, push a mixed batch through it and summarise.

    The demo writes into a Redis it starts itself unless --broker or FLEET_BROKER_URL names one;
    that one must answer, and only the demo's own keys are deleted from it afterwards."""
    import os

    from fleet.cli.demo import run_demo
    from fleet.local.embedded import redis_answers

    settings = settings_or_exit()
    broker = broker or os.environ.get("FLEET_BROKER_URL") or None
    if broker is not None:
        if not redis_answers(broker):
            err.print(f"{Code.E_INPUT_INVALID.value} no Redis answers at {mask_url(broker)}", markup=False)
            raise typer.Exit(2)
        settings = settings.model_copy(update={"broker_url": broker})
    wide = Console(width=max(console.width, 120))
    with stopped_cleanly():
        code = run_demo(settings, jobs=jobs, speed=speed, console=wide, private_broker=broker is None,
                        replicas=replicas)
        raise typer.Exit(code)


# -- using the fleet --------------------------------------------------------------------------
@app.command()
def submit(
    project: Annotated[str, typer.Option("--project", "-p")],
    prompt: Annotated[str | None, typer.Argument(help="user message text")] = None,
    file: Annotated[Path | None, typer.Option(help="a job as JSON")] = None,
    wait: Annotated[bool, typer.Option(help="wait for and print the result")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 3600,
) -> None:
    """Submit one job (a prompt, or a job JSON file) and print its id or its result."""
    if (prompt is None) == (file is None):
        raise typer.BadParameter("give a PROMPT or --file, not both")
    try:
        job: dict[str, Any] = job_file(file) if file else {"messages": [{"role": "user", "content": prompt}]}
    except InputInvalid as exc:
        fail(exc, 2)
    job["project"] = job.get("project", project)
    with client_or_exit() as client, broker_errors(client.settings):
        try:
            job_id = client.submit(job)
        except FleetError as exc:
            if isinstance(exc, BrokerUnavailable):
                raise
            fail(exc)
        if not wait:
            console.print(job_id)
            return
        envelope = client.result(job_id, timeout=timeout)
        if envelope is None:
            err.print(f"no result within {timeout:.0f} s for {job_id}")
            raise typer.Exit(1)
        console.print_json(envelope.model_dump_json())
        raise typer.Exit(0 if envelope.ok else 1)


def job_file(path: Path) -> dict[str, Any]:
    """A job JSON file as a dict; E_INPUT_INVALID naming the file when it cannot be read or is
    not a JSON object."""
    from fleet.cli.batch import input_text, read_input

    try:
        job = json.loads(input_text(path, read_input(path)))
    except json.JSONDecodeError as exc:
        raise InputInvalid(f"{path} is not JSON: {exc}") from exc
    if not isinstance(job, dict):
        raise InputInvalid(f"{path}: a job is a JSON object")
    return job


@app.command()
def batch(
    file: Annotated[Path, typer.Argument(help="JSONL: OpenAI batch lines or fleet job lines")],
    project: Annotated[str, typer.Option("--project", "-p")],
    wait: Annotated[bool, typer.Option(help="wait for every result")] = False,
    out: Annotated[Path | None, typer.Option(
        help="write each result line here as it arrives (implies --wait)")] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait in all")] = 24 * 3600,
    resume: Annotated[bool, typer.Option(
        help="after an interrupted run: send only the lines not yet in --out, collect the rest")]
    = False,
    collect: Annotated[bool, typer.Option(
        help="send nothing; collect the results of an earlier run into --out")] = False,
) -> None:
    """Submit a batch file (custom_ids unique); with --wait or --out, show progress by code and
    write one line per input as its result arrives (fleet/cli/batch.py)."""
    from fleet.cli.batch import run_batch

    settings = settings_or_exit()
    if settings.project(project) is None:  # before reading the file, before any broker
        fail(InputInvalid(f"unknown project {project!r} (not in this configuration)"), 2)
    with client_or_exit() as client, broker_errors(client.settings):
        try:
            code = run_batch(client, file, project, wait=wait, out=out, timeout_s=timeout,
                             console=console, resume=resume, collect=collect)
        except InputInvalid as exc:
            fail(exc, 2)
    raise typer.Exit(code)


JOB_HELP = "<project>/<id>, or an id with --project (ids are unique per project)"
ProjectOption = Annotated[str | None, typer.Option("--project", "-p", help="the job's project")]


def _job_ref(client: Client, job_id: str, project: str | None) -> str:
    """``<project>/<id>`` of a job of a project this configuration has (else E_INPUT_INVALID,
    exit 2, as ``fleet batch`` says it: the broker is not asked about a project it cannot have)."""
    try:
        ref = client.ref(job_id, project)
        named = ref.split("/", 1)[0]
        if client.settings.project(named) is None:
            raise InputInvalid(f"unknown project {named!r} (not in this configuration)")
    except FleetError as exc:
        fail(exc, 2)
    return ref


@app.command()
def status(job_id: Annotated[str | None, typer.Argument(help=JOB_HELP)] = None,
           project: ProjectOption = None) -> None:
    """A job's state and code; without an id, the queues."""
    if job_id is None:
        queues()
        return
    with client_or_exit() as client, broker_errors(client.settings):
        record = client.status(_job_ref(client, job_id, project))
    table = Table(show_header=False)
    for key, value in record.items():
        table.add_row(key, shown_time(value) if key.endswith("_at") else str(value))
    console.print(table)


def shown_time(value: Any) -> str:
    """A unix timestamp as people read it: UTC, to the millisecond (the raw value if not one)."""
    from datetime import UTC, datetime

    try:
        return datetime.fromtimestamp(float(value), tz=UTC).isoformat(sep=" ", timespec="milliseconds")
    except (TypeError, ValueError, OverflowError):
        return str(value)


@app.command()
def tail(job_id: Annotated[str, typer.Argument(help=JOB_HELP)],
         follow: Annotated[bool, typer.Option()] = True, project: ProjectOption = None) -> None:
    """Follow a job's live events (queued, admitted, attempts, deltas, retries, continuations,
    tool rounds, final). A broker outage while following is ridden out: one line when it goes,
    one when it is back, and the events resume after the last one shown."""
    import time

    from fleet.cli.outage import Outage
    from fleet.core.redisconn import UNREACHABLE

    with client_or_exit() as client, broker_errors(client.settings):
        ref, after, outage = _job_ref(client, job_id, project), "0-0", Outage()
        while True:
            try:
                if outage.since is not None:
                    client.redis.ping()
                    if outage.answered():
                        err.print(outage.back_text(), markup=False, highlight=False)
                for event in client.events(ref, follow=follow, after=after):
                    after = event["id"]
                    _print_event(event)
                return
            except UNREACHABLE:
                if not follow:
                    raise
                if outage.failed():
                    err.print(outage.down_text(), markup=False, highlight=False)
                time.sleep(1.0)


def _print_event(event: dict[str, Any]) -> None:
    from fleet.cli.tail import describe

    data = event["data"]
    text = data.get("text") if isinstance(data, dict) else None
    if event["type"] in ("reasoning", "content") and text:
        style = "dim" if event["type"] == "reasoning" else ""
        console.print(text, style=style, end="", markup=False, highlight=False)
    else:
        console.print("\n" + describe(event["type"], data))


@app.command()
def cancel(job_id: Annotated[str, typer.Argument(help=JOB_HELP)],
           project: ProjectOption = None) -> None:
    """Cancel a job of a project this configuration holds the secret of: a queued one soon, a
    running one within a second (E_CANCELLED)."""
    with client_or_exit() as client, broker_errors(client.settings):
        if client.cancel(_job_ref(client, job_id, project)):
            console.print(f"cancelling {job_id}")
        else:
            err.print(f"{job_id} already has its final result")
            raise typer.Exit(1)


@app.command()
def queues() -> None:
    """Pending per project and band, in flight, reserved KV, long prompts, holds."""
    from fleet.cli.queues import queues_table

    settings = settings_or_exit()
    with broker_errors(settings):
        console.print(queues_table(settings, redis_client(settings)))


@app.command()
def usage(
    project: Annotated[str | None, typer.Option("--project", "-p",
                                                help="one project (default: every configured one)")] = None,
    by: Annotated[str, typer.Option(help="hour | day | key | model")] = "day",
    days: Annotated[float, typer.Option(help="how far back, in days")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="JSON rows instead of a table")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV rows instead of a table")] = False,
) -> None:
    """What each project spent, from the usage ledger (docs/usage.md): model turns, prompt,
    cached, reasoning and answer tokens, cut turns, loop cuts, tool rounds, codes."""
    from fleet.cli.usage import render_csv, render_json, render_table, usage_rows
    from fleet.core.keys import Keys
    from fleet.core.usage import UsageLedger

    settings = settings_or_exit()
    try:
        if as_json and as_csv:
            raise InputInvalid("--json and --csv: choose one")
        if project is not None and settings.project(project) is None:
            raise InputInvalid(f"unknown project {project!r} (not in this configuration)")
    except FleetError as exc:
        fail(exc, 2)
    projects = [project] if project is not None else sorted(settings.projects)
    with broker_errors(settings):
        ledger = UsageLedger(redis_client(settings), Keys(settings.key_prefix), settings.usage)
        try:
            rows = usage_rows(ledger, projects, by, days)
        except FleetError as exc:
            fail(exc, 2)
    if as_json:
        typer.echo(render_json(rows))
    elif as_csv:
        typer.echo(render_csv(rows), nl=False)
    else:
        console.print(render_table(rows, by))


cache_app = typer.Typer(add_completion=False, no_args_is_help=True)


@cache_app.command("stats")
def cache_stats(
    project: Annotated[str | None, typer.Option("--project", "-p",
                                                help="one project (default: every configured one)")] = None,
) -> None:
    """Entries and bytes held, hits, misses, waits for an identical request, stores, evictions."""
    from fleet.cli.cache import projects_named, stats_table

    settings = settings_or_exit()
    try:
        projects = projects_named(settings, project)
    except FleetError as exc:
        fail(exc, 2)
    with broker_errors(settings):
        console.print(stats_table(settings, projects))


@cache_app.command("clear")
def cache_clear(
    project: Annotated[str, typer.Option("--project", "-p", help="the project whose answers go")],
) -> None:
    """Forget every kept answer of one project (its counters stay)."""
    from fleet.cli.cache import clear, projects_named

    settings = settings_or_exit()
    try:
        projects_named(settings, project)
    except FleetError as exc:
        fail(exc, 2)
    with broker_errors(settings):
        dropped = clear(settings, project)
    console.print(f"{project}: {dropped} kept answers dropped")


@app.command()
def top(once: Annotated[bool, typer.Option(help="print one frame and exit")] = False) -> None:
    """Live view: in flight vs cap, per-project pending, waits and tokens/s, holds, backend."""
    from fleet.cli.top import run_top

    settings = settings_or_exit()
    with broker_errors(settings):
        run_top(settings, redis_client(settings), console, once)


@app.command()
def codes() -> None:
    """The message-code catalogue (docs/codes.md's table is generated from the same source)."""
    from fleet.core.codes import markdown_table

    typer.echo(markdown_table())


@app.command()
def config(reference: Annotated[bool, typer.Option(help="print the key reference")] = False) -> None:
    """Show the settings in force (file + FLEET_* variables), or the key reference."""
    from fleet.core.config import config_path, reference_markdown

    if reference:
        typer.echo(reference_markdown())
        return
    settings = settings_or_exit()
    shown = settings.model_dump(mode="json")
    for project in shown["projects"].values():
        project["secret"] = "***"
    for backend in (shown["backend"], *shown["backends"]):
        backend["api_key"] = "***" if backend["api_key"] else ""
        backend["url"] = mask_url(backend["url"])
    shown["security"]["worker_secret"] = "***" if shown["security"]["worker_secret"] else None
    shown["acl"]["passwords"] = dict.fromkeys(shown["acl"]["passwords"], "***")
    shown["broker_url"] = mask_url(shown["broker_url"])
    console.print(f"# from {config_path()}")
    console.print_json(json.dumps(shown))


@app.command()
def acl(apply: Annotated[bool, typer.Option(help="ACL SETUSER on the broker (needs ACL rights)")] = False) -> None:
    """Redis ACL users: one producer per project, a worker, a dispatcher, an operator
    (docs/security.md). Prints the rules and each user's broker URL: its password from acl.passwords
    or acl.password_file, else a new one."""

    from fleet.cli.acl import acl_users, apply_users, render

    settings = settings_or_exit()
    try:
        users = acl_users(settings)
    except FleetError as exc:
        err.print(f"[red]{exc.code.value}[/red] {exc.message}")
        raise typer.Exit(2) from exc
    if apply:
        client = redis_client(settings)
        try:
            apply_users(client, users)
        except FleetError as exc:
            err.print(f"[red]{exc.code.value}[/red] {exc.message}")
            raise typer.Exit(1) from exc
        finally:
            client.close()
    sys.stdout.write(render(users, settings.broker_url))


@app.command()
def rejections(count: Annotated[int, typer.Option()] = 20) -> None:
    """The latest E_AUTH rejections (kept apart from every project's results)."""
    with client_or_exit() as client, broker_errors(client.settings):
        entries = client.redis.xrevrange(client.keys.rejections, count=count)
    table = Table("time", "job", "claimed project", "reason")
    for _id, fields in entries:
        f = {k.decode(): v.decode() for k, v in fields.items()}
        table.add_row(shown_time(f.get("ts", "")), f.get("job_id", ""), f.get("project", ""),
                      f.get("reason", ""))
    console.print(table)


def _register_external() -> None:
    """Commands that live beside their code."""
    from fleet.bench import bench_app
    from fleet.cli.keys import keys_app
    from fleet.cli.plan import plan_command
    from fleet.prep.prefix import prefix_command
    from fleet.sim.server import sim_command

    app.command("sim", help="Run the vLLM-compatible simulator.")(sim_command)
    app.command("prefix", help="Check a project's shared prefix against the KV block size.")(
        prefix_command)
    app.command("plan", help="Size a deployment: KV arithmetic per parallel layout, or check a server.")(
        plan_command)
    app.add_typer(bench_app, name="bench", help="Benchmarks (ratios against same-run baselines).")
    app.add_typer(keys_app, name="keys", help="Gateway API keys: mint one for a project.")
    app.add_typer(cache_app, name="cache", help="The projects' exact-repeat caches: stats, clear.")


_register_external()

if __name__ == "__main__":
    sys.exit(app())
