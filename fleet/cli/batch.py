"""Running a batch file through a ``Client`` with a live progress bar (``fleet batch``).

Order of work: the project is checked before the file is read; a file whose ``custom_id``s are not
unique is refused whole (results are matched by it); each line gets a job id of its own derived
from the file and its custom_id (fleet/core/batchfile.py), so the same file always names the same
jobs. A file that cannot be read or is not UTF-8 text is E_INPUT_INVALID naming it.

``--out`` is written as results arrive, one line each, flushed at once: a client that dies keeps
everything it received. ``--resume`` appends to an existing ``--out``: lines already in it are
skipped, the others are submitted again (a job the fleet already has is not sent twice: same id)
and collected. ``--collect`` submits nothing and collects the lines not yet in ``--out`` (a job the
fleet does not know is an E_NOT_FOUND line). A broker that does not answer is ridden out by the
client (``Client.retry_s``) and the results follower; if it stays away, the command stops with one
E_BROKER_UNAVAILABLE line and ``--resume`` picks up from there. A line refused (not a job, or
refused by the fleet) is an error line in ``--out``; without ``--out`` its reason goes to stderr,
one line each: ``line N (custom_id X): CODE message``. Lines still without a result when
``--timeout`` passes are counted, not written: collect them later with ``--collect``.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fleet.client import Client
from fleet.core.batchfile import (
    BatchLine,
    ResultMatcher,
    batch_tag,
    duplicate_custom_ids,
    jsonl_lines,
    output_line,
    parse_lines,
)
from fleet.core.codes import Code
from fleet.core.errors import BrokerUnavailable, FleetError, InputInvalid
from fleet.core.keys import job_ref
from fleet.core.models import Envelope
from fleet.core.results import ResultFollower


def _counts_text(counts: Counter[str]) -> str:
    return " ".join(f"{code}={n}" for code, n in sorted(counts.items())) or "waiting"


def answered_ids(out: Path | None) -> set[str]:
    """custom_ids an earlier run already wrote to ``out``."""
    if out is None or not out.exists():
        return set()
    rows = (json.loads(text) for text in jsonl_lines(out.read_text(encoding="utf-8")) if text.strip())
    return {str(row.get("custom_id")) for row in rows}


def read_input(path: Path) -> bytes:
    """An input file's bytes; one that cannot be read (missing, a directory, no permission) is
    E_INPUT_INVALID naming it, never an OSError a caller could take for the broker's."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputInvalid(f"cannot read {path}: {exc.strerror or type(exc).__name__}") from exc


def input_text(path: Path, content: bytes) -> str:
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputInvalid(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


class Output:
    """Result lines to ``out`` (appended when resuming), each flushed as it is written. Without
    ``out``, a refused line's reason goes to stderr: nobody would learn it otherwise."""

    def __init__(self, out: Path | None, append: bool) -> None:
        self.stream: IO[str] | None = (
            out.open("a" if append else "w", encoding="utf-8") if out is not None else None)
        self.counts: Counter[str] = Counter()

    def write(self, row: dict[str, Any]) -> None:
        self.counts[row["code"]] += 1
        if self.stream is not None:
            self.stream.write(json.dumps(row, ensure_ascii=False) + "\n")
            self.stream.flush()

    def refused(self, line: BatchLine, model: str) -> None:
        self.write(output_line(line, None, model))
        if self.stream is None:
            reason = (line.error or "").removeprefix(f"line {line.number}: ")
            print(f"line {line.number} (custom_id {line.custom_id}): {line.code.value} {reason}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def run_batch(client: Client, file: Path, project: str, *, wait: bool, out: Path | None,
              timeout_s: float, console: Console, resume: bool = False, collect: bool = False) -> int:
    if client.settings.project(project) is None:
        raise InputInvalid(f"unknown project {project!r} (not in this configuration)")
    if (resume or collect) and out is None:
        raise InputInvalid("--resume and --collect need --out (the results written so far)")
    content = read_input(file)
    lines = parse_lines(jsonl_lines(input_text(file, content)), project, batch_tag(content))
    duplicates = duplicate_custom_ids(lines)
    if duplicates:
        raise InputInvalid(f"custom_id must be unique in a batch file; repeated: "
                           f"{', '.join(duplicates[:5])}{' ...' if len(duplicates) > 5 else ''}")
    done = answered_ids(out) if resume or collect else set()
    todo = [line for line in lines if line.custom_id not in done]
    output = Output(out, append=resume or collect)
    try:
        return _run(client, project, todo, len(lines), output, wait=wait or out is not None,
                    collect=collect, timeout_s=timeout_s, console=console)
    finally:
        output.close()


def _run(client: Client, project: str, todo: list[BatchLine], total: int, output: Output, *,
         wait: bool, collect: bool, timeout_s: float, console: Console) -> int:
    model = client.settings.backend.model
    follower = ResultFollower(client.results, {project})
    by_number = {line.number: line for line in todo}
    job_of = _submit(client, todo, output, model, collect)
    verb = "collecting" if collect else "submitted"
    console.print(f"{verb} {len(job_of)} of {len(todo)} lines ({total} in the file) for project {project}")
    if not wait:
        for number, job_id in job_of.items():
            console.print(f"{by_number[number].custom_id}\t{job_id}")
        return 0 if len(job_of) == len(todo) else 1
    matcher = ResultMatcher(job_of)
    if collect:
        _not_found(client, project, matcher, job_of, by_number, output, model)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(_counts_text(output.counts), total=len(todo),
                                 completed=sum(output.counts.values()))
        refs = {job_ref(project, job_id) for job_id in job_of.values()} - {
            job_ref(project, job_id) for job_id in matcher.envelopes}
        for envelope in follower.follow(refs, timeout_s):
            if matcher.add(envelope):
                for number in matcher.lines_of(envelope.job_id):
                    output.write(output_line(by_number[number], envelope, model))
            progress.update(task, completed=sum(output.counts.values()),
                            description=_counts_text(output.counts))
    missing = len(todo) - sum(output.counts.values())
    console.print(_counts_text(output.counts))
    if missing:
        console.print(f"{missing} lines have no result yet: fleet batch ... --collect --out later")
    return 0 if not missing and all(code.startswith("OK") for code in output.counts) else 1


def _submit(client: Client, todo: list[BatchLine], output: Output, model: str,
            collect: bool) -> dict[int, str]:
    """line number -> job id (two lines may share an idempotency key); refused lines written."""
    job_of: dict[int, str] = {}
    for line in todo:
        if line.job is None:
            output.refused(line, model)
        elif collect:
            job_of[line.number] = line.job.id
        else:
            try:
                job_of[line.number] = client.submit(line.job)
            except BrokerUnavailable:
                raise
            except FleetError as exc:
                line.error, line.code = f"line {line.number}: {exc.message}", exc.code
                output.refused(line, model)
    return job_of


def _not_found(client: Client, project: str, matcher: ResultMatcher, job_of: dict[int, str],
               by_number: dict[int, BatchLine], output: Output, model: str) -> None:
    """--collect: a job the fleet does not have is an E_NOT_FOUND line, not a wait."""
    for job_id in set(job_of.values()):
        ref = job_ref(project, job_id)
        if client.results.job_record(ref) or client.results.final(ref) is not None:
            continue
        envelope = Envelope.failure(job_id, project, Code.E_NOT_FOUND,
                                    f"no job {ref}: never submitted, expired, or lost with the broker's data")
        matcher.add(envelope)
        for number in matcher.lines_of(job_id):
            output.write(output_line(by_number[number], envelope, model))
