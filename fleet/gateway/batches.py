"""OpenAI batches over the gateway (``/v1/files``, ``/v1/batches``), mapped onto fleet batches.

    POST   /v1/files                  multipart ``file`` + ``purpose=batch`` -> file object
    GET    /v1/files[?purpose=]       the project's files, newest first
    GET    /v1/files/{id}             the file object
    GET    /v1/files/{id}/content     the bytes (an input file, or a batch's output file)
    DELETE /v1/files/{id}             {"id", "object": "file", "deleted"}
    POST   /v1/batches                {"input_file_id", "endpoint", "completion_window", "metadata"}
    GET    /v1/batches                the project's batches, newest first
    GET    /v1/batches/{id}           the batch object, with its status brought up to date
    POST   /v1/batches/{id}/cancel    cancel the jobs not finished yet

The input file is read with the same reader as ``fleet batch`` (fleet/core/batchfile.py): OpenAI
request lines or fleet job lines, each a fleet Job of the key's project, submitted through
``fleet.Client`` signed with the project's secret (band ``batch`` unless a line says otherwise),
so a batch's jobs go through prep, admission and inference like any queued job. A malformed line
is an error line (``E_INPUT_INVALID``) for that line only, as in ``fleet batch``.

A batch is a Redis hash ``{p}gwbatch:{<project>/<id>}`` (meta: the batch object; lines: line
number, custom id, parse error, job id) and an entry in ``{p}gwbatches:<project>``. No process
watches it: reading it (retrieve, list) brings it up to date. The results of its jobs are read
in one MGET; while any is missing it is ``in_progress`` (``cancelling``) with its request counts;
once every line has its answer the output file is written (the lines ``fleet batch --out``
writes, one per input line in input order, errors included: there is no separate error file)
under an id derived from the batch's, so two readers finishing it at once write the same file,
and the batch becomes ``completed`` (``cancelled``) with ``output_file_id``. Batches count per
project within ``gateway.files_ttl_s`` (``gateway.max_batches``, 413 ``E_TOO_LARGE``), and a batch
file holds at most ``gateway.max_batch_lines`` lines. Keys carry the caller's project: another
project's batch is 404 ``E_NOT_FOUND``, exactly as an unknown id.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, cast

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.core.batchfile import CHAT_URL, BatchLine, jsonl_lines, output_line, parse_lines
from fleet.core.errors import FleetError, InputInvalid, NotFound, TooLarge
from fleet.core.keys import job_ref
from fleet.core.models import Envelope
from fleet.gateway.auth import Caller
from fleet.gateway.files import MULTIPART_SLACK, FileStore, capped_receive
from fleet.gateway.wire import json_object

if TYPE_CHECKING:
    from fleet.gateway.app import Gateway

FINAL_STATUS = {"in_progress": "completed", "cancelling": "cancelled"}
LIST_LIMIT = 20


def _list(data: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def _limit(request: Request) -> int:
    try:
        return max(1, min(100, int(request.query_params.get("limit", LIST_LIMIT))))
    except ValueError as exc:
        raise InputInvalid("limit: an integer from 1 to 100", param="limit") from exc


class BatchRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        rt = gateway.runtime
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
        found = await self.gw.run(self.files.list, caller.project, request.query_params.get("purpose"),
                                  _limit(request))
        return JSONResponse(_list(found))

    async def file(self, request: Request, caller: Caller) -> Response:
        return JSONResponse(await self.gw.run(self.files.meta, caller.project, request.path_params["file_id"]))

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
        meta = await self.gw.run(self.files.meta, caller.project, file_id)
        if meta["purpose"] != "batch":
            raise InputInvalid(f"input_file_id: {file_id!r} is not a batch input file",
                               param="input_file_id")
        batch = await self.gw.run(self._create, caller.project, file_id, metadata)
        return JSONResponse(batch)

    def _create(self, project: str, file_id: str, metadata: dict[str, Any] | None) -> dict[str, Any]:
        settings = self.gw.live.settings.gateway
        rt = self.gw.runtime
        now = time.time()
        batch_id = f"batch_{uuid.uuid4().hex}"
        index = rt.keys.gateway_batches(project)
        rt.redis.zremrangebyscore(index, "-inf", now - settings.files_ttl_s)
        rt.redis.zadd(index, {batch_id: now})
        if rt.redis.zcard(index) > settings.max_batches:
            rt.redis.zrem(index, batch_id)
            raise TooLarge(f"batches: the project already created gateway.max_batches "
                           f"({settings.max_batches}) within gateway.files_ttl_s")
        rt.redis.expire(index, settings.files_ttl_s)
        text = self.files.content(project, file_id).decode("utf-8")
        rows = []
        for line in parse_lines(jsonl_lines(text), project):
            job_id = None
            if line.job is not None:
                try:
                    job_id = self.gw.client.submit(line.job)
                except FleetError as exc:
                    line.error = f"line {line.number}: {exc.message}"
            rows.append([line.number, line.custom_id, line.error, job_id])
        batch = {
            "id": batch_id, "object": "batch", "endpoint": CHAT_URL, "errors": None,
            "input_file_id": file_id, "completion_window": "24h", "status": "in_progress",
            "output_file_id": None, "error_file_id": None, "created_at": int(now),
            "in_progress_at": int(now), "expires_at": int(now + settings.files_ttl_s),
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None, "metadata": metadata,
            "request_counts": {"total": len(rows), "completed": 0, "failed": 0},
        }
        key = rt.keys.gateway_batch(job_ref(project, batch_id))
        with rt.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"meta": json.dumps(batch), "lines": json.dumps(rows)})
            pipe.expire(key, settings.files_ttl_s)
            pipe.execute()
        return self._refresh(project, batch_id)

    def _load(self, project: str, batch_id: str) -> tuple[dict[str, Any], list[list[Any]]]:
        meta, lines = self.gw.runtime.redis.hmget(
            self.gw.runtime.keys.gateway_batch(job_ref(project, batch_id)), ["meta", "lines"])
        if meta is None or lines is None:
            raise NotFound(f"no batch {batch_id!r} for this project")
        return json.loads(meta), json.loads(lines)

    def _refresh(self, project: str, batch_id: str) -> dict[str, Any]:
        """The batch object, its counts and status brought up to date (see module doc)."""
        batch, rows = self._load(project, batch_id)
        if batch["status"] not in FINAL_STATUS:
            return batch
        rt = self.gw.runtime
        refs = [job_ref(project, job_id) for *_, job_id in rows if job_id]
        raws = rt.redis.mget([rt.keys.result(ref) for ref in refs]) if refs else []
        envelopes = {}
        for raw in raws:
            if raw is not None:
                envelope = Envelope.model_validate_json(raw)
                envelopes[envelope.job_id] = envelope
        done = [row for row in rows if not row[3] or row[3] in envelopes]
        failed = sum(1 for row in done if not row[3] or not envelopes[row[3]].ok)
        batch["request_counts"] = {"total": len(rows), "completed": len(done) - failed, "failed": failed}
        if len(done) == len(rows):
            self._finish(project, batch, rows, envelopes)
        return batch

    def _finish(self, project: str, batch: dict[str, Any], rows: list[list[Any]],
                envelopes: dict[str, Envelope]) -> None:
        out = []
        for number, custom_id, error, job_id in rows:
            line = BatchLine(number, custom_id, error=error)
            out.append(output_line(line, envelopes.get(job_id) if job_id else None, self.gw.model))
        content = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in out).encode()
        output = self.files.put(project, f"{batch['id']}_output.jsonl", "batch_output", content,
                                file_id=f"file-{batch['id'].removeprefix('batch_')}-output", counted=False)
        now = int(time.time())
        status = FINAL_STATUS[batch["status"]]
        batch.update(status=status, output_file_id=output["id"], finalizing_at=now,
                     **{f"{status}_at": now})
        rt = self.gw.runtime
        rt.redis.hset(rt.keys.gateway_batch(job_ref(project, batch["id"])), "meta", json.dumps(batch))

    async def get(self, request: Request, caller: Caller) -> Response:
        return JSONResponse(await self.gw.run(self._refresh, caller.project, request.path_params["batch_id"]))

    async def list_batches(self, request: Request, caller: Caller) -> Response:
        limit = _limit(request)

        def found() -> list[dict[str, Any]]:
            rt = self.gw.runtime
            ids = cast(list[bytes], rt.redis.zrevrange(rt.keys.gateway_batches(caller.project), 0, -1))
            batches = []
            for raw_id in ids:
                try:
                    batches.append(self._refresh(caller.project, raw_id.decode()))
                except NotFound:  # expired
                    continue
                if len(batches) >= limit:
                    break
            return batches

        return JSONResponse(_list(await self.gw.run(found)))

    async def cancel(self, request: Request, caller: Caller) -> Response:
        return JSONResponse(await self.gw.run(self._cancel, caller.project, request.path_params["batch_id"]))

    def _cancel(self, project: str, batch_id: str) -> dict[str, Any]:
        batch = self._refresh(project, batch_id)
        if batch["status"] != "in_progress":
            return batch
        rt = self.gw.runtime
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        rt.redis.hset(rt.keys.gateway_batch(job_ref(project, batch_id)), "meta", json.dumps(batch))
        _, rows = self._load(project, batch_id)
        for *_, job_id in rows:
            if job_id:
                self.gw.client.cancel(job_id, project=project)
        return self._refresh(project, batch_id)
