"""Benchmarks of the fleet and its simulator (``fleet bench <name>``). Every figure is reported
next to a baseline measured in the same run; nothing here is a pass/fail test.

Each module exposes a plain function returning rows (or a rich table); this package only wires
them to the CLI.

Redis: every bench that needs one starts a private redis-server for its run (fleet/local/embedded.py;
``loss`` and ``chaos`` start their own per round) and stops it at the end, so a bench never writes
into a Redis someone else uses. ``--redis-url`` or ``FLEET_BENCH_REDIS_URL`` names one instead: it
must answer, and its database must be empty (a bench writes up to hundreds of thousands of keys
there and runs workers on the example configuration's public secrets, so a deployment's Redis is
refused, naming what it holds) unless ``--force``; the bench's keys go under a random prefix and
are deleted where the bench says so. ``loss`` and ``chaos`` kill and restart their Redis: they
refuse a named one (exit code 2), whatever ``--force`` says.

Environment: the processes a bench starts get none of the operator's ``FLEET_*`` variables (nor
any other but the operating system's basics, fleet/local/processes.py ``inherit_env``), and the
benches load the shipped example settings, never ``./fleet.toml``: a shell set up for a
deployment (``FLEET_BACKEND_URL``, ``FLEET_BROKER_URL``, ``FLEET_CONFIG``) cannot point a bench
at it.

Signals: SIGINT, SIGTERM and SIGHUP stop every process the bench started (simulator, workers,
dispatchers, redis-servers) before it exits (``stop_children_on_signals``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fleet.bench.charts import Charts
from fleet.core.codes import Code

bench_app = typer.Typer(no_args_is_help=True)
console = Console()
BENCH_REDIS_ENV = "FLEET_BENCH_REDIS_URL"
RedisUrl = Annotated[str, typer.Option(
    "--redis-url", envvar=BENCH_REDIS_ENV,
    help="a Redis for the bench (it must answer, its database empty); default: a private "
         "redis-server for the run")]
Force = Annotated[bool, typer.Option(
    "--force", help="run on a --redis-url whose database holds keys already")]
REDIS_HINT = f"--redis-url / {BENCH_REDIS_ENV}"
PlotDir = Annotated[str, typer.Option(
    "--plot", help="also draw this run's charts as PNG files into this folder (fleet/bench/plot.py)")]


@bench_app.callback()
def _signals() -> None:
    from fleet.local.embedded import stop_children_on_signals

    stop_children_on_signals()


def _redis_url(url: str, force: bool):  # type: ignore[no-untyped-def]
    """The bench's Redis: ``url`` when given (it must answer, and hold nothing unless ``force``),
    else a private redis-server."""
    from fleet.core.redisconn import mask_url
    from fleet.local.embedded import EmbeddedRedis, database_contents, redis_answers, start_redis

    if not url:
        return start_redis()
    if not redis_answers(url):
        raise typer.BadParameter(f"{Code.E_INPUT_INVALID.value} {mask_url(url)} does not answer",
                                 param_hint=REDIS_HINT)
    held = database_contents(url)
    if held and not force:
        raise typer.BadParameter(
            f"{Code.E_INPUT_INVALID.value} {mask_url(url)} {held}: a bench writes its keys there and "
            "runs workers on the example configuration's public secrets; name an empty Redis "
            "database (or none: a private redis-server), or add --force if this Redis is yours "
            "to spare", param_hint=REDIS_HINT)
    return EmbeddedRedis(url=url)


def _own_redis_only(bench: str, url: str) -> None:
    """``loss`` and ``chaos`` kill and restart their Redis: never one they did not start."""
    if url:
        raise typer.BadParameter(
            f"{Code.E_INPUT_INVALID.value} fleet bench {bench} kills and restarts its Redis, so it "
            f"runs only on redis-servers it starts itself; unset {BENCH_REDIS_ENV} and drop "
            "--redis-url", param_hint=REDIS_HINT)


def _pair(text: str) -> tuple[int, int]:
    try:
        first, second = (int(part) for part in text.split(","))
    except ValueError as exc:
        raise typer.BadParameter("two whole numbers, e.g. 4,3", param_hint="--partial-prefills") from exc
    return first, second


@bench_app.command("sim")
def sim(
    speed: Annotated[float, typer.Option(help="simulator speed for the main run")] = 20.0,
    duration_s: Annotated[float, typer.Option(help="measuring window per level, real s")] = 3.0,
    with_speed_1: Annotated[bool, typer.Option(help="also run at --speed 1")] = True,
) -> None:
    """Simulator throughput at concurrency 1-32 next to the deployment's measured figures."""
    from fleet.bench.sim import bench_sim

    bench_sim(speed, duration_s, with_speed_1, console=console)


