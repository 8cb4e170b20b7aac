"""OpenAI batches over the gateway (``/v1/files``, ``/v1/batches``), mapped onto fleet batches.

    POST   /v1/files                  multipart ``file`` + ``purpose=batch`` -> file object
    GET    /v1/files[?purpose=&after=&limit=&order=]  the project's files, newest first
    GET    /v1/files/{id}             the file object
    GET    /v1/files/{id}/content     the bytes (an input file, or a batch's output or error file)
    DELETE /v1/files/{id}             {"id", "object": "file", "deleted"}
    POST   /v1/batches                {"input_file_id", "endpoint", "completion_window", "metadata"}
    GET    /v1/batches[?after=&limit=]  the project's batches, newest first
    GET    /v1/batches/{id}           the batch object, with its status brought up to date
    POST   /v1/batches/{id}/cancel    cancel the jobs not finished yet

The input file is read with the same reader as ``fleet batch`` (fleet/core/batchfile.py): OpenAI
request lines or fleet job lines, each a fleet Job of the key's project, submitted through
``fleet.Client`` signed with the project's secret, so a batch's jobs go through prep, admission
and inference like any queued job. The batch decides what a line may not: its jobs run in the
``batch`` band whatever the key's band (a batch is offline work: an interactive key's 50,000
lines must not crowd its own chat), with the batch's completion window as deadline, and a line
that sets a field of
``REFUSED_LINE_FIELDS`` (band, priority, deadline, sources...) is an error line naming it, as is
a malformed line (``E_INPUT_INVALID``, that line only).

A batch is a Redis hash ``{p}gwbatch:{<project>/<id>}`` (meta: the batch object; lines: per line
its number, custom id, error and code, job id) and an entry in ``{p}gwbatches:<project>``. No
process watches it: reading it (retrieve, list) brings it up to date. The results of its jobs
are read in one MGET; a line whose job has neither a result nor a record any more (expired,
lost with the broker's data) has failed (``E_NOT_FOUND``) instead of waiting forever. While any
line is unanswered the batch is ``in_progress`` (``cancelling``) with its request counts; past
its completion window (``gateway.batch_window_s``) its unanswered jobs are cancelled and those
lines fail with ``E_DEADLINE``. Once every line has its answer, the output file (the answered
lines) and the error file (the failed ones), each in input order in the lines
``fleet batch --out`` writes, are stored in the same transaction that gives the batch its final
status (``completed``, ``cancelled`` or ``expired``, with ``request_counts`` completed + failed =
total): the batch's meta is WATCHed, so of two readers finishing it at once, or a reader and a
cancel, one wins and the other reads the winner's state; a final status never changes again.

Batch work (create, retrieve, list, cancel) runs on its own threads (``gateway.batch_threads``,
``Gateway.run_batch``): a batch of ten thousand lines is submitted line by line in its create
request, and a refresh reads every line's result; chat requests must not wait behind either.
File routes are a few Redis calls each and run with the other requests.

Batches count per project within ``gateway.files_ttl_s`` (``gateway.max_batches``, 413
``E_TOO_LARGE``), and a batch file holds at most ``gateway.max_batch_lines`` lines. Keys carry
the caller's project: another project's batch, file or list cursor is 404 ``E_NOT_FOUND``,
exactly as an unknown id.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.core.batchfile import CHAT_URL, BatchLine, jsonl_lines, output_line, parse_lines
from fleet.core.codes import Code
from fleet.core.errors import FleetError, InputInvalid, NotFound, TooLarge
from fleet.core.keys import job_ref
from fleet.core.models import Envelope
from fleet.gateway.auth import Caller
from fleet.gateway.files import MULTIPART_SLACK, FileStore, capped_receive, page
from fleet.gateway.wire import json_object

if TYPE_CHECKING:
    from fleet.gateway.app import Gateway

# An active status and the final one it ends in once every line is answered.
ACTIVE = {"in_progress": "completed", "cancelling": "cancelled"}
LIST_LIMIT = 20
# Job fields a batch line may not set: the batch decides band and order (the window the
# deadline), and a line brings messages, not material for prep to collect (a source may name a
# file or URL the workers can reach).
REFUSED_LINE_FIELDS = ("band", "priority", "deadline", "sources", "kind", "on_source_error",
                       "submitted_at")

Row = dict[str, Any]  # one input line: n, custom_id, error, code, job (its job id or None)


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def _paging(request: Request) -> tuple[str | None, int, bool]:
    """A list request's ``after``, ``limit`` (1 to 100) and order (newest first unless asc)."""
    query = request.query_params
    try:
        limit = int(query.get("limit", LIST_LIMIT))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InputInvalid("limit: an integer from 1 to 100", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InputInvalid('order: "asc" or "desc"', param="order")
    return query.get("after") or None, limit, order == "desc"


class BatchRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        rt = gateway.runtime
        self.redis = rt.redis
        self.keys = rt.keys
        self.files = FileStore(rt.redis, rt.keys, lambda: gateway.live.settings.gateway)

    # -- files --------------------------------------------------------------------------------
    async def upload(self, request: Request, caller: Caller) -> Response:
        settings = self.gw.live.settings.gateway
        capped = Request(request.scope, capped_receive(request.receive, settings.max_file_bytes + MULTIPART_SLACK))
        try:
            form = await capped.form(max_files=1, max_fields=8)
        except MultiPartException as exc:
            raise InputInvalid(f"the body must be multipart/form-data with file and purpose: {exc}") from exc
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise InputInvalid("purpose: the fleet keeps batch input files only; send purpose=batch",
                               param="purpose")
        if not isinstance(upload, UploadFile):
            raise InputInvalid("file: a file part is required", param="file")
        content = await upload.read()
        try:
            lines = [line for line in jsonl_lines(content.decode("utf-8")) if line.strip()]
        except UnicodeDecodeError as exc:
            raise InputInvalid("file: not UTF-8 text (a batch file is JSONL)", param="file") from exc
        if len(lines) > settings.max_batch_lines:
            raise TooLarge(f"file: {len(lines)} lines, over gateway.max_batch_lines "
                           f"({settings.max_batch_lines})")
        meta = await self.gw.run(self.files.put, caller.project, upload.filename or "batch.jsonl",
                                       "batch", content)
        return JSONResponse(meta)

    async def list_files(self, request: Request, caller: Caller) -> Response:
        after, limit, newest_first = _paging(request)
        found, more = await self.gw.run(self.files.list, caller.project,
                                        request.query_params.get("purpose"), after=after,
                                        limit=limit, newest_first=newest_first)
        return JSONResponse(_list(found, more))

    async def file(self, request: Request, caller: Caller) -> Response:
        return JSONResponse(await self.gw.run(self.files.meta, caller.project,
                                                    request.path_params["file_id"]))

    async def content(self, request: Request, caller: Caller) -> Response:
        data = await self.gw.run(self.files.content, caller.project, request.path_params["file_id"])
        return Response(data, media_type="application/jsonl")

    async def delete_file(self, request: Request, caller: Caller) -> Response:
        file_id = request.path_params["file_id"]
        if not await self.gw.run(self.files.delete, caller.project, file_id):
            raise NotFound(f"no file {file_id!r} for this project")
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # -- batches ------------------------------------------------------------------------------
    async def create(self, request: Request, caller: Caller) -> Response:
        data = json_object(await request.body())
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
        return JSONResponse(await self.gw.run_batch(self._create, caller.project,
                                                    file_id, metadata))

    def _create(self, project: str, file_id: str, metadata: dict[str, Any] | None
                ) -> dict[str, Any]:
        if self.files.meta(project, file_id)["purpose"] != "batch":
            raise InputInvalid(f"input_file_id: {file_id!r} is not a batch input file",
                               param="input_file_id")
        settings = self.gw.live.settings.gateway
        now = time.time()
        kept_s = settings.batch_window_s + settings.files_ttl_s
        batch_id = f"batch_{uuid.uuid4().hex}"
        index = self.keys.gateway_batches(project)
        self.redis.zremrangebyscore(index, "-inf", now - kept_s)
        self.redis.zadd(index, {batch_id: now})
        if self.redis.zcount(index, now - settings.files_ttl_s, "+inf") > settings.max_batches:
            self.redis.zrem(index, batch_id)
            raise TooLarge(f"batches: the project already created gateway.max_batches "
                           f"({settings.max_batches}) within gateway.files_ttl_s")
        self.redis.expire(index, kept_s)
        expires_at = int(now + settings.batch_window_s)
        text = self.files.content(project, file_id).decode("utf-8")
        rows: list[Row] = []
        for line in parse_lines(jsonl_lines(text), project, refused=REFUSED_LINE_FIELDS):
            row: Row = {"n": line.number, "custom_id": line.custom_id, "error": line.error,
                        "code": line.code.value, "job": None}
            if line.job is not None:
                try:
                    row["job"] = self.gw.client.submit(
                        line.job.model_copy(update={"band": "batch", "deadline": expires_at}))
                except FleetError as exc:
                    row.update(error=f"line {line.number}: {exc.message}", code=exc.code.value)
            rows.append(row)
        batch = {
            "id": batch_id, "object": "batch", "endpoint": CHAT_URL, "errors": None,
            "input_file_id": file_id, "completion_window": "24h", "status": "in_progress",
            "output_file_id": None, "error_file_id": None, "created_at": int(now),
            "in_progress_at": int(now), "expires_at": expires_at,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None, "metadata": metadata,
            "request_counts": {"total": len(rows), "completed": 0, "failed": 0},
        }
        key = self.keys.gateway_batch(job_ref(project, batch_id))
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"meta": json.dumps(batch), "lines": json.dumps(rows)})
            pipe.expire(key, kept_s)
            pipe.execute()
        return self._refresh(project, batch_id)

    def _load(self, project: str, batch_id: str) -> tuple[dict[str, Any], list[Row]]:
        meta, lines = self.redis.hmget(self.keys.gateway_batch(job_ref(project, batch_id)),
                                       ["meta", "lines"])
        if meta is None or lines is None:
            raise NotFound(f"no batch {batch_id!r} for this project")
        return json.loads(meta), json.loads(lines)

    def _answers(self, project: str, rows: list[Row]) -> tuple[dict[str, Envelope], set[str]]:
        """The final envelopes of the batch's jobs, and the jobs that have vanished: neither a
        result nor a record (expired, or lost with the broker's data), so never will have one."""
        refs = {row["job"]: job_ref(project, row["job"]) for row in rows if row["job"]}
        raws = self.redis.mget([self.keys.result(ref) for ref in refs.values()]) if refs else []
        envelopes = {}
        for raw in raws:
            if raw is not None:
                envelope = Envelope.model_validate_json(raw)
                envelopes[envelope.job_id] = envelope
        waiting = [job_id for job_id in refs if job_id not in envelopes]
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in waiting:
                pipe.exists(self.keys.job(refs[job_id]))
            known = pipe.execute() if waiting else []
        return envelopes, {job_id for job_id, exists in zip(waiting, known, strict=True) if not exists}

    def _refresh(self, project: str, batch_id: str) -> dict[str, Any]:
        """The batch object, its counts and status brought up to date (see module doc)."""
        batch, rows = self._load(project, batch_id)
        if batch["status"] not in ACTIVE:
            return batch
        envelopes, vanished = self._answers(project, rows)
        expired = time.time() >= batch["expires_at"]
        lines: list[tuple[BatchLine, Envelope | None]] = []
        waiting = []
        for row in rows:
            line = BatchLine(row["n"], row["custom_id"], error=row["error"], code=Code(row["code"]))
            job_id = row["job"]
            if job_id in vanished:
                line.error, line.code = (f"line {line.number}: its job is gone (expired or lost) "
                                         "before it had a result"), Code.E_NOT_FOUND
            elif job_id and job_id not in envelopes:
                waiting.append(job_id)
                if not expired:
                    continue
                line.error, line.code = (f"line {line.number}: not done within the batch's "
                                         "completion window"), Code.E_DEADLINE
            lines.append((line, envelopes.get(job_id) if job_id else None))
        completed = sum(1 for _, envelope in lines if envelope is not None and envelope.ok)
        batch["request_counts"] = {"total": len(rows), "completed": completed,
                                   "failed": len(lines) - completed}
        if len(lines) < len(rows):
            return batch
        batch = self._finish(project, batch_id, lines, batch["request_counts"], expired=bool(waiting))
        if waiting:
            self._cancel_jobs(project, waiting)
        return batch

    def _finish(self, project: str, batch_id: str, lines: list[tuple[BatchLine, Envelope | None]],
                counts: dict[str, int], *, expired: bool) -> dict[str, Any]:
        """Store the output and error files and the final status in one transaction, unless
        another reader finished the batch first (then its state is the answer)."""
        model = self.gw.model
        answered = [output_line(line, envelope, model) for line, envelope in lines
                    if envelope is not None and envelope.ok]
        failed = [output_line(line, envelope, model) for line, envelope in lines
                  if envelope is None or not envelope.ok]
        tag = batch_id.removeprefix("batch_")

        def finish(batch: dict[str, Any], pipe: redis.client.Pipeline) -> bool:
            if batch["status"] not in ACTIVE:
                return False
            now = time.time()
            for kind, rows, field in (("output", answered, "output_file_id"),
                                      ("errors", failed, "error_file_id")):
                if rows:
                    content = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
                    batch[field] = self.files.stage(pipe, project, f"file-{tag}-{kind}",
                                                    f"{batch_id}_{kind}.jsonl", "batch_output",
                                                    content.encode(), now)["id"]
            status = "expired" if expired and batch["status"] == "in_progress" else ACTIVE[batch["status"]]
            batch.update(status=status, request_counts=counts, finalizing_at=int(now),
                         **{f"{status}_at": int(now)})
            return True

        return self._commit(project, batch_id, finish)

    def _commit(self, project: str, batch_id: str,
                change: Callable[[dict[str, Any], redis.client.Pipeline], bool]) -> dict[str, Any]:
        """Change the batch's meta atomically: ``change`` updates the meta it is given and queues
        any other writes on the pipeline (False: nothing to do); retried when another request
        changed the batch meanwhile. The meta as stored afterwards."""
        key = self.keys.gateway_batch(job_ref(project, batch_id))
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    raw = pipe.hget(key, "meta")
                    if raw is None:
                        raise NotFound(f"no batch {batch_id!r} for this project")
                    batch: dict[str, Any] = json.loads(raw)
                    pipe.multi()
                    if change(batch, pipe):
                        pipe.hset(key, "meta", json.dumps(batch))
                        pipe.execute()
                    return batch
                except redis.WatchError:
                    continue

    def _cancel_jobs(self, project: str, job_ids: list[str]) -> None:
        for job_id in job_ids:
            try:
                self.gw.client.cancel(job_id, project=project)
            except NotFound:  # vanished meanwhile: its line fails with E_NOT_FOUND
                continue

    async def get(self, request: Request, caller: Caller) -> Response:
        return JSONResponse(await self.gw.run_batch(self._refresh, caller.project,
                                                    request.path_params["batch_id"]))

    async def list_batches(self, request: Request, caller: Caller) -> Response:
        after, limit, newest_first = _paging(request)

        def load(batch_id: str) -> dict[str, Any] | None:
            try:
                return self._refresh(caller.project, batch_id)
            except NotFound:  # expired
                return None

        found, more = await self.gw.run_batch(page, self.redis, self.keys.gateway_batches(caller.project),
                                              after=after, limit=limit, newest_first=newest_first,
                                              load=load)
        return JSONResponse(_list(found, more))

    async def cancel(self, request: Request, caller: Caller) -> Response:
        return JSONResponse(await self.gw.run_batch(self._cancel, caller.project,
                                                    request.path_params["batch_id"]))

    def _cancel(self, project: str, batch_id: str) -> dict[str, Any]:
        batch = self._refresh(project, batch_id)
        if batch["status"] != "in_progress":
            return batch

        def cancelling(batch: dict[str, Any], pipe: redis.client.Pipeline) -> bool:
            if batch["status"] != "in_progress":
                return False
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            return True

        if self._commit(project, batch_id, cancelling)["status"] == "cancelling":
            _, rows = self._load(project, batch_id)
            envelopes, _ = self._answers(project, rows)
            self._cancel_jobs(project, [row["job"] for row in rows
                                        if row["job"] and row["job"] not in envelopes])
        return self._refresh(project, batch_id)
