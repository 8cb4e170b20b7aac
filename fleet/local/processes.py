"""Starting, watching and stopping the fleet's processes for ``fleet up`` and ``fleet demo``.

``LocalFleet`` brings up, in order: the broker (a private redis-server when ``private_broker`` is
set, else fleet/local/embedded.py decides: configured, answering or a private one), ``fleet sim``
unless ``backend_url`` names the backend to use (``fleet up`` decides, ``backend_for_up``), the
dispatchers, the workers and (with ``gateway_port``)
``fleet gateway``, each as a child process. When a project runs tools, the workers leave the tool
queues to one more worker, ``tools``, on the prefork pool: only there do the tool tasks' Celery
time limits hold (a hung tool is killed, docs/tools.md)
that inherits ``FLEET_BROKER_URL`` / ``FLEET_BACKEND_URL`` so all of them agree on where things
are. (In production the Procfile runs the same commands under honcho.) A broker it started itself
(or any broker, for ``local_broker``: ``fleet demo``) is also named in ``FLEET_LOCAL_BROKER``, so
dispatchers and workers run on the example's public secrets there with a warning instead of
refusing to start (fleet/core/exposure.py).

Environment: by default each child inherits this process's environment (``fleet up`` runs the
fleet its operator configured). With ``inherit_env=False`` (every ``fleet bench``) a child gets
only the operating system's basics (``OS_ENV``: PATH, HOME, locale, TMPDIR, ...) plus what the
caller sets: no ``FLEET_*`` variable of the operator's shell (a ``FLEET_BACKEND_URL`` would send
the bench's load to a production vLLM; without ``backend_url`` the children are pointed at the
simulator whatever the shell says, a ``FLEET_BROKER_URL`` or ``FLEET_PROJECTS`` would mix
in a deployment's) and ``FLEET_CONFIG`` always named (``config_path``, else the shipped example),
so a ``./fleet.toml`` in the working directory is never read either.

Life cycle, as an operator sees it:
- every child runs in its own session, so stopping it signals its whole process group (Celery
  prefork children included) and a Ctrl-C in the terminal reaches only the parent, which then
  stops the children in order;
- ``close`` stops them in the reverse order: SIGTERM to each group, a wait of at most
  ``grace_s``, then SIGKILL to whatever is left, so nothing is left behind for the next run;
- with ``handle_signals`` (the CLI sets it), SIGINT, SIGTERM and SIGHUP raise ``Stopped`` in the
  main thread, so the ``with`` block ends and ``close`` runs - under systemd, honcho or a container
  runtime as well as in a terminal. Signals after the first are ignored: the clean-up they would
  interrupt is already under way and bounded;
- each child's output is read line by line by a thread: into ``<log_dir>/<name>.log`` when
  ``log_dir`` is set, else onto this process's standard output prefixed with the child's name.
  The last ``TAIL_LINES`` lines of each are kept in memory;
- ``supervise`` blocks while the children run. Each is meant to run until ``close``, so one that
  exits raises ``ChildExited`` at once, naming it, with its exit code and the tail of its output.
  A child that dies while the group is starting (the simulator rejecting an option, say) raises
  the same error from ``start``, which then stops what it had started.

- ``restart`` starts a child again with its command (kill -9 first if it still runs) and
  ``restart_exited`` does so for every child that exited: a supervisor's restart policy, for the
  tests and ``fleet bench chaos`` that kill processes on purpose (``supervise`` still raises).

Not covered: a parent killed with SIGKILL cannot stop its children; stop them by process group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any

import httpx

from fleet.core.codes import Code
from fleet.core.config import EXAMPLE_CONFIG, BackendSettings, Settings
from fleet.core.errors import FleetError
from fleet.core.exposure import LOCAL_BROKER_ENV
from fleet.core.redisconn import mask_url, sentinel_target
from fleet.local.embedded import STOP_SIGNALS, EmbeddedRedis, ensure_broker, free_port, start_redis, track

log = logging.getLogger(__name__)

TAIL_LINES = 20
# what a child of ``inherit_env=False`` keeps of this process's environment
OS_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH")
_stdout_lock = threading.Lock()


class ChildExited(FleetError):
    """A child of a running process group exited before it was asked to."""

    code = Code.E_INTERNAL

    def __init__(self, name: str, returncode: int, tail: list[str]) -> None:
        shown = "\n".join(f"  {line}" for line in tail) if tail else "  (no output)"
        super().__init__(f"{name} exited with code {returncode}; the last lines of its output:\n{shown}")
        self.name = name
        self.returncode = returncode
        self.tail = tail


class Stopped(Exception):
    """A stop signal arrived (``LocalFleet.handle_signals``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


TOOL_PROCESSES = 4  # the local tool worker's prefork processes: tool calls run at once


@dataclass
class LocalFleet:
    settings: Settings
    sim_speed: float = 25.0
    sim_args: list[str] = field(default_factory=list)
    workers: int = 1
    worker_concurrency: int = 40
    dispatchers: int = 1
    log_level: str = "WARNING"
    config_path: str | None = None
    log_dir: str | None = None  # children's output goes to <log_dir>/<name>.log when set
    extra_env: dict[str, str] = field(default_factory=dict)  # FLEET_* overrides for children
    private_broker: bool = False  # always start a private redis-server, whatever is configured
    local_broker: bool = False  # mark the broker local even when it was not started here
    handle_signals: bool = False  # turn SIGINT/SIGTERM/SIGHUP into Stopped (main thread only)
    gateway_port: int | None = None  # start ``fleet gateway`` on this port (None: no gateway)
    backend_url: str | None = None  # the backend the children use (None: start ``fleet sim``)
    sim_urls: dict[str, str] = field(default_factory=dict)  # backend name -> its simulator's url
    inherit_env: bool = True  # False: children get OS_ENV and what is set here only (benches)
    env: dict[str, str] = field(default_factory=dict)
    broker: EmbeddedRedis | None = None
    children: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    _tails: dict[str, deque[str]] = field(default_factory=dict, repr=False)
    _readers: dict[str, threading.Thread] = field(default_factory=dict, repr=False)
    _commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict, repr=False)
    _previous_handlers: dict[int, Any] = field(default_factory=dict, repr=False)
    _stopping: bool = field(default=False, repr=False)

    def start(self) -> LocalFleet:
        if self.handle_signals:
            self._previous_handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            self._start_all()
        except BaseException:
            self.close()
            raise
        return self

    def _start_all(self) -> None:
        self.broker = start_redis() if self.private_broker else ensure_broker(
            self.settings.broker_url, **sentinel_target(self.settings))
        inherited = os.environ if self.inherit_env else os_env()
        self.env = {**inherited, **self.extra_env, "FLEET_BROKER_URL": self.broker.url,
                    "FLEET_KEY_PREFIX": self.settings.key_prefix}
        if self.config_path or not self.inherit_env:
            self.env["FLEET_CONFIG"] = self.config_path or str(EXAMPLE_CONFIG)
        if self.broker.started or self.local_broker:
            self.env[LOCAL_BROKER_ENV] = self.broker.url
        if self.backend_url:
            if len(self.settings.backends) == 1:  # several: each entry's own url, as configured
                self.env["FLEET_BACKEND_URL"] = self.backend_url
        else:
            self._start_sim()
        for n in range(self.dispatchers):
            extra = {} if n == 0 else {"FLEET_ADMISSION_METRICS_PORT": "0"}
            self.spawn(f"dispatcher-{n}", ["dispatcher", "--log-level", self.log_level], extra)
        tools = self._runs_tools()
        for n in range(self.workers):
            role = ["--role", "infer,prep,collect"] if tools else []
            self.spawn(f"worker-{n}", ["worker", *role, "--concurrency", str(self.worker_concurrency),
                                       "--hostname", f"fleet-{n}-{os.getpid()}@%h",
                                       "--log-level", self.log_level])
        if tools:
            self.spawn("tools", ["worker", "--role", "tools", "--pool", "prefork",
                                 "--concurrency", str(TOOL_PROCESSES),
                                 "--hostname", f"fleet-tools-{os.getpid()}@%h",
                                 "--log-level", self.log_level])
        if self.gateway_port is not None:
            self.spawn("gateway", ["gateway", "--port", str(self.gateway_port),
                                   "--log-level", self.log_level])
            process = self.children[-1][1]
            wait_http(f"http://127.0.0.1:{self.gateway_port}/health", timeout_s=30,
                      alive=lambda: process.poll() is None)
            if process.poll() is not None:
                raise self._exited("gateway", process)

    def _runs_tools(self) -> bool:
        from fleet.worker.queues import tool_queues

        return bool(tool_queues(self.settings))

    def _start_sim(self) -> None:
        """One ``fleet sim`` per backend entry: ``sim`` for the first, ``sim-<name>`` for each
        other. With one backend the children find it in FLEET_BACKEND_URL; with several, in
        FLEET_BACKENDS (every entry as configured, each with its simulator's url), and each
        simulator takes its entry's sizes (sequences, context, pool, block), so the server check
        agrees with it."""
        entries = self.settings.backends
        urls: dict[str, str] = {}
        for index, entry in enumerate(entries):
            name = "sim" if index == 0 else f"sim-{entry.name}"
            port = free_port()
            urls[entry.name] = url = f"http://127.0.0.1:{port}"
            # The simulator's access log is a line per request (two per dispatcher scrape): quiet
            # unless sim_args ask otherwise (the last --log-level wins). It serves the backend's
            # model names, so the fleet's requests name a model it serves.
            names = [arg for served in entry.served_models for arg in ("--served-model-name", served)]
            sizes = [] if len(entries) == 1 else [
                "--max-num-seqs", str(entry.max_num_seqs), "--max-model-len", str(entry.max_model_len),
                "--kv-pool-tokens", str(entry.kv_pool_tokens), "--block-tokens", str(entry.block_tokens)]
            self.spawn(name, ["sim", "--port", str(port), "--speed", str(self.sim_speed),
                              "--log-level", "warning", *names, *sizes, *self.sim_args])
            process = self.children[-1][1]
            wait_http(f"{url}/health", timeout_s=30, alive=partial(_alive, process))
            if process.poll() is not None:
                raise self._exited(name, process)
        self.sim_urls = urls
        if len(entries) == 1:
            self.env["FLEET_BACKEND_URL"] = urls[entries[0].name]
        else:  # (FLEET_BACKEND_URL would override the first entry alone)
            # without api_key: a simulator asks for none, and a key in the environment of every
            # child would show in its /proc/<pid>/environ and in any crash report
            self.env["FLEET_BACKENDS"] = json.dumps(
                [{**entry.model_dump(mode="json", exclude={"api_key"}), "url": urls[entry.name]} for entry in entries])

    def backend_urls(self) -> dict[str, str]:
        """Backend name -> the url the children use (a simulator's, or the configured one)."""
        if self.sim_urls:
            return dict(self.sim_urls)
        if len(self.settings.backends) == 1:
            return {self.settings.backend.name: self.env.get("FLEET_BACKEND_URL", self.settings.backend.url)}
        return {entry.name: entry.url for entry in self.settings.backends}

    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> None:
        env = {**self.env, **(extra_env or {})}
        self._commands[name] = (args, extra_env or {})
        process = track(subprocess.Popen([sys.executable, "-m", "fleet", *args], env=env,
                                         start_new_session=True, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        self.children.append((name, process))
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        sink = open(os.path.join(self.log_dir, f"{name}.log"), "a") if self.log_dir else None  # noqa: SIM115
        reader = threading.Thread(target=_copy_output, args=(process.stdout, sink, f"{name} | ", tail),
                                  name=f"output-{name}", daemon=True)
        reader.start()
        self._tails[name], self._readers[name] = tail, reader
        log.info("started %s pid=%d", name, process.pid)

    def restart(self, name: str) -> None:
        """Start child ``name`` again with its command, as a supervisor with a restart policy does
        (systemd ``Restart=always``): the old process, dead or alive, is killed first."""
        self.kill(name)
        self.start_again(name)

    def kill(self, name: str) -> None:
        """SIGKILL child ``name`` (its process group) and forget the process, keeping its command
        for ``start_again``: a process that stays down until told (a supervisor never restarts it:
        it is no longer a child)."""
        old = next(p for n, p in self.children if n == name)
        _signal_group(old, signal.SIGKILL)
        old.wait(timeout=10)
        self.children = [(n, p) for n, p in self.children if n != name]

    def start_again(self, name: str) -> None:
        """Start child ``name`` with the command it was started with (same port, same env)."""
        args, extra_env = self._commands[name]
        self.spawn(name, args, extra_env)

    def restart_exited(self) -> list[str]:
        """Restart every child that exited (a supervisor's pass); the names restarted."""
        exited = [] if self._stopping else self.check()
        for name in exited:
            log.warning("%s exited; restarting it", name)
            self.restart(name)
        return exited

    def check(self) -> list[str]:
        """Names of children that died."""
        return [name for name, p in self.children if p.poll() is not None]

    def supervise(self, done: Callable[[], bool] | None = None, every_s: float = 0.2) -> None:
        """Block until ``done()`` is true (forever without it); raise ``ChildExited`` as soon as
        a child exits, and ``Stopped`` on a stop signal when ``handle_signals`` is set."""
        while done is None or not done():
            for name, process in self.children:
                if process.poll() is not None:
                    raise self._exited(name, process)
            time.sleep(every_s)

    def _exited(self, name: str, process: subprocess.Popen) -> ChildExited:
        reader = self._readers.get(name)
        if reader is not None:
            reader.join(timeout=2)  # the last lines a dying child wrote
        return ChildExited(name, process.returncode, list(self._tails.get(name, ())))

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._stopping:
            log.info("%s: already stopping", signal.Signals(signum).name)
            return
        self._stopping = True
        raise Stopped(signum)

    def close(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        for _name, process in reversed(self.children):
            if process.poll() is None:
                _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, process in reversed(self.children):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", name, grace_s)
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=5)
            _signal_group(process, signal.SIGKILL)  # what its own children left behind
        for reader in self._readers.values():
            reader.join(timeout=2)
        self.children.clear()
        if self.broker is not None:
            self.broker.close()
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def backend_for_up(settings: Settings, sim: bool | None) -> str | None:
    """The backend ``fleet up`` runs on: ``--sim`` the simulator (None), ``--no-sim`` the
    configured ``backend.url``; neither, the configured one unless it is still the example's
    default address (nobody configured a backend: the simulator). The FLEET_BACKEND_URL variable
    is part of the configuration (it overrides ``backend.url``)."""
    if sim is None:
        sim = settings.backend.url == BackendSettings().url
    return None if sim else settings.backend.url


def shown_backends(fleet: LocalFleet) -> str:
    """The backends for a console line: the url alone for one, ``name url`` pairs for several
    (credentials masked)."""
    urls = fleet.backend_urls()
    if len(urls) == 1:
        return mask_url(next(iter(urls.values())))
    return ", ".join(f"{name} {mask_url(url)}" for name, url in urls.items())


def _alive(process: subprocess.Popen) -> bool:
    return process.poll() is None


def os_env() -> dict[str, str]:
    """What a bench's child keeps of this process's environment (``OS_ENV``)."""
    return {name: value for name, value in os.environ.items() if name in OS_ENV}


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    """Signal a child's process group (its session, started by ``spawn``); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _copy_output(stream: IO[bytes], sink: IO[str] | None, prefix: str, tail: deque[str]) -> None:
    """Copy a child's output line by line into ``sink`` (else prefixed onto stdout), keeping the
    tail. Never raises: a reader that stopped would leave the child blocked on a full pipe."""
    try:
        for raw in stream:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            tail.append(line)
            with contextlib.suppress(OSError, ValueError):  # a closed terminal: keep draining
                _write_line(sink, prefix, line)
    finally:
        stream.close()
        if sink is not None:
            sink.close()


def _write_line(sink: IO[str] | None, prefix: str, line: str) -> None:
    if sink is not None:
        sink.write(line + "\n")
        sink.flush()
        return
    out = sys.__stdout__
    if out is None:
        return
    with _stdout_lock:
        out.write(prefix + line + "\n")
        out.flush()


def wait_http(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Wait until ``url`` answers 200; return early when ``alive()`` turns false (the caller
    reports the dead process)."""
    deadline = time.monotonic() + timeout_s
    while alive():
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")
        time.sleep(0.1)