@bench_app.command("dispatch")
def dispatch(
    jobs: Annotated[int, typer.Option(help="backlog size for the overhead figures")] = 100_000,
    saturation_jobs: Annotated[int, typer.Option(help="jobs in the in-bench saturation run")] = 400,
    speed: Annotated[float, typer.Option(help="simulator speed of the in-bench saturation run")] = 50.0,
    redis_url: RedisUrl = "",
    force: Force = False,
    overhead: Annotated[bool, typer.Option(help="run the dispatcher-only overhead figures")] = True,
    in_bench_saturation: Annotated[bool, typer.Option(
        help="with the overhead figures, also the in-bench saturation run against fleet sim")] = True,
    fleet: Annotated[bool, typer.Option(help="run the whole-fleet scenarios (real processes)")] = True,
    scenarios: Annotated[str, typer.Option(help="whole-fleet scenarios, comma separated")]
    = "fairness,saturation,long,mix,crash,idle",
    fleet_speed: Annotated[float, typer.Option(help="simulator speed of the whole-fleet runs")] = 5.0,
    fleet_jobs: Annotated[int, typer.Option(help="short jobs in the saturation scenario")] = 2000,
    think: Annotated[int, typer.Option(help="reasoning tokens of a short job (+-25%)")] = 200,
    answer: Annotated[int, typer.Option(help="answer tokens of a short job (+-25%)")] = 50,
    long_jobs: Annotated[int, typer.Option(help="jobs in the long-prompt and mix scenarios (10% long)")] = 200,
    long_tokens: Annotated[int, typer.Option(help="prompt tokens of a long job")] = 60_000,
    fair_n: Annotated[int, typer.Option(help="jobs per small project; the big one sends 10x")] = 100,
    crash_jobs: Annotated[int, typer.Option(help="jobs in the crash scenario")] = 400,
    workers: Annotated[int, typer.Option(help="Celery workers (processes)")] = 2,
    concurrency: Annotated[int, typer.Option(help="threads per Celery worker")] = 32,
    lease_ttl_s: Annotated[float, typer.Option(help="lease TTL of the whole-fleet runs")] = 5.0,
    idle_jobs: Annotated[int, typer.Option(help="jobs one at a time in the idle scenario")] = 100,
    paced_prefill_tokens_per_s: Annotated[float, typer.Option(
        help="prefill bucket of the paced long-prompt run, simulated tok/s (0: no paced run)")] = 1500.0,
    partial_prefills: Annotated[str, typer.Option(
        help="the server's --max-num-partial-prefills,--max-long-partial-prefills for the "
             "whole-fleet runs (fleet.toml and the simulator alike; vLLM's defaults 1,1)")] = "1,1",
    markdown: Annotated[str, typer.Option(help="also write the whole-fleet rows as markdown here")] = "",
    plot: PlotDir = "",
) -> None:
    """Dispatcher benchmarks: overhead at a large backlog and the in-bench saturation
    run, then the whole-fleet scenarios (saturation, long prompts, fairness, crash, baselines).
    ``--plot``: in flight against the cap, per-project token share and the latency per policy."""
    from fleet.bench.dispatch import dispatch_bench

    charts = Charts()

    with _redis_url(redis_url, force) as broker:
        if fleet:
            from fleet.bench.fleet.render import rows_markdown, rows_table
            from fleet.bench.fleet.suite import fleet_bench

            rows = fleet_bench(
                broker.url, speed=fleet_speed, jobs=fleet_jobs, think=think, answer=answer,
                long_jobs=long_jobs, long_tokens=long_tokens, fair_n=fair_n, crash_jobs=crash_jobs,
                only=tuple(s.strip() for s in scenarios.split(",") if s.strip()), workers=workers,
                concurrency=concurrency, lease_ttl_s=lease_ttl_s,
                paced_tokens_per_s=paced_prefill_tokens_per_s, idle_jobs=idle_jobs,
                partial_prefills=_pair(partial_prefills), charts=charts)
            console.print(rows_table(rows))
            if markdown:
                with open(markdown, "w", encoding="utf-8") as f:
                    f.write(rows_markdown(rows))
        if overhead:
            console.print(dispatch_bench(broker.url, jobs=jobs, saturation_jobs=saturation_jobs,
                                         speed=speed, with_sim=in_bench_saturation))
    _draw(charts, plot)


