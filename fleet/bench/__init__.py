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
    from fleet.embedded import ensure_broker  # noqa: PLC0415

    return ensure_broker(url)


@bench_app.command("sim")
def sim(
    speed: Annotated[float, typer.Option(help="simulator speed for the main run")] = 20.0,
    duration_s: Annotated[float, typer.Option(help="measuring window per level, real s")] = 3.0,
    with_speed_1: Annotated[bool, typer.Option(help="also run at --speed 1")] = True,
) -> None:
    """Simulator throughput at concurrency 1-32 next to BRIEF.md's measured figures."""
    from fleet.bench.sim import bench_sim  # noqa: PLC0415

    bench_sim(speed, duration_s, with_speed_1, console=console)


@bench_app.command("dispatch")
def dispatch(
    jobs: Annotated[int, typer.Option(help="backlog size for the overhead figures")] = 100_000,
    saturation_jobs: Annotated[int, typer.Option(help="jobs in the saturation run")] = 400,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 50.0,
    redis_url: Annotated[str, typer.Option(help="Redis for the bench keys")] = BENCH_REDIS,
) -> None:
    """Dispatcher: admission overhead at a large backlog, saturation against `fleet sim`."""
    from fleet.bench.dispatch import dispatch_bench  # noqa: PLC0415

    with _redis_url(redis_url) as broker:
        console.print(dispatch_bench(broker.url, jobs=jobs, saturation_jobs=saturation_jobs,
                                     speed=speed))


@bench_app.command("loops")
def loops(
    jobs: Annotated[int, typer.Option()] = 40,
    loop_share: Annotated[float, typer.Option(help="share of jobs whose reasoning loops")] = 0.2,
    speed: Annotated[float, typer.Option(help="simulator speed")] = 40.0,
    redis_url: Annotated[str, typer.Option(help="Redis for the bench keys")] = BENCH_REDIS,
) -> None:
    """Loop watcher on vs off in the same run: wasted tokens, OK within two attempts, CPU cost."""
    from fleet.bench.loops import bench_loops  # noqa: PLC0415

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
    from fleet.bench.collect import bench_collect  # noqa: PLC0415

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
    from fleet.bench.pipeline import bench_pipeline  # noqa: PLC0415

    with _redis_url(redis_url) as broker:
        console.print(bench_pipeline(infer_jobs=infer_jobs, heavy_jobs=heavy_jobs, doc_kb=doc_kb,
                                     speed=speed, redis_url=broker.url))
