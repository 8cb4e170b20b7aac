"""OpenAI batches over the gateway (``/v1/batches``), mapped onto fleet batches: their lifecycle
(``BatchLifecycle``) and their routes (``BatchRoutes``). A batch's record in Redis is
fleet/gateway/batchrecord.py's; input and result files are kept by fleet/gateway/files.py and
served by fleet/gateway/fileroutes.py, but for their content:

    POST   /v1/batches                {"input_file_id", "endpoint", "completion_window", "metadata"}
    GET    /v1/batches[?after=&limit=]  the project's batches, newest first, as last stored
    GET    /v1/batches/{id}           the batch object, with its status brought up to date
    POST   /v1/batches/{id}/cancel    cancel the jobs not finished yet
    GET    /v1/files/{id}/content     a file's bytes: a batch's result file is built here from
                                      its batch when read, an upload's bytes are sent as stored

The input file is read with the same reader as ``fleet batch`` (fleet/core/batchfile.py): OpenAI
request lines or fleet job lines, each a fleet Job of the key's project, submitted through
``fleet.Client`` signed with the project's secret, so a batch's jobs go through prep, admission
and inference like any queued job. The batch decides what a line may not: its jobs run in the
``batch`` band whatever the key's band (a batch is offline work: an interactive key's 50,000
lines must not crowd its own chat), with the batch's completion window as deadline, and a line
that sets a field of ``REFUSED_LINE_FIELDS`` (band, priority, deadline, sources...) is an error
line naming it, as is a malformed line (``E_INPUT_INVALID``, that line only). A file without a
single valid line makes a ``failed`` batch (``errors`` lists the lines' errors), as OpenAI's.

Everything is kept under the caller's project (fleet/gateway/batchrecord.py): another project's
batch, file or cursor is 404 ``E_NOT_FOUND`` exactly as an unknown id.

Create writes the batch first (``validating``, as OpenAI's) and records its progress line by
line, so a create that fails half way (Redis failing over, the gateway restarting) leaves a
batch that retrieve, list and cancel see, never invisible jobs: an error of one line's submit
(a FleetError, a RedisError, a bug) fails that line only (its code: the error's,
``E_BROKER_UNAVAILABLE``, ``E_INTERNAL``); a create that stops (cancelled meanwhile, or no
progress for ``gateway.batch_create_stall_s``: it died) ends its remaining lines as errors (``E_CANCELLED``,
``E_INTERNAL``), cancels any job they may have started and leaves ``validating``. Progress is
timed by Redis's clock (``TIME``), never a host's, so a gateway whose clock is ahead cannot end
another's live create; and where the create ended is set in a transaction from the ``submitted``
stored at that moment (the create writes ``submitted`` and only then checks ``ended``), so a
line the create sent is never failed as not sent. A create
retried by the client is a second batch (OpenAI has no idempotency key for batches); the first
is visible and can be cancelled.

No process watches a batch: retrieving it brings it up to date. Only lines not settled yet are
read (their results in MGETs of ``CHUNK_LINES``), each settled line's outcome is kept, so every
result is read once while the batch runs however often it is polled. A line whose job has
neither a result nor a record any more (expired, lost with the broker's data) has failed
(``E_NOT_FOUND``) instead of waiting forever. Past the completion window
(``gateway.batch_window_s``) a still unanswered job is cancelled and given the result
``E_DEADLINE`` (first result wins, so its line, its own result and the task API agree). Ending
jobs is a share per call: one read expires at most ``ENDS_PER_CALL`` jobs and a cancel (and
each read of a ``cancelling`` batch after it) cancels at most that many (``cancelled_to`` says
how far it got), and outcomes are kept ``CHUNK_LINES`` at a time, so a 10,000-line batch is
ended over a few reads, none of which holds its batch thread for minutes or loses what it did
when cut; the batch stays ``in_progress`` (``cancelling``) until the reads have done it all. The
batch is ``expired`` when its window has passed and a line ended ``E_DEADLINE`` or
``E_CANCELLED`` (a real fleet ends queued jobs at their deadline itself, before any refresh
sees them waiting), else ``completed`` (``cancelled`` after a cancel). The final status is
written in a transaction on the WATCHed meta: of two readers finishing a batch at once, or a
reader and a cancel, one wins and the other reads the winner's state; a final status never
changes again. The list shows each batch as last stored (no refresh: a list of 100 batches of
10,000 lines must cost a hundred small reads, not a million).

The output file (answered lines) and error file (failed ones) store no copy of the results:
their meta names the batch, and their content is built from the batch's lines and its jobs'
results when read (in input order, in the lines ``fleet batch --out`` writes, streamed
``CHUNK_LINES`` at a time), so they take nothing of ``gateway.max_project_bytes``. The batch's
record and its jobs' results are kept ``files_ttl_s`` past the batch's end, as its files.

Batch work runs on its own threads (``gateway.batch_threads``, ``Gateway.run_batch``), at most
``gateway.batch_calls_per_project`` calls of one project at a time in one gateway process (one
more is 429 ``E_BUSY`` with ``Retry-After``): chat never waits behind a batch, and one project's
flood of batch calls never holds up another's. A result file's download is one such call from
its first chunk to its last (each chunk rendered on the batch threads), so downloads are held
to the same limit. Batches count per project within ``gateway.files_ttl_s``
(``gateway.max_batches``, 413 ``E_TOO_LARGE``), and a batch file holds at most
``gateway.max_batch_lines`` lines.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from fleet.core.batchfile import CHAT_URL, BatchLine, jsonl_lines, output_line, parse_lines
from fleet.core.codes import Code
from fleet.core.config import GatewaySettings
from fleet.core.errors import FleetError, InputInvalid, NotFound, TooLarge
from fleet.core.keys import job_ref
from fleet.core.models import Envelope
from fleet.gateway.auth import Caller
from fleet.gateway.batchrecord import BatchRecords, Row, Settled, State
from fleet.gateway.fileroutes import upload_content
from fleet.gateway.files import FileStore, page
from fleet.gateway.wire import json_object, list_body, paging, read_body

if TYPE_CHECKING:
    from fleet.gateway.app import Gateway

log = logging.getLogger(__name__)

# An active status and the final one it ends in once every line is answered.
ACTIVE = {"in_progress": "completed", "cancelling": "cancelled"}
CHUNK_LINES = 200  # lines whose results are read (and a result file's lines sent) at a time
# Jobs one call ends (expires past the window, or cancels for a cancelled batch): each costs a
# few round trips and a task sent, so a 10,000-line batch is ended over several reads, never in
# one call that outlasts its client.
ENDS_PER_CALL = 5 * CHUNK_LINES
ERRORS_SHOWN = 100  # line errors a failed batch's ``errors`` lists
# Job fields a batch line may not set: the batch decides band and order (the window the
# deadline), and a line brings messages, not material for prep to collect (a source may name a
# file or URL the workers can reach).
REFUSED_LINE_FIELDS = ("band", "priority", "deadline", "sources", "kind", "on_source_error",
                       "submitted_at")


def _line_bytes(row: dict[str, Any]) -> bytes:
    return (json.dumps(row, ensure_ascii=False) + "\n").encode()


def _chunks(items: list[int]) -> Iterator[list[int]]:
    for start in range(0, len(items), CHUNK_LINES):
        yield items[start:start + CHUNK_LINES]


class HeldStreamingResponse(StreamingResponse):
    """A streamed response that holds one of its project's batch calls until it is sent, cut or
    never started (``release`` runs once the ASGI call ends, however it ends)."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


