"""Running the simulator: options, the blocking ``serve``, the ``fleet sim`` command, and a helper
that starts it as a real process for tests and benchmarks.

``SimOptions`` is the one description of a simulator instance; ``python -m fleet.sim`` (argparse)
and ``fleet sim`` (typer, ``sim_command``) both build one and call ``serve``. Options left at
``None`` take the profile's value (``--profile qwen3-next-tp2pp2``, docs/deployment.md's server, is the
default).

``start_sim_process(port, **options)`` runs ``python -m fleet.sim`` in a child process, waits until
``GET /health`` answers 200 and returns the ``Popen`` (a ``SimProcess`` with ``base_url``); its
stdout/stderr go to a log file whose tail is included in the error if it does not come up.
``stop()`` terminates it (then kills it after a grace period) and removes the log; it is also a
context manager (``with start_sim_process(...) as sim:``) that stops the process on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import typer

from fleet.sim.profiles import DEFAULT_PROFILE, get_profile

if TYPE_CHECKING:  # the server's own modules load when it runs: the `fleet` command registers
    from fleet.sim.app import SimConfig  # `fleet sim` without needing the sim extra installed

log = logging.getLogger(__name__)


@dataclass
class SimOptions:
    host: str = "127.0.0.1"
    port: int = 8100
    profile: str = DEFAULT_PROFILE
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    kv_pool_tokens: int | None = None
    block_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    speed: float = 1.0
    seed: int = 0
    fault_rate: float = 0.0
    long_threshold: int = 32_768
    think_min_tokens: int = 800
    think_max_tokens: int = 12_000
    answer_min_tokens: int = 120
    answer_max_tokens: int = 600
    log_level: str = "info"
    served_model_name: tuple[str, ...] = ("local",)
    chat_template: str = "qwen3"

    def config(self) -> SimConfig:
        from fleet.sim.app import SimConfig
        from fleet.sim.plan import LengthDistribution

        profile = get_profile(self.profile).with_overrides(
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            kv_pool_tokens=self.kv_pool_tokens, block_tokens=self.block_tokens,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            served_model_names=tuple(self.served_model_name))
        if not self.served_model_name or not all(name.strip() for name in self.served_model_name):
            raise ValueError("served_model_name: give one or more non-empty names")
        if self.speed <= 0:
            raise ValueError("speed must be positive")
        from fleet.sim.template import TEMPLATES
        if self.chat_template not in TEMPLATES:
            raise ValueError(f"chat_template: one of {', '.join(TEMPLATES)}")
        if profile.max_model_len > profile.kv_pool_tokens:
            log.warning("sim: max_model_len %d exceeds the KV pool (%d tokens)",
                        profile.max_model_len, profile.kv_pool_tokens)
        lengths = LengthDistribution(self.think_min_tokens, self.think_max_tokens,
                                     self.answer_min_tokens, self.answer_max_tokens)
        return SimConfig(profile=profile, speed=self.speed, seed=self.seed,
                         fault_rate=self.fault_rate, long_threshold=self.long_threshold,
                         lengths=lengths, chat_template=self.chat_template)

    def to_args(self) -> list[str]:
        """Command-line arguments for ``python -m fleet.sim`` that rebuild these options."""
        args: list[str] = []
        for key, value in asdict(self).items():
            if isinstance(value, tuple):
                args += ["--" + key.replace("_", "-"), *value]
            elif value is not None:
                args += ["--" + key.replace("_", "-"), str(value)]
        return args


class _DropFilter(logging.Filter):
    """The ``drop`` scenario closes connections on purpose; uvicorn would log it as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing response" not in record.getMessage()