def _draw(charts: Charts, folder: str) -> None:
    """``--plot DIR``: the run's charts (fleet/bench/plot.py)."""
    if not folder:
        return
    from fleet.bench.plot import write_charts

    for path in write_charts(charts, folder):
        console.print(f"chart: {path}")


@bench_app.command("backends")
def backends(
    jobs: Annotated[int, typer.Option(help="backlog size")] = 1_000_000,
    count: Annotated[int, typer.Option("--backends", help="backends of the many-backend store")] = 16,
    cost: Annotated[bool, typer.Option(help="measure the store's cost of many backends")] = True,
    routing: Annotated[bool, typer.Option(help="compare routing policies on real simulators")] = True,
    sizes: Annotated[str, typer.Option(help="simulators per routing run, comma-separated")] = "2,4",
    loads: Annotated[str, typer.Option(help="loads (share of the seats), comma-separated")] = "0.5,0.9",
    policies: Annotated[str, typer.Option(help="routing policies, comma-separated")] = (
        "round_robin,least_loaded,fleet,first_token"),
    seats: Annotated[int, typer.Option(help="sequences per simulator")] = 8,
    duration: Annotated[float, typer.Option(help="seconds of load per routing run")] = 40.0,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 20.0,
    one_server: Annotated[bool, typer.Option(help="add a run on one simulator with every seat and pool")] = False,
    redis_url: RedisUrl = "",
    force: Force = False,
) -> None:
    """Several backends: admission pairs/s at a backlog with one backend against many (the
    same total room) and Redis bytes per pending job (fleet/bench/backends.py); then the routing
    policies side by side on real simulators: prefix hit rate against an oracle placement of each
    run's own requests, time to first token, output tokens/s and Jain's index (fleet/bench/routing.py)."""
    from rich.table import Table

    from fleet.bench.backends import many_backends_cost
    from fleet.bench.routing import markdown, routing_bench

    with _redis_url(redis_url, force) as broker:
        if cost:
            figures = many_backends_cost(broker.url, jobs=jobs, backends=count)
            table = Table(title="fleet bench backends: the cost of many backends")
            table.add_column("figure")
            table.add_column("value", justify="right")
            for key, value in figures.items():
                table.add_row(key, f"{value:,.2f}")
            console.print(table)
        if routing:
            runs = routing_bench(broker.url, sizes=tuple(int(x) for x in sizes.split(",")),
                                 loads=tuple(float(x) for x in loads.split(",")), seats=seats,
                                 duration_s=duration, speed=speed, policies=tuple(policies.split(",")),
                                 one_server=one_server)
            console.print(markdown(runs), markup=False, soft_wrap=True)


@bench_app.command("locality")
def locality(
    loads: Annotated[str, typer.Option(help="clients per sequence, comma-separated")] = "1.5,3",
    admissions: Annotated[int, typer.Option(help="admissions per replay (the first fifth warms up)")] = 4_000,
    deficit: Annotated[float, typer.Option(help="dlpm's fairness bound, tokens per unit of weight")] = 32_000.0,
    seeds: Annotated[str, typer.Option(help="workload seeds, comma-separated (figures averaged)")] = "1,2,3",
) -> None:
    """One backend: the prefix hit rate of the fleet's admission order against an oracle order
    (longest prefix first), and locality-aware fair scheduling (DLPM) side by side with its
    fairness and time to first token; a replay in simulated time (fleet/bench/locality.py)."""
    from fleet.bench.locality import locality_bench, markdown

    runs = locality_bench(loads=tuple(float(x) for x in loads.split(",")), admissions=admissions,
                          deficit=deficit, seeds=tuple(int(x) for x in seeds.split(",")))
    console.print(markdown(runs), markup=False, soft_wrap=True)