class BatchLifecycle(BatchRecords):
    """A batch from its create to its final status (every method blocks on Redis: they run on
    the batch threads): create it and submit its lines, end a create that stopped, bring it up to
    date (settle its lines, expire them past the window, finish it), cancel it; and the lines of
    its result files. Methods of one object call each other through ``self``, so a test can hold
    one step (a submit, a load) of a create or a read between two others."""

    def __init__(self, gateway: Gateway) -> None:
        rt = gateway.runtime
        super().__init__(rt.redis, rt.keys, lambda: gateway.live.settings.gateway)
        self.gw = gateway
        self.files = FileStore(rt.redis, rt.keys, lambda: gateway.live.settings.gateway)

    def _create(self, project: str, file_id: str, metadata: dict[str, Any] | None,
                caller: Caller | None = None) -> dict[str, Any]:
        """Create a batch of the input file ``file_id``: its record first, then its lines
        submitted one by one (none when no line is valid: the batch is ``failed``)."""
        if self.files.meta(project, file_id)["purpose"] != "batch":
            raise InputInvalid(f"input_file_id: {file_id!r} is not a batch input file",
                               param="input_file_id")
        parsed = parse_lines(jsonl_lines(self.files.content(project, file_id).decode("utf-8")),
                             project, refused=REFUSED_LINE_FIELDS)
        settings = self.gw.live.settings.gateway
        now = time.time()
        kept_s = settings.batch_window_s + settings.files_ttl_s
        batch_id = f"batch_{uuid.uuid4().hex}"
        self._count_batch(project, batch_id, now, settings)
        expires_at = int(now + settings.batch_window_s)
        rows: list[Row] = [{"n": line.number, "custom_id": line.custom_id, "error": line.error,
                            "code": line.code.value, "job": line.job.id if line.job else None}
                           for line in parsed]
        batch = self._new_batch(batch_id, file_id, metadata, parsed, now, expires_at)
        self._store_new(project, batch, rows, kept_s)
        if batch["status"] == "failed":
            return batch
        return self._submit_lines(project, batch_id, parsed, rows, expires_at, caller)

    def _count_batch(self, project: str, batch_id: str, now: float, settings: GatewaySettings) -> None:
        """Put the batch in its project's index, held to ``gateway.max_batches`` created within
        ``gateway.files_ttl_s`` (TooLarge past it); entries older than a batch is kept are pruned."""
        kept_s = settings.batch_window_s + settings.files_ttl_s
        index = self.keys.gateway_batches(project)
        self.redis.zremrangebyscore(index, "-inf", now - kept_s)
        self.redis.zadd(index, {batch_id: now})
        if self.redis.zcount(index, now - settings.files_ttl_s, "+inf") > settings.max_batches:
            self.redis.zrem(index, batch_id)
            raise TooLarge(f"batches: the project already created gateway.max_batches "
                           f"({settings.max_batches}) within gateway.files_ttl_s")
        self.redis.expire(index, kept_s)

    def _new_batch(self, batch_id: str, file_id: str, metadata: dict[str, Any] | None,
                   parsed: list[BatchLine], now: float, expires_at: int) -> dict[str, Any]:
        """The batch object as created: ``validating``, or ``failed`` when no line is valid."""
        batch: dict[str, Any] = {
            "id": batch_id, "object": "batch", "endpoint": CHAT_URL, "errors": None,
            "input_file_id": file_id, "completion_window": "24h", "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": int(now),
            "in_progress_at": None, "expires_at": expires_at,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None, "metadata": metadata,
            "request_counts": {"total": len(parsed), "completed": 0, "failed": 0}, "usage": None,
        }
        if not any(line.job for line in parsed):
            batch.update(status="failed", failed_at=int(now), errors=self._input_errors(parsed),
                         request_counts={"total": 0, "completed": 0, "failed": 0})
        return batch

    def _submit_lines(self, project: str, batch_id: str, parsed: list[BatchLine], rows: list[Row],
                      expires_at: int, caller: Caller | None = None) -> dict[str, Any]:
        """Submit the lines in order, recording each (its failure, ``submitted``, ``touched``)
        before reading whether a reader ended the create or a cancel came; then end the create."""
        key = self._key(project, batch_id)
        for i, line in enumerate(parsed):
            failure = self._submit(line, expires_at, caller) if line.job is not None else None
            with self.redis.pipeline(transaction=False) as pipe:
                if failure is not None:
                    pipe.hset(key, f"e:{i}", json.dumps(failure))
                pipe.hset(key, mapping={"submitted": i + 1, "touched": self._clock()})
                pipe.hmget(key, ["meta", "ended"])
                raw, ended = pipe.execute()[-1]
            if ended is not None:
                # A reader took this create for dead and ended it at line ``ended``: what was
                # sent since then is this create's to cancel (the reader may have missed it).
                self._cancel_jobs(project, [row["job"] for row in rows[int(ended):i + 1] if row["job"]])
                return self._load(project, batch_id).meta
            if json.loads(raw)["status"] != "validating":
                break  # cancelled meanwhile: the remaining lines are not submitted
        return self._end_create(project, batch_id)

    @staticmethod
    def _input_errors(parsed: list[BatchLine]) -> dict[str, Any]:
        """A failed batch's ``errors``, as OpenAI's: why the file has no line to run."""
        data = [{"code": line.code.value, "message": line.error or "", "param": None,
                 "line": line.number} for line in parsed[:ERRORS_SHOWN]]
        if not parsed:
            data = [{"code": Code.E_INPUT_INVALID.value, "message": "the file has no request line",
                     "param": None, "line": None}]
        return {"object": "list", "data": data}

    def _submit(self, line: BatchLine, expires_at: int, caller: Caller | None) -> tuple[str, str] | None:
        """Submit one line's job, tagged with the caller's key (its quota, the usage ledger); the
        line's error and code if that failed."""
        assert line.job is not None
        try:
            job = line.job.model_copy(update={"band": "batch", "deadline": expires_at})
            self.gw.client.submit(job, record=None if caller is None else self.gw.key_tag(caller, job))
            return None
        except FleetError as exc:
            return f"line {line.number}: {exc.message}", exc.code.value
        except redis.RedisError as exc:
            return f"line {line.number}: the broker failed: {exc}", Code.E_BROKER_UNAVAILABLE.value
        except Exception as exc:  # a bug: that line fails, the batch goes on
            log.exception("batch line %d failed to submit", line.number)
            return f"line {line.number}: internal error: {type(exc).__name__}", Code.E_INTERNAL.value

    def _end_create(self, project: str, batch_id: str) -> dict[str, Any]:
        """End a create (done, cancelled meanwhile, or died): lines it did not submit become
        errors, their jobs (if one started) are cancelled, and the batch leaves ``validating``
        with the failed lines counted. The batch's meta (no job's result is read: a create
        that got this far answers even if Redis fails it now)."""
        key = self._key(project, batch_id)
        state = self._load(project, batch_id)
        if not state.ended:
            self._mark_ended(key)
            state = self._load(project, batch_id)
        self._fail_unsent(key, state)
        # An unsent line's job may have started all the same (the create died between its
        # submit and recording it): cancelled; so are the waiting ones of a cancelled batch
        # (``ENDS_PER_CALL`` of them now, the rest by the next reads).
        self._cancel_jobs(project, [row["job"] for row in state.rows[state.submitted:] if row["job"]])
        self._cancel_waiting(project, state)
        failed = sum(1 for row in state.rows[:state.submitted] if row["error"]) + len(
            state.rows) - state.submitted

        def started(batch: dict[str, Any], pipe: redis.client.Pipeline) -> bool:
            if batch["status"] not in ("validating", "cancelling") or batch["in_progress_at"]:
                return False
            if batch["status"] == "validating":
                batch["status"] = "in_progress"
            batch.update(in_progress_at=int(time.time()),
                         request_counts={"total": len(state.rows), "completed": 0, "failed": failed})
            return True

        return self._commit(project, batch_id, started)

    def _fail_unsent(self, key: str, state: State) -> None:
        """The lines an ended create did not submit become errors (a line's error already
        written stays)."""
        cancelled = state.meta["status"] == "cancelling"
        reason, code = (("the batch was cancelled while it was created", Code.E_CANCELLED)
                        if cancelled else
                        ("the batch's create stopped before this line", Code.E_INTERNAL))
        with self.redis.pipeline(transaction=True) as pipe:
            for i in range(state.submitted, len(state.rows)):
                if state.rows[i]["job"]:
                    pipe.hsetnx(key, f"e:{i}", json.dumps(
                        (f"line {state.rows[i]['n']}: not submitted: {reason}", code.value)))
            pipe.execute()

    def _refresh(self, project: str, batch_id: str) -> dict[str, Any]:
        """The batch object, its counts and status brought up to date (see module doc)."""
        state = self._load(project, batch_id)
        if state.meta["status"] not in ("validating", *ACTIVE):
            return state.meta
        if not state.ended:
            if self._clock() - state.touched < self.gw.live.settings.gateway.batch_create_stall_s:
                return state.meta  # its create is still submitting lines
            self._end_create(project, batch_id)
            state = self._load(project, batch_id)
        if state.meta["status"] not in ACTIVE:
            return state.meta
        self._cancel_waiting(project, state)
        self._settle(project, state)
        counts = self._counts(state)
        if len(state.waiting()) == 0:
            return self._finish(project, state, counts)

        def progressed(batch: dict[str, Any], pipe: redis.client.Pipeline) -> bool:
            if batch["status"] not in ACTIVE or batch["request_counts"] == counts:
                return False
            batch["request_counts"] = counts
            return True

        return self._commit(project, batch_id, progressed)

    @staticmethod
    def _counts(state: State) -> dict[str, int]:
        completed = sum(1 for outcome in state.settled.values() if outcome.code.ok)
        failed = sum(1 for row in state.rows if row["error"]) + len(state.settled) - completed
        return {"total": len(state.rows), "completed": completed, "failed": failed}

    def _settle(self, project: str, state: State) -> None:
        """Find the outcome of the lines still waiting (their results, read once each, or their
        vanished jobs) and keep it; past the window, end the rest ``E_DEADLINE``, at most
        ``ENDS_PER_CALL`` of them (the next read goes on). Outcomes are kept ``CHUNK_LINES`` at
        a time, so a call cut half way (its client gone, the gateway stopped) loses little."""
        waiting = state.waiting()
        for indexes in _chunks(waiting):
            refs = [job_ref(project, state.rows[i]["job"]) for i in indexes]
            raws = self.redis.mget([self.keys.result(ref) for ref in refs])
            found: dict[int, Settled] = {}
            missing = [(i, ref) for i, ref, raw in zip(indexes, refs, raws, strict=True) if raw is None]
            for i, raw in zip(indexes, raws, strict=True):
                if raw is not None:
                    found[i] = self._outcome(state.line(i), Envelope.model_validate_json(raw))
            with self.redis.pipeline(transaction=False) as pipe:
                for _, ref in missing:
                    pipe.exists(self.keys.job(ref))
                known = pipe.execute() if missing else []
            for (i, _), exists in zip(missing, known, strict=True):
                if not exists:
                    line = state.line(i)
                    line.error, line.code = self._gone(line.number)
                    found[i] = Settled(Code.E_NOT_FOUND, len(_line_bytes(
                        output_line(line, None, self.gw.model))), False)
            self._keep(project, state, found)
        if time.time() < state.meta["expires_at"]:
            return
        due = [i for i in waiting if i not in state.settled][:ENDS_PER_CALL]
        for indexes in _chunks(due):
            self._keep(project, state, {i: self._expire(project, state.line(i), state.rows[i]["job"])
                                        for i in indexes})

    def _outcome(self, line: BatchLine, envelope: Envelope) -> Settled:
        usage = envelope.usage
        return Settled(envelope.code, len(_line_bytes(output_line(line, envelope, self.gw.model))),
                       True, (usage.prompt_tokens, usage.completion_tokens, usage.reasoning_tokens,
                              usage.cached_tokens))

    def _expire(self, project: str, line: BatchLine, job_id: str) -> Settled:
        """End a job not done within the window: cancel it (a running one stops) and give it the
        result ``E_DEADLINE``; whichever result is first (a cancel or answer just before) is
        the line's, so the line and the job's own result always agree."""
        self._cancel_jobs(project, [job_id])
        self.gw.runtime.results.publish(Envelope.failure(
            job_id, project, Code.E_DEADLINE, "not done within the batch's completion window"))
        envelope = self.gw.runtime.results.get(job_ref(project, job_id))
        if envelope is None:  # gone at once (evicted): as a vanished job
            line.error, line.code = self._gone(line.number)
            return Settled(Code.E_NOT_FOUND, len(_line_bytes(output_line(line, None, self.gw.model))), False)
        return self._outcome(line, envelope)

    def _finish(self, project: str, state: State, counts: dict[str, int]) -> dict[str, Any]:
        """Give the batch its result files (meta only: their content is built when read) and
        its final status in one transaction, unless another reader finished it first (then
        its state is the answer). Its record and its jobs' results are kept as long as its files."""
        batch_id = state.meta["id"]
        sizes = self._file_sizes(state)
        usage = [sum(outcome.usage[k] for outcome in state.settled.values()) for k in range(4)]
        expired = time.time() >= state.meta["expires_at"] and any(
            outcome.code in (Code.E_DEADLINE, Code.E_CANCELLED) for outcome in state.settled.values())
        tag = batch_id.removeprefix("batch_")
        ttl = self.gw.live.settings.gateway.files_ttl_s

        def finish(batch: dict[str, Any], pipe: redis.client.Pipeline) -> bool:
            if batch["status"] not in ACTIVE:
                return False
            now = time.time()
            for part, field in (("output", "output_file_id"), ("errors", "error_file_id")):
                if sizes[part]:
                    batch[field] = self.files.stage_result(
                        pipe, project, f"file-{tag}-{part}", f"{batch_id}_{part}.jsonl",
                        sizes[part], now, batch_id, part)["id"]
            for key in (self._key(project, batch_id), self._settled_key(project, batch_id),
                        *(self.keys.result(job_ref(project, row["job"])) for row in state.rows
                          if row["job"])):
                pipe.expire(key, ttl, gt=True)
            status = "expired" if expired and batch["status"] == "in_progress" else ACTIVE[batch["status"]]
            batch.update(status=status, request_counts=counts, finalizing_at=int(now),
                         usage={"input_tokens": usage[0], "output_tokens": usage[1],
                                "total_tokens": usage[0] + usage[1],
                                "input_tokens_details": {"cached_tokens": usage[3]},
                                "output_tokens_details": {"reasoning_tokens": usage[2]}},
                         **{f"{status}_at": int(now)})
            return True

        return self._commit(project, batch_id, finish)

    def _file_sizes(self, state: State) -> dict[str, int]:
        """The bytes of the batch's result files, by part (``output``, ``errors``)."""
        sizes = {"output": 0, "errors": 0}
        for i in range(len(state.rows)):
            outcome = state.settled.get(i)
            size = outcome.size if outcome is not None else len(_line_bytes(
                output_line(state.line(i), None, self.gw.model)))
            sizes[self._part_of(state, i)] += size
        return sizes

    def _cancel(self, project: str, batch_id: str) -> dict[str, Any]:
        batch = self._refresh(project, batch_id)
        if batch["status"] not in ("validating", "in_progress"):
            return batch

        def cancelling(batch: dict[str, Any], pipe: redis.client.Pipeline) -> bool:
            if batch["status"] not in ("validating", "in_progress"):
                return False
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            return True

        # The refresh cancels the first waiting jobs (a create still running stops at its next
        # line and starts cancelling once it ended).
        self._commit(project, batch_id, cancelling)
        return self._refresh(project, batch_id)

    def _cancel_waiting(self, project: str, state: State) -> None:
        """A cancelling batch: cancel the waiting jobs of the next submitted lines, at most
        ``ENDS_PER_CALL`` (``cancelled_to`` says how far it got; the next read goes on). Two
        readers at once may cancel some jobs twice, which changes nothing."""
        if state.meta["status"] != "cancelling":
            return
        waiting, end = set(state.waiting()), state.cancelled_to
        jobs: list[str] = []
        while end < state.submitted and len(jobs) < ENDS_PER_CALL:
            if end in waiting:
                jobs.append(state.rows[end]["job"])
            end += 1
        if end == state.cancelled_to:
            return
        self._cancel_jobs(project, jobs)
        self.redis.hset(self._key(project, state.meta["id"]), "cancelled_to", end)
        state.cancelled_to = end

    def _cancel_jobs(self, project: str, job_ids: list[str]) -> None:
        for job_id in job_ids:
            try:
                self.gw.client.cancel(job_id, project=project)
            except NotFound:  # never submitted, or vanished: its line fails with its own error
                continue

    def _part_of(self, state: State, index: int) -> str:
        outcome = state.settled.get(index)
        return "output" if outcome is not None and outcome.code.ok else "errors"

    def _render(self, project: str, state: State, indexes: list[int]) -> bytes:
        """The result lines of these lines, in their order (a result gone meanwhile: E_NOT_FOUND)."""
        jobs = {i: state.rows[i]["job"] for i in indexes
                if (outcome := state.settled.get(i)) is not None and outcome.from_result}
        raws = self.redis.mget([self.keys.result(job_ref(project, job)) for job in jobs.values()]) if jobs else []
        results = dict(zip(jobs, raws, strict=True))
        out = []
        for i in indexes:
            line, envelope = state.line(i), None
            if i in results:
                raw = results[i]
                if raw is None:
                    line.error, line.code = (f"line {line.number}: its result has expired",
                                             Code.E_NOT_FOUND)
                else:
                    envelope = Envelope.model_validate_json(raw)
            elif i in state.settled and not line.error:
                line.error, line.code = self._gone(line.number)
            out.append(_line_bytes(output_line(line, envelope, self.gw.model)))
        return b"".join(out)

    @staticmethod
    def _gone(number: int) -> tuple[str, Code]:
        return f"line {number}: its job is gone (expired or lost) before it had a result", Code.E_NOT_FOUND


