"""``fleet bench ... --plot DIR`` (fleet/bench/plot.py): a short real run of each bench that draws
charts writes them as valid PNG files with something drawn on them, and only the charts its run
has the series of."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

pytestmark = pytest.mark.slow

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_bench(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    done = subprocess.run([sys.executable, "-m", "fleet", "bench", *args, "--plot", str(tmp / "charts")],
                          env=env, capture_output=True, text=True, timeout=170, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def assert_drawn(path: Path) -> None:
    """A PNG that decodes, of a chart's size, with more than a blank page on it."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.width >= 400 and image.height >= 300
        colours = image.convert("RGB").getcolors(maxcolors=1_000_000)
        assert colours is not None and len(colours) > 50  # lines, labels and legend, not one fill


def test_dispatch_plot_writes_the_cap_share_and_latency_charts(tmp_path: Path) -> None:
    done = run_bench(["dispatch", "--no-overhead", "--scenarios", "saturation,fairness", "--fleet-jobs", "16",
                      "--fair-n", "2", "--workers", "1", "--concurrency", "8", "--fleet-speed", "50"], tmp_path)
    charts = tmp_path / "charts"
    assert sorted(p.name for p in charts.iterdir()) == ["inflight.png", "latency.png", "token_share.png"]
    for path in charts.iterdir():
        assert_drawn(path)
        assert f"chart: {path}" in done.stdout.replace("\n", "")


def test_loops_plot_writes_the_cut_point_chart(tmp_path: Path) -> None:
    run_bench(["loops", "--jobs", "2", "--short", "10", "--traces", "10"], tmp_path)
    charts = tmp_path / "charts"
    assert [p.name for p in charts.iterdir()] == ["loop_cuts.png"]
    assert_drawn(charts / "loop_cuts.png")