@bench_app.command("quota")
def quota(
    exact: Annotated[bool, typer.Option(help="run the exactness measurement on real processes")] = True,
    cost: Annotated[bool, typer.Option(help="measure admission pairs/s with quotas against without")] = True,
    clients: Annotated[int, typer.Option(help="concurrent clients per project")] = 16,
    gateways: Annotated[int, typer.Option(help="gateway processes")] = 3,
    dispatchers: Annotated[int, typer.Option(help="dispatcher processes")] = 3,
    duration: Annotated[float, typer.Option(help="seconds of load with the quotas on")] = 150.0,
    baseline: Annotated[float, typer.Option(help="seconds of load without quotas (the baseline)")] = 60.0,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 20.0,
    jobs: Annotated[int, typer.Option(help="backlog of the cost measurement")] = 100_000,
    redis_url: RedisUrl = "",
    force: Force = False,
) -> None:
    """Quotas: tokens served and reserved per minute against each project's quota with several
    gateways and dispatchers admitting at once, the unlimited project's output against a run
    without quotas, and admission pairs/s with quotas on against off (fleet/bench/quota.py)."""
    from rich.table import Table

    from fleet.bench.quota import minutes_markdown, quota_cost, quota_exactness

    with _redis_url(redis_url, force) as broker:
        if exact:
            figures = quota_exactness(broker.url, clients=clients, gateways=gateways, dispatchers=dispatchers,
                                      duration_s=duration, baseline_s=baseline, speed=speed)
            console.print(minutes_markdown(figures), markup=False, soft_wrap=True)
            for key, value in figures.items():
                if key != "minutes":
                    console.print(f"{key}: {value:,.3f}" if isinstance(value, float) else f"{key}: {value}",
                                  markup=False)
        if cost:
            table = Table(title="fleet bench quota: what quotas cost admission")
            table.add_column("figure")
            table.add_column("value", justify="right")
            for key, value in quota_cost(broker.url, jobs=jobs).items():
                table.add_row(key, f"{value:,.2f}")
            console.print(table)


@bench_app.command("cache")
def cache(
    requests: Annotated[int, typer.Option(help="request pairs (a model turn, then its repeat)")] = 40,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 20.0,
    redis_url: RedisUrl = "",
    force: Force = False,
) -> None:
    """The exact-repeat cache: a hit's end-to-end latency against the model turn it repeats,
    the model requests made and the slots used (fleet/bench/quota.py ``cache_latency``)."""
    from rich.table import Table

    from fleet.bench.quota import cache_latency

    with _redis_url(redis_url, force) as broker:
        table = Table(title="fleet bench cache: a repeat answered from the cache")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for key, value in cache_latency(broker.url, requests=requests, speed=speed).items():
            table.add_row(key, f"{value:,.2f}")
        console.print(table)


@bench_app.command("continuations")
def continuations(
    redis_url: RedisUrl = "",
    force: Force = False,
    scenarios: Annotated[str, typer.Option(help="retries, fair3, tools; comma separated")]
    = "retries,fair3,tools",
    speed: Annotated[float, typer.Option(help="simulator speed")] = 5.0,
    jobs: Annotated[int, typer.Option(help="jobs in the retries scenario (20% fail twice)")] = 300,
    think: Annotated[int, typer.Option(help="reasoning tokens of a short job (+-25%)")] = 200,
    answer: Annotated[int, typer.Option(help="answer tokens of a short job (+-25%)")] = 50,
    fair_n: Annotated[int, typer.Option(help="jobs per project in the fair3 scenario")] = 40,
    tool_jobs: Annotated[int, typer.Option(help="jobs of the 3-round tool loop")] = 1,
    markdown: Annotated[str, typer.Option(help="also write the rows as markdown here")] = "",
) -> None:
    """Continuations: retries and tool rounds give the slot up and re-enter admission
    (busy-backend ratio with 503s, idle slot-seconds, fair share with 3 attempts, tool loop)."""
    from fleet.bench.continuations import continuation_bench
    from fleet.bench.fleet.render import rows_markdown, rows_table

    with _redis_url(redis_url, force) as broker:
        rows = continuation_bench(broker.url, speed=speed, jobs=jobs, think=think, answer=answer,
                                  fair_n=fair_n, tool_jobs=tool_jobs,
                                  only=tuple(s.strip() for s in scenarios.split(",") if s.strip()))
    console.print(rows_table(rows, "fleet bench continuations"))
    if markdown:
        with open(markdown, "w", encoding="utf-8") as f:
            f.write(rows_markdown(rows))