class BatchRoutes(BatchLifecycle):
    """The batch routes (and a file's content, see the module doc): each reads its request and
    runs the lifecycle on its project's batch threads (``Gateway.run_batch``)."""

    async def create(self, request: Request, caller: Caller) -> Response:
        data = json_object(await read_body(request, self.gw.live.settings.gateway.max_body_bytes))
        if data.get("endpoint") != CHAT_URL:
            raise InputInvalid(f"endpoint: only {CHAT_URL} is served", param="endpoint")
        if data.get("completion_window") != "24h":
            raise InputInvalid('completion_window: only "24h" is supported', param="completion_window")
        metadata = data.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise InputInvalid("metadata: an object of strings", param="metadata")
        unknown = sorted(set(data) - {"endpoint", "completion_window", "metadata", "input_file_id",
                                      "output_expires_after"})
        if unknown:
            raise InputInvalid(f"unknown fields: {', '.join(unknown)}", param=unknown[0])
        file_id = str(data.get("input_file_id") or "")
        return JSONResponse(await self.gw.run_batch(caller.project, self._create, caller.project,
                                                    file_id, metadata, caller))

    async def get(self, request: Request, caller: Caller) -> Response:
        return JSONResponse(await self.gw.run_batch(caller.project, self._refresh, caller.project,
                                                    request.path_params["batch_id"]))

    async def list_batches(self, request: Request, caller: Caller) -> Response:
        after, limit, newest_first = paging(request)

        def load(batch_id: str) -> dict[str, Any] | None:
            raw = self.redis.hget(self._key(caller.project, batch_id), "meta")
            return json.loads(raw) if raw else None  # None: expired

        found, more = await self.gw.run_batch(
            caller.project, page, self.redis, self.keys.gateway_batches(caller.project),
            after=after, limit=limit, newest_first=newest_first, load=load)
        return JSONResponse(list_body(found, more))

    async def cancel(self, request: Request, caller: Caller) -> Response:
        return JSONResponse(await self.gw.run_batch(caller.project, self._cancel, caller.project,
                                                    request.path_params["batch_id"]))

    async def content(self, request: Request, caller: Caller) -> Response:
        """``GET /v1/files/{id}/content``, sent in chunks: an upload's bytes as stored
        (fleet/gateway/fileroutes.py), a batch's result file built ``CHUNK_LINES`` lines at a
        time as one of its project's batch calls (an error mid-way cuts the response)."""
        project, file_id = caller.project, request.path_params["file_id"]
        source = await self.gw.run(self.files.source, project, file_id)
        if source is None:
            return upload_content(self.gw, self.files, project, file_id)
        batch_id, part = source
        release = self.gw.hold_batch_call(project)
        try:
            state = await self.gw.run_held(self._load, project, batch_id)
        except BaseException:
            release()
            raise
        return HeldStreamingResponse(self._result_chunks(project, state, part), release,
                                     media_type="application/jsonl")

    async def _result_chunks(self, project: str, state: State, part: str) -> AsyncIterator[bytes]:
        wanted = [i for i in range(len(state.rows)) if self._part_of(state, i) == part]
        for indexes in _chunks(wanted):
            yield await self.gw.run_held(self._render, project, state, indexes)
