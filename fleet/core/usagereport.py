"""The usage ledger's cells (fleet/core/usage.py) summed into what a reader asks for: time buckets
of an hour or a day, each split by API key and/or model, as ``fleet usage`` and the gateway's
usage endpoint show them. Pure functions: the ledger reads, these add up."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fleet.core.usage import METRICS, HourCounts

BUCKET_WIDTHS_S = {"1h": 3600, "1d": 86_400}
GROUPS = ("key", "model")


@dataclass
class Group:
    key: str | None  # None: not split by key
    model: str | None
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def codes(self) -> dict[str, int]:
        return {name[5:]: n for name, n in sorted(self.counts.items()) if name.startswith("code:")}

    def metric(self, name: str) -> int:
        return self.counts.get(name, 0)


@dataclass
class Bucket:
    start: int
    end: int
    groups: list[Group]


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for name, value in counts.items():
        into[name] = into.get(name, 0) + value


def group_cells(cells: Iterable[HourCounts], group_by: Sequence[str]) -> list[Group]:
    """The cells summed per (key, model) as ``group_by`` asks (neither: one group)."""
    groups: dict[tuple[str | None, str | None], Group] = {}
    for cell in cells:
        pair = (cell.key if "key" in group_by else None, cell.model if "model" in group_by else None)
        group = groups.setdefault(pair, Group(*pair))
        _add(group.counts, cell.counts)
    return [groups[pair] for pair in sorted(groups, key=lambda p: (p[0] or "", p[1] or ""))]


def buckets(cells: Iterable[HourCounts], start: int, end: int, width_s: int,
            group_by: Sequence[str] = ()) -> list[Bucket]:
    """Every bucket of ``width_s`` from ``start`` (aligned down to the width, UTC) until ``end``,
    empty ones included, each with its groups."""
    first = start - start % width_s
    by_start: dict[int, list[HourCounts]] = {}
    for cell in cells:
        if start - start % 3600 <= cell.start < end:
            by_start.setdefault(cell.start - cell.start % width_s, []).append(cell)
    return [Bucket(s, s + width_s, group_cells(by_start.get(s, []), group_by))
            for s in range(first, end, width_s)]


def totals(cells: Iterable[HourCounts]) -> dict[str, int]:
    summed: dict[str, int] = dict.fromkeys(METRICS, 0)
    for cell in cells:
        _add(summed, cell.counts)
    return summed