@bench_app.command("resume")
def resume(
    jobs: Annotated[int, typer.Option(help="jobs in the backlog")] = 32,
    think: Annotated[int, typer.Option(help="reasoning tokens of each job")] = 4000,
    answer: Annotated[int, typer.Option(help="answer tokens of each job")] = 60,
    cap: Annotated[int, typer.Option(help="sequences per simulator")] = 8,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 20.0,
    gateway: Annotated[bool, typer.Option(help="gateway requests (not streamed, then streamed) instead of queue "
                                               "jobs, as many as the seats (--jobs is not used)")] = False,
) -> None:
    """A backend killed under a backlog of reasoning jobs, once with routing.continue_cut_turns
    restart and once with continue: the reasoning tokens generated again, those continued, jobs
    lost or doubled, seconds to the last envelope (fleet/bench/resume.py; each run starts its own
    Redis and fleet). --gateway: the same under gateway requests."""
    from fleet.bench.resume import gateway_bench, gateway_markdown, markdown, resume_bench

    if gateway:
        found = gateway_bench(requests=2 * cap, think=think, answer=answer, cap=cap, speed=speed)
        console.print(gateway_markdown(found), markup=False, soft_wrap=True)
        return
    runs = resume_bench(jobs=jobs, think=think, answer=answer, cap=cap, speed=speed)
    console.print(markdown(runs), markup=False, soft_wrap=True)


@bench_app.command("loops")
def loops(
    jobs: Annotated[int, typer.Option()] = 40,
    loop_share: Annotated[float, typer.Option(help="share of jobs whose reasoning loops")] = 0.2,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 40.0,
    short: Annotated[int, typer.Option(help="generated template and short capped loops replayed")] = 200,
    traces: Annotated[int, typer.Option(
        help="normal traces of the corpus read for the CPU figure, false alarms and margin (0: all)")] = 0,
    redis_url: RedisUrl = "",
    force: Force = False,
    plot: PlotDir = "",
) -> None:
    """Loop watcher on vs off in the same run: wasted tokens, OK within two attempts, CPU cost.
    ``--plot``: where the watcher cut the looping traces."""
    from fleet.bench.loops import bench_loops

    charts = Charts()
    with _redis_url(redis_url, force) as broker:
        bench_loops(jobs=jobs, loop_share=loop_share, speed=speed, redis_url=broker.url,
                    charts=charts, short=short, traces=traces)
    _draw(charts, plot)


@bench_app.command("collect")
def collect(
    jobs: Annotated[int, typer.Option()] = 30,
    sources_per_job: Annotated[int, typer.Option()] = 3,
    doc_kb: Annotated[int, typer.Option(help="size of each source document")] = 100,
    redis_url: RedisUrl = "",
    force: Force = False,
) -> None:
    """Collect + trim throughput (MB/s of text, jobs/s), exact counts vs the estimate."""
    from fleet.bench.collect import bench_collect

    with _redis_url(redis_url, force) as broker:
        bench_collect(jobs=jobs, sources_per_job=sources_per_job, doc_kb=doc_kb,
                      redis_url=broker.url)


@bench_app.command("pipeline")
def pipeline(
    infer_jobs: Annotated[int, typer.Option(help="ready inference jobs per phase")] = 200,
    heavy_jobs: Annotated[int, typer.Option(help="collect-heavy jobs in the backlog")] = 40,
    doc_kb: Annotated[int, typer.Option(help="size of each source document")] = 200,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 30.0,
    redis_url: RedisUrl = "",
    force: Force = False,
) -> None:
    """Backend utilization with and without a backlog of collect-heavy jobs (same run)."""
    from fleet.bench.pipeline import bench_pipeline

    with _redis_url(redis_url, force) as broker:
        console.print(bench_pipeline(infer_jobs=infer_jobs, heavy_jobs=heavy_jobs, doc_kb=doc_kb,
                                     speed=speed, redis_url=broker.url))


@bench_app.command("loss")
def loss(
    configs: Annotated[str, typer.Option(help="Redis configurations: aof, none")] = "aof,none",
    jobs: Annotated[int, typer.Option(help="jobs submitted before the crash")] = 200,
    crash_after: Annotated[int, typer.Option(help="kill -9 Redis once this many have results")] = 60,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 20.0,
    settle_s: Annotated[float, typer.Option(help="how long survivors may take to finish")] = 180.0,
    markdown: Annotated[str, typer.Option(help="also write the rows as markdown here")] = "",
    redis_url: RedisUrl = "",
) -> None:
    """What a kill -9 of Redis mid-batch loses, with AOF everysec and without persistence."""
    from fleet.bench.loss import loss_bench, rows_markdown

    _own_redis_only("loss", redis_url)
    rows = loss_bench(configs=[c.strip() for c in configs.split(",") if c.strip()], jobs=jobs,
                      crash_after=crash_after, speed=speed, settle_s=settle_s)
    text = rows_markdown(rows)
    console.print(text, markup=False)
    if markdown:
        with open(markdown, "w", encoding="utf-8") as f:
            f.write(text)


