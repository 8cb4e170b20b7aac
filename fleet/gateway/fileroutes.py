"""The gateway's file routes (OpenAI ``/v1/files``), on the file store of fleet/gateway/files.py:

    POST   /v1/files                  multipart ``file`` + ``purpose=batch`` -> file object
    GET    /v1/files[?purpose=&after=&limit=&order=]  the project's files, newest first
    GET    /v1/files/{id}             the file object
    DELETE /v1/files/{id}             {"id", "object": "file", "deleted"}

``GET /v1/files/{id}/content`` is served by the batch routes (fleet/gateway/batches.py
``BatchRoutes.content``): a batch's result file is built from its batch when read, as one of the
project's batch calls; an upload's bytes are streamed from here (``upload_content``).

An upload is counted while it is received and refused (413 ``E_TOO_LARGE``) the moment it passes
``gateway.max_file_bytes``, as is a file of more than ``gateway.max_batch_lines`` lines; a body
that is not multipart with a ``file`` part and ``purpose=batch``, or a file that is not UTF-8
text, is 400 ``E_INPUT_INVALID``. Another project's file is 404 ``E_NOT_FOUND``, exactly as an
unknown id (the store's keys are the caller's project's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from fleet.core.batchfile import jsonl_lines
from fleet.core.errors import InputInvalid, NotFound, TooLarge
from fleet.gateway.auth import Caller
from fleet.gateway.files import CHUNK_BYTES, MULTIPART_SLACK, FileStore, capped_receive
from fleet.gateway.wire import list_body, paging

if TYPE_CHECKING:
    from fleet.gateway.app import Gateway


class FileRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        rt = gateway.runtime
        self.files = FileStore(rt.redis, rt.keys, lambda: gateway.live.settings.gateway)

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
        after, limit, newest_first = paging(request)
        found, more = await self.gw.run(self.files.list, caller.project,
                                        request.query_params.get("purpose"), after=after,
                                        limit=limit, newest_first=newest_first)
        return JSONResponse(list_body(found, more))

    async def file(self, request: Request, caller: Caller) -> Response:
        return JSONResponse(await self.gw.run(self.files.meta, caller.project,
                                              request.path_params["file_id"]))

    async def delete_file(self, request: Request, caller: Caller) -> Response:
        file_id = request.path_params["file_id"]
        if not await self.gw.run(self.files.delete, caller.project, file_id):
            raise NotFound(f"no file {file_id!r} for this project")
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def upload_content(gw: Gateway, files: FileStore, project: str, file_id: str) -> Response:
    """An uploaded file's bytes, read and sent ``CHUNK_BYTES`` at a time (never loaded whole)."""
    return StreamingResponse(_upload_chunks(gw, files, project, file_id), media_type="application/jsonl")


async def _upload_chunks(gw: Gateway, files: FileStore, project: str, file_id: str) -> AsyncIterator[bytes]:
    start = 0
    while chunk := await gw.run(files.body_chunk, project, file_id, start):
        yield chunk
        start += len(chunk)
        if len(chunk) < CHUNK_BYTES:
            return
