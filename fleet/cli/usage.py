"""``fleet usage``: the usage ledger (fleet/core/usage.py) as a table, JSON or CSV.

Rows by ``--by``: ``hour`` or ``day`` (UTC; one row per period, empty ones left out), ``key``
(gateway API keys by the start of their digest, ``queue`` for queue jobs) or ``model``, each
over the last ``--days`` (default 1) for one ``--project`` or every configured one. The figures
are the ledger's own: requests (model turns), prompt, cached prompt, reasoning and answer
tokens, turns cut before vLLM's usage chunk, loop cuts and their tokens, tool rounds, and the
turns by message code.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from rich.table import Table

from fleet.core.errors import InputInvalid
from fleet.core.usage import METRICS, HourCounts, UsageLedger
from fleet.core.usagereport import BUCKET_WIDTHS_S, Group, buckets, group_cells

BY = ("hour", "day", "key", "model")
COLUMNS = ("project", "period", "key", "model", *METRICS, "codes")


def usage_rows(ledger: UsageLedger, projects: Iterable[str], by: str, days: float,
               now: float | None = None) -> list[dict[str, Any]]:
    """One dict per row (``COLUMNS``), projects in order, then periods or groups."""
    if by not in BY:
        raise InputInvalid(f"--by must be one of {', '.join(BY)}, not {by!r}")
    if days <= 0:
        raise InputInvalid("--days must be more than 0")
    end = int(now if now is not None else time.time()) // 3600 * 3600 + 3600
    start = int(end - days * 86_400)
    rows: list[dict[str, Any]] = []
    for project in projects:
        cells = ledger.read(project, start, end)
        rows += _project_rows(project, cells, by, start, end)
    return rows


def _project_rows(project: str, cells: list[HourCounts], by: str, start: int,
                  end: int) -> list[dict[str, Any]]:
    if by in ("key", "model"):
        period = f"{_stamp(start)}..{_stamp(end)}"
        return [_row(project, period, group) for group in group_cells(cells, [by])]
    width = BUCKET_WIDTHS_S["1h" if by == "hour" else "1d"]
    rows = []
    for bucket in buckets(cells, start, end, width):
        rows += [_row(project, _stamp(bucket.start), group) for group in bucket.groups]
    return rows


def _stamp(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%MZ")


def _row(project: str, period: str, group: Group) -> dict[str, Any]:
    row: dict[str, Any] = {"project": project, "period": period,
                           "key": group.key or "*", "model": group.model or "*"}
    row.update({name: group.metric(name) for name in METRICS})
    row["codes"] = group.codes
    return row


def render_table(rows: list[dict[str, Any]], by: str) -> Table:
    table = Table(title=f"Usage by {by}")
    shown = [c for c in COLUMNS if c not in {"hour": ("key", "model"), "day": ("key", "model"),
                                             "key": ("model",), "model": ("key",)}[by]]
    for column in shown:
        table.add_column(column.replace("_tokens", "").replace("_", " "),
                         justify="left" if column in ("project", "period", "key", "model", "codes")
                         else "right")
    for row in rows:
        cells = [" ".join(f"{c}:{n}" for c, n in row["codes"].items()) if c == "codes" else str(row[c])
                 for c in shown]
        table.add_row(*cells)
    return table


def render_json(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, indent=2)


def render_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([";".join(f"{c}={n}" for c, n in row["codes"].items()) if c == "codes"
                         else row[c] for c in COLUMNS])
    return out.getvalue()
