"""Benchmarks of the fleet and its simulator (``fleet bench <name>``). Every figure is reported
next to a baseline measured in the same run; nothing here is a pass/fail test.

Each module exposes a plain function returning rows (or a rich table); this package only wires
them to the CLI, starting a private Redis when none answers."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

bench_app = typer.Typer(no_args_is_help=True)
console = Console()
BENCH_REDIS = "redis://127.0.0.1:6379/15"


def _redis_url(url: str):  # type: ignore[no-untyped-def]
    from fleet.local.embedded import ensure_broker

    return ensure_broker(url)


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
    redis_url: Annotated[str, typer.Option(help="Redis for the bench keys")] = BENCH_REDIS,
    overhead: Annotated[bool, typer.Option(help="run the dispatcher-only overhead figures")] = True,
    in_bench_saturation: Annotated[bool, typer.Option(
        help="with the overhead figures, also the in-bench saturation run against fleet sim")] = True,
    fleet: Annotated[bool, typer.Option(help="run the whole-fleet scenarios (real processes)")] = True,
    scenarios: Annotated[str, typer.Option(help="whole-fleet scenarios, comma separated")]
    = "fairness,saturation,long,crash,idle",
    fleet_speed: Annotated[float, typer.Option(help="simulator speed of the whole-fleet runs")] = 5.0,
    fleet_jobs: Annotated[int, typer.Option(help="short jobs in the saturation scenario")] = 2000,
    think: Annotated[int, typer.Option(help="reasoning tokens of a short job (+-25%)")] = 200,
    answer: Annotated[int, typer.Option(help="answer tokens of a short job (+-25%)")] = 50,
    long_jobs: Annotated[int, typer.Option(help="jobs in the long-prompt scenario (10% long)")] = 200,
    long_tokens: Annotated[int, typer.Option(help="prompt tokens of a long job")] = 60_000,
    fair_n: Annotated[int, typer.Option(help="jobs per small project; the big one sends 10x")] = 100,
    crash_jobs: Annotated[int, typer.Option(help="jobs in the crash scenario")] = 400,
    workers: Annotated[int, typer.Option(help="Celery workers (processes)")] = 2,
    concurrency: Annotated[int, typer.Option(help="threads per Celery worker")] = 32,
    lease_ttl_s: Annotated[float, typer.Option(help="lease TTL of the whole-fleet runs")] = 5.0,
    idle_jobs: Annotated[int, typer.Option(help="jobs one at a time in the idle scenario")] = 100,
    paced_prefill_tokens_per_s: Annotated[float, typer.Option(
        help="prefill bucket of the paced long-prompt run, simulated tok/s")] = 1500.0,
    markdown: Annotated[str, typer.Option(help="also write the whole-fleet rows as markdown here")] = "",
) -> None:
    """Dispatcher benchmarks: overhead at a large backlog and the in-bench saturation
    run, then the whole-fleet scenarios (saturation, long prompts, fairness, crash, baselines)."""
    from fleet.bench.dispatch import dispatch_bench

    with _redis_url(redis_url) as broker:
        if fleet:
            from fleet.bench.fleetbench import fleet_bench, rows_markdown, rows_table

            rows = fleet_bench(
                broker.url, speed=fleet_speed, jobs=fleet_jobs, think=think, answer=answer,
                long_jobs=long_jobs, long_tokens=long_tokens, fair_n=fair_n, crash_jobs=crash_jobs,
                only=tuple(s.strip() for s in scenarios.split(",") if s.strip()), workers=workers,
                concurrency=concurrency, lease_ttl_s=lease_ttl_s,
                paced_tokens_per_s=paced_prefill_tokens_per_s, idle_jobs=idle_jobs)
            console.print(rows_table(rows))
            if markdown:
                with open(markdown, "w", encoding="utf-8") as f:
                    f.write(rows_markdown(rows))
        if overhead:
            console.print(dispatch_bench(broker.url, jobs=jobs, saturation_jobs=saturation_jobs,
                                         speed=speed, with_sim=in_bench_saturation))


@bench_app.command("loops")
def loops(
    jobs: Annotated[int, typer.Option()] = 40,
    loop_share: Annotated[float, typer.Option(help="share of jobs whose reasoning loops")] = 0.2,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 40.0,
    redis_url: Annotated[str, typer.Option(help="Redis for the bench keys")] = BENCH_REDIS,
) -> None:
    """Loop watcher on vs off in the same run: wasted tokens, OK within two attempts, CPU cost."""
    from fleet.bench.loops import bench_loops

    with _redis_url(redis_url) as broker:
        bench_loops(jobs=jobs, loop_share=loop_share, speed=speed, redis_url=broker.url)


@bench_app.command("collect")
def collect(
    jobs: Annotated[int, typer.Option()] = 30,
    sources_per_job: Annotated[int, typer.Option()] = 3,
    doc_kb: Annotated[int, typer.Option(help="size of each source document")] = 100,
    redis_url: Annotated[str, typer.Option(help="Redis for the token cache")] = BENCH_REDIS,
) -> None:
    """Collect + trim throughput (MB/s of text, jobs/s), exact counts vs the estimate."""
    from fleet.bench.collect import bench_collect

    with _redis_url(redis_url) as broker:
        bench_collect(jobs=jobs, sources_per_job=sources_per_job, doc_kb=doc_kb,
                      redis_url=broker.url)


@bench_app.command("pipeline")
def pipeline(
    infer_jobs: Annotated[int, typer.Option(help="ready inference jobs per phase")] = 200,
    heavy_jobs: Annotated[int, typer.Option(help="collect-heavy jobs in the backlog")] = 40,
    doc_kb: Annotated[int, typer.Option(help="size of each source document")] = 200,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 30.0,
    redis_url: Annotated[str, typer.Option(help="Redis for the fleet")] = BENCH_REDIS,
) -> None:
    """Backend utilization with and without a backlog of collect-heavy jobs (same run)."""
    from fleet.bench.pipeline import bench_pipeline

    with _redis_url(redis_url) as broker:
        console.print(bench_pipeline(infer_jobs=infer_jobs, heavy_jobs=heavy_jobs, doc_kb=doc_kb,
                                     speed=speed, redis_url=broker.url))


@bench_app.command("gateway")
def gateway(
    requests: Annotated[int, typer.Option(help="sequential requests per path (idle fleet)")] = 200,
    clients: Annotated[int, typer.Option(help="concurrent streaming clients through the gateway")] = 200,
    cap: Annotated[int, typer.Option(help="backend.max_num_seqs of the fleet")] = 32,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 20.0,
    think: Annotated[int, typer.Option(help="reasoning tokens per request")] = 40,
    answer: Annotated[int, typer.Option(help="answer tokens per request")] = 20,
    redis_url: Annotated[str, typer.Option(help="Redis for the fleet")] = BENCH_REDIS,
) -> None:
    """Latency the gateway adds next to the same requests straight to the simulator; many
    concurrent streams at the cap (backend never over it, gateway CPU per 1,000 tokens)."""
    from fleet.bench.gateway import bench_gateway

    with _redis_url(redis_url) as broker:
        table, crowd = bench_gateway(broker.url, requests, clients, cap, speed, think, answer)
    console.print(table)
    console.print(crowd)
