"""The throughput benchmark, shortened: two concurrency levels at high speed."""

from __future__ import annotations

import io

from rich.console import Console

from fleet.bench.sim import bench_sim


def test_bench_sim_matches_the_deployments_curve() -> None:
    out = io.StringIO()
    rows = bench_sim(speed=50.0, duration_s=1.0, with_speed_1=False, concurrencies=(1, 8),
                     console=Console(file=out, width=120))
    assert [r.concurrency for r in rows] == [1, 8]
    for row in rows:
        assert 0.9 < row.client_ratio < 1.1
        assert 0.98 < row.server_ratio < 1.02
    assert "deployment" in out.getvalue()
