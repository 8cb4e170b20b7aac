"""Rows and how they are shown: a whole-fleet bench returns rows of scenario / figure / value /
target / verdict; ``rows_table`` prints them (rich), ``rows_markdown`` writes them as one
markdown table per scenario (for docs/performance.md). The cell formatters keep every scenario's
numbers alike."""

from __future__ import annotations

import math
from typing import Any

from fleet.bench.measure import percentile

Row = tuple[str, str, str, str, str]  # scenario, figure, value, target, verdict


def fmt(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def verdict(ok: bool | None, shortfall: str = "") -> str:
    if ok is None:
        return ""
    return "met" if ok else f"NOT met{': ' + shortfall if shortfall else ''}"


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (measure.percentile), ``nan`` for a run that produced none."""
    return percentile(values, q, default=math.nan)


def latency_cell(lat: dict[str, list[float]]) -> str:
    return (
        f"service p50 {fmt(pct(lat['service'], 50))} / p95 {fmt(pct(lat['service'], 95))} s; "
        f"e2e p95 {fmt(pct(lat['e2e'], 95))} s"
    )


def cpu_cell(figures: dict[str, float]) -> str:
    return ", ".join(f"{k.replace(' CPU %', '')} {v:.0f}%" for k, v in figures.items())


def rows_table(rows: list[Row], title: str = "fleet bench dispatch --fleet") -> Any:
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in ("scenario", "figure", "value", "target", "verdict"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def rows_markdown(rows: list[Row]) -> str:
    """The rows as markdown tables, one per scenario (for docs/performance.md)."""
    out: list[str] = []
    current = None
    for scenario, figure, value, target, outcome in rows:
        if scenario != current:
            out += ["", f"#### {scenario}", "", "| figure | value | target | verdict |", "|---|---|---|---|"]
            current = scenario
        cells = [c.replace("|", "/") for c in (figure, value, target, outcome)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
