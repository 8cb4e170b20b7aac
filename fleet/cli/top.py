"""``fleet top``: a live view of the whole fleet, read from Redis once a second.

One frame shows in flight against the cap (and long prompts, reserved KV), per project the jobs
waiting for admission, the mean queue wait and the tokens per second of the jobs and gateway
requests that finished in the last ``WINDOW_S`` seconds (read from the projects' results streams
and their gateway results streams, so it covers every worker and every gateway),
admission holds by reason (since the previous frame when live, totals with ``--once``), each
project's quota windows against its limits and the admission calls its quota held it (same
counting), the
backend as the dispatchers last scraped it (running, waiting, KV usage, preemptions) and the live
inference workers by node name (fleet/worker/heartbeat.py).

Everything comes from the shared store, so any host that reaches Redis sees the same figures
whichever dispatchers and workers run; nothing is asked of the processes themselves.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from fleet.cli.outage import Outage
from fleet.cli.queues import backend_line, quota_cell, quota_holds
from fleet.core.config import Settings
from fleet.core.keys import Keys
from fleet.core.redisconn import UNREACHABLE
from fleet.worker.heartbeat import live_worker_names, shown_workers
from schedulers.store import make_store
from schedulers.store.base import StoreSnapshot

WINDOW_S = 60.0
MAX_RECENT = 2_000  # envelopes read per project and frame: bounds the cost of a busy minute


@dataclass
class ProjectRow:
    project: str
    pending: int = 0
    finished: int = 0
    mean_wait_s: float | None = None
    tokens_per_s: float = 0.0
    quota: str = "-"  # its windows against its limits (fleet queues' quota_cell)
    quota_held: int = 0  # admission calls that passed it over for its quota (since the last frame)
    quota_held_total: int = 0
    # deferred until a not-before time: continuations in backoff, repeats of a job running now
    # (the exact-repeat cache), turns their API key's quota holds
    waiting: int = 0


@dataclass
class TopFrame:
    at: float
    snapshot: StoreSnapshot
    cap: int
    max_long: int
    kv_budget_tokens: int
    backend: dict[str, str]
    rows: list[ProjectRow] = field(default_factory=list)
    holds: dict[str, int] = field(default_factory=dict)  # since the previous frame, or totals
    workers: list[str] = field(default_factory=list)  # node names of the live inference workers
    backend_lines: list[str] = field(default_factory=list)  # with several backends: one each


def read_frame(settings: Settings, client: redis.Redis, now: float,
               previous: TopFrame | None = None) -> TopFrame:
    store = make_store(settings, client)
    snap, limits = store.snapshot(), store.config.limits
    keys = Keys(settings.key_prefix)
    rows = [_project_row(client, keys, p, snap, now)
            for p in sorted(set(snap.pending) | set(settings.projects))]
    quota_held, deferred = quota_holds(client, settings), store.deferred_counts()
    for row in rows:
        row.waiting = deferred.get(row.project, 0)
        row.quota = quota_cell(store, row.project, now)
        row.quota_held = quota_held.get(row.project, 0)
        if previous is not None:
            row.quota_held -= next((r.quota_held_total for r in previous.rows if r.project == row.project), 0)
        row.quota_held_total = quota_held.get(row.project, 0)
    holds = dict(snap.holds)
    if previous is not None:
        holds = {r: n - previous.snapshot.holds.get(r, 0) for r, n in snap.holds.items()}
        holds = {r: n for r, n in holds.items() if n > 0}
    return TopFrame(at=now, snapshot=snap, cap=limits.max_num_seqs, max_long=limits.max_long,
                    kv_budget_tokens=limits.kv_budget_tokens, backend=store.backend(), rows=rows,
                    holds=holds, workers=live_worker_names(client, keys),
                    backend_lines=[backend_line(store, snap, entry.name) for entry in store.config.backends]
                    if len(store.config.backends) > 1 else [])


def _project_row(client: redis.Redis, keys: Keys, project: str, snap: StoreSnapshot,
                 now: float) -> ProjectRow:
    row = ProjectRow(project, pending=sum(snap.pending.get(project, {}).values()))
    since_ms = int((now - WINDOW_S) * 1000)
    entries: list[Any] = []
    # Queued jobs' envelopes and the gateway's requests' are kept in two streams (consumer groups
    # read only the first); both count here.
    for stream in (keys.results(project), keys.gateway_results(project)):
        found: Any = client.xrevrange(stream, max="+", min=since_ms, count=MAX_RECENT)
        entries += found
    waits, tokens = [], 0
    for _id, fields in entries:
        try:
            envelope = json.loads(fields[b"envelope"])
        except (KeyError, ValueError):
            continue  # not an envelope this version wrote: leave it out of the figures
        tokens += int(envelope.get("usage", {}).get("completion_tokens", 0))
        queued = envelope.get("timings", {}).get("queued_s")
        if queued is not None:
            waits.append(float(queued))
        row.finished += 1
    row.tokens_per_s = tokens / WINDOW_S
    row.mean_wait_s = sum(waits) / len(waits) if waits else None
    return row


def render(frame: TopFrame, live: bool) -> Group:
    snap, b = frame.snapshot, frame.backend
    head = Text.assemble(
        ("in flight ", "bold"), f"{snap.in_flight}/{frame.cap}",
        ("   long ", "bold"), f"{snap.long_in_flight}/{frame.max_long}",
        ("   KV reserved ", "bold"), f"{snap.reserved_kv_tokens:,}/{frame.kv_budget_tokens:,}",
        ("   admissions ", "bold"), str(snap.admissions),
    )
    table = Table(title=f"projects (finished in the last {WINDOW_S:g} s)")
    quotas = any(r.quota != "-" for r in frame.rows)
    columns = ["project", "pending", "finished", "mean wait s", "tokens/s"] + (["quota"] if quotas else []) + [
        "waiting"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("project", "quota") else "right")
    for r in frame.rows:
        wait = "-" if r.mean_wait_s is None else f"{r.mean_wait_s:.1f}"
        cells = [r.project, str(r.pending), str(r.finished), wait, f"{r.tokens_per_s:.1f}"]
        if quotas:
            cells.append(r.quota + (f" (held {r.quota_held}x)" if r.quota_held > 0 else ""))
        cells.append(str(r.waiting))
        table.add_row(*cells)
    label = "holds since the last frame" if live else "holds (totals)"
    holds = ", ".join(f"{reason}={n}" for reason, n in sorted(frame.holds.items())) or "-"
    gate = b.get("hold") or ("open" if b else "no scrape yet")
    backend = Text.assemble(
        ("backend ", "bold"), f"gate {gate}, running {b.get('running', '?')}, ",
        f"waiting {b.get('waiting', '?')}, KV {_percent(b.get('kv_usage'))}, ",
        f"preemptions {b.get('preemptions', '?')}",
    )
    workers = Text.assemble(("inference workers ", "bold"), shown_workers(frame.workers))
    backends = [Text(line) for line in frame.backend_lines] or [backend]
    return Group(head, table, Text.assemble((label + ": ", "bold"), holds), *backends, workers)


def _percent(value: str | None) -> str:
    try:
        return f"{float(value or ''):.0%}"
    except ValueError:
        return "?"


def run_top(settings: Settings, client: redis.Redis, console: Console, once: bool,
            every_s: float = 1.0, clock: Callable[[], float] = time.time) -> None:
    """Print one frame (``once``) or refresh one every ``every_s`` until interrupted. The live
    view rides out a broker that stops answering (fleet/cli/outage.py): the last frame stays,
    under a line saying since when the broker is away, until it is back."""
    if once:
        console.print(render(read_frame(settings, client, clock()), live=False))
        return
    outage = Outage()
    frame: TopFrame | None = None
    # Ctrl-C is how a live view ends
    with contextlib.suppress(KeyboardInterrupt), \
            Live(Text("reading the broker ..."), console=console, refresh_per_second=4) as view:
        while True:
            try:
                frame = read_frame(settings, client, clock(), frame)
                outage.answered()
                view.update(render(frame, live=True))
            except UNREACHABLE:
                outage.failed()
                notice = Text(outage.down_text(), style="bold red")
                view.update(Group(render(frame, live=True), notice) if frame else notice)
            time.sleep(every_s)
