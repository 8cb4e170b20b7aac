"""Running a batch file through a ``Client`` with a live progress bar (``fleet batch``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fleet.client import Client
from fleet.core.batchfile import ResultMatcher, jsonl_lines, output_line, parse_lines
from fleet.core.errors import FleetError
from fleet.core.results import ResultFollower


def _counts_text(counts: Counter[str]) -> str:
    return " ".join(f"{code}={n}" for code, n in sorted(counts.items())) or "waiting"


def run_batch(client: Client, file: Path, project: str, *, wait: bool, out: Path | None,
              timeout_s: float, console: Console) -> int:
    lines = parse_lines(jsonl_lines(file.read_bytes().decode("utf-8")), project)
    follower = ResultFollower(client.results, {project})
    job_of: dict[int, str] = {}  # line number -> job id (two lines may share an idempotency key)
    for line in lines:
        if line.job is None:
            continue
        try:
            job_of[line.number] = client.submit(line.job)
        except FleetError as exc:
            line.error = f"line {line.number}: {exc.message}"
    console.print(f"submitted {len(job_of)} of {len(lines)} lines to project {project}")
    if not wait:
        for line in lines:
            if line.number in job_of:
                console.print(f"{line.custom_id}\t{job_of[line.number]}")
        return 0 if len(job_of) == len(lines) else 1
    matcher = ResultMatcher(job_of)
    counts: Counter[str] = Counter("E_INPUT_INVALID" for line in lines if line.job is None or line.error)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(_counts_text(counts), total=len(lines), completed=sum(counts.values()))
        for envelope in follower.follow({client.ref(i) for i in job_of.values()}, timeout_s):
            done = matcher.add(envelope)
            counts[envelope.code.value] += done
            progress.update(task, advance=done, description=_counts_text(counts))
    model = client.settings.backend.model
    rows = [output_line(line, matcher.envelope_for(line), model) for line in lines]
    if out is not None:
        out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
                       encoding="utf-8")
        console.print(f"wrote {len(rows)} lines to {out}")
    console.print(_counts_text(Counter(row["code"] for row in rows)))
    return 0 if all(row["code"].startswith("OK") for row in rows) else 1