@bench_app.command("gateway")
def gateway(
    requests: Annotated[int, typer.Option(help="sequential requests per path (idle fleet)")] = 200,
    clients: Annotated[int, typer.Option(help="concurrent streaming clients through the gateway")] = 200,
    cap: Annotated[int, typer.Option(help="backend.max_num_seqs of the fleet")] = 32,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 20.0,
    think: Annotated[int, typer.Option(help="reasoning tokens per request")] = 40,
    answer: Annotated[int, typer.Option(help="answer tokens per request")] = 20,
    disconnects: Annotated[int, typer.Option(help="streaming clients that hang up (time to a free slot)")] = 20,
    estimate_prompts: Annotated[bool, typer.Option(help="gateway.exact_prompt_count = false")] = False,
    litellm: Annotated[str | None, typer.Option(help="a litellm executable: its proxy as a peer path")] = None,
    redis_url: RedisUrl = "",
    force: Force = False,
) -> None:
    """Latency the gateway adds next to the same requests straight to the simulator (and LiteLLM's
    proxy's, given one); the time a hung-up stream's slot takes to be free; many concurrent
    streams at the cap (backend never over it, gateway CPU per 1,000 tokens)."""
    from fleet.bench.gateway import bench_gateway

    with _redis_url(redis_url, force) as broker:
        table, crowd = bench_gateway(broker.url, requests, clients, cap, speed, think, answer,
                                     disconnects=disconnects, exact_count=not estimate_prompts,
                                     litellm=litellm)
    console.print(table)
    console.print(crowd)


@bench_app.command("chaos")
def chaos(
    rounds: Annotated[str, typer.Option(help="rounds, comma separated, or all (fleet/bench/chaos.py)")] = "all",
    jobs: Annotated[int, typer.Option(help="jobs per round")] = 80,
    cap: Annotated[int, typer.Option(help="backend.max_num_seqs of each round's fleet")] = 8,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 20.0,
    think: Annotated[int, typer.Option(help="reasoning tokens of a job (+-25%)")] = 300,
    answer: Annotated[int, typer.Option(help="answer tokens of a job (+-25%)")] = 30,
    kills: Annotated[int, typer.Option(help="kill -9s in the storm round")] = 6,
    stall_s: Annotated[float, typer.Option(help="a round ends when nothing finished for this long")] = 30.0,
    markdown: Annotated[str, typer.Option(help="also write the tables as markdown here")] = "",
    redis_url: RedisUrl = "",
) -> None:
    """Faults an operator meets (kill storm, Redis restarts with and without AOF, Sentinel
    failover, backend faults and death, a backend killed under queue jobs and gateway streams),
    each on a fleet and Redis of its own: jobs, envelopes, missing, doubled, max in flight vs cap,
    time back to a full backend, process exits, RSS, and what the gateway's clients saw."""
    from rich.table import Table

    from fleet.bench.chaos import COLUMNS, GATEWAY_COLUMNS, ROUNDS, chaos_bench, gateway_rows, row_of, rss_rows
    from fleet.bench.chaos import markdown as to_markdown

    _own_redis_only("chaos", redis_url)
    def show(result) -> None:  # type: ignore[no-untyped-def]
        logs = f"; logs in {result.logs}" if result.logs else ""
        console.print(f"{result.name}: {result.verdict()} ({result.seconds:.0f} s){logs}")

    chosen = list(ROUNDS) if rounds == "all" else [r.strip() for r in rounds.split(",") if r.strip()]
    results = chaos_bench(chosen, jobs=jobs, cap=cap,
                          speed=speed, think=think, answer=answer, kills=kills, stall_s=stall_s,
                          on_result=show)
    table = Table(title="fleet bench chaos")
    for column in COLUMNS:
        table.add_column(column)
    for result in results:
        table.add_row(*row_of(result))
    console.print(table)
    rss = Table(title="RSS per process, MB (first / max / last)")
    for column in ("round", "process", "RSS MB"):
        rss.add_column(column)
    for row in rss_rows(results):
        rss.add_row(*row)
    console.print(rss)
    gateway = gateway_rows(results)
    if gateway:
        streams = Table(title="gateway clients (streamed requests through the fault)")
        for column in GATEWAY_COLUMNS:
            streams.add_column(column)
        for row in gateway:
            streams.add_row(*row)
        console.print(streams)
    if markdown:
        Path(markdown).write_text(to_markdown(results), encoding="utf-8")