def serve(options: SimOptions) -> None:
    """Run the simulator until interrupted (blocking)."""
    import uvicorn

    from fleet.sim.app import create_app

    logging.basicConfig(level=options.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.error").addFilter(_DropFilter())
    app = create_app(options.config())
    config = uvicorn.Config(app, host=options.host, port=options.port,
                            log_level=options.log_level.lower(), access_log=False,
                            lifespan="on", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to 0 and release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SimProcess(subprocess.Popen):  # type: ignore[type-arg]
    base_url: str = ""
    log_path: str = ""

    def stop(self, grace_s: float = 5.0, keep_log: bool = False) -> None:
        """Terminate (kill after ``grace_s``); the log file is removed unless ``keep_log``."""
        if self.poll() is None:
            self.terminate()
            try:
                self.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
                self.wait()
        if self.log_path and not keep_log:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_sim_process(port: int | None = None, timeout_s: float = 30.0,
                      **options: Any) -> SimProcess:
    """Start ``python -m fleet.sim`` on ``port`` (a free one if None); wait for ``/health``."""
    opts = SimOptions(port=port or free_port(), **options)
    fd, log_path = tempfile.mkstemp(prefix=f"fleet-sim-{opts.port}-", suffix=".log")
    with os.fdopen(fd, "wb") as log_file:
        proc = SimProcess([sys.executable, "-m", "fleet.sim", *opts.to_args()],
                          stdout=log_file, stderr=subprocess.STDOUT)
    proc.base_url = f"http://{opts.host}:{opts.port}"
    proc.log_path = log_path
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(proc.base_url + "/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.stop(keep_log=True)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-2000:]
    raise RuntimeError(f"fleet sim did not come up on {proc.base_url}:\n{tail}")


def sim_command(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8100,
    profile: Annotated[str, typer.Option(help="Deployment profile: qwen3-next-tp2pp2, tiny.")]
    = DEFAULT_PROFILE,
    max_num_seqs: Annotated[int | None, typer.Option(help="Running sequences at most.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context length, tokens.")] = None,
    kv_pool_tokens: Annotated[int | None, typer.Option(help="KV pool size, tokens.")] = None,
    block_tokens: Annotated[int | None, typer.Option(help="KV block size, tokens.")] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help="Tokens per engine step (prefill chunk).")] = None,
    max_num_partial_prefills: Annotated[int | None, typer.Option(
        help="vLLM's flag: prompts part-way through prefill at once (default 1).")] = None,
    max_long_partial_prefills: Annotated[int | None, typer.Option(
        help="vLLM's flag: of those, long ones at most (default 1).")] = None,
    long_prefill_token_threshold: Annotated[int | None, typer.Option(
        help="vLLM's flag: prefill tokens per request and step at most; a longer prompt is long "
             "(default 0: none, or 4% of max_model_len with several partial prefills).")] = None,
    speed: Annotated[float, typer.Option(help="Simulated seconds per real second.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed for texts, lengths and faults.")] = 0,
    fault_rate: Annotated[float, typer.Option(help="Share of requests given a random fault.")]
    = 0.0,
    long_threshold: Annotated[
        int, typer.Option(help="Prompt tokens above which a request counts as long.")] = 32_768,
    think_min_tokens: Annotated[int, typer.Option(help="Shortest drawn thinking.")] = 800,
    think_max_tokens: Annotated[int, typer.Option(help="Longest drawn thinking.")] = 12_000,
    answer_min_tokens: Annotated[int, typer.Option(help="Shortest drawn answer.")] = 120,
    answer_max_tokens: Annotated[int, typer.Option(help="Longest drawn answer.")] = 600,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
    served_model_name: Annotated[list[str] | None, typer.Option(
        help="vLLM's flag: a model name requests may give (repeat it for several; the first is "
             "the one responses carry). Default: local.")] = None,
    chat_template: Annotated[str, typer.Option(
        help="qwen3: the generation prompt opens <think> (the deployment's model); plain: the "
             "assistant header only.")] = "qwen3",
) -> None:
    """Run a vLLM OpenAI-compatible server simulator (docs/deployment.md's server by default)."""
    given = {k: v for k, v in locals().items() if k != "served_model_name"}
    serve(SimOptions(**given, served_model_name=tuple(served_model_name or ("local",))))
