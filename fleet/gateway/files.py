"""OpenAI files of the gateway's projects (``/v1/files``), kept in Redis per project.

    {p}gwfile:{<project>/<file id>}      hash: meta (the OpenAI file object, JSON); a batch's
                                         result file also: batch, part (where its lines come from)
    {p}gwfilebody:{<project>/<file id>}  an uploaded file's bytes
    {p}gwfiles:<project>                 zset of the project's file ids, score = created_at
    {p}gwfilebytes:<project>             hash uploaded file id -> bytes, for the byte quota

Every key is named by the caller's project, so a key of project B can neither read, list nor
delete a file of project A: another project's file id is simply not there (404 ``E_NOT_FOUND``,
exactly as an unknown id, so ids cannot even be confirmed; the same for a list's ``after``).

Limits (``gateway.*``, 413 ``E_TOO_LARGE``):
- a file holds at most ``max_file_bytes``: the upload is counted while it is received
  (``capped_receive``) and refused the moment it passes the cap, so nothing larger is ever
  spooled or stored;
- a project holds at most ``max_files`` uploaded files and ``max_project_bytes`` bytes at once:
  an upload is added to the index and the byte table, the byte table (uploads only) is counted,
  and the upload is taken back when over, so
  concurrent uploads may be refused together but never exceed either; deleting a file frees its
  share at once;
- everything expires after ``files_ttl_s``; index and byte-table entries of expired files are
  pruned by score (every file has the same TTL).

A batch's output and error files (``stage_result``) store no bytes: their meta names the batch
and part, and their content is built from the batch's lines and its jobs' results when read
(fleet/gateway/batches.py), so a batch's results are never stored twice and take nothing of
``max_project_bytes`` nor of ``max_files`` (a project's finished batches never stop it from
uploading the next batch's input; ``max_batches`` bounds them). Content is sent in chunks
(``body_chunks``, ``CHUNK_BYTES`` a read), never loaded whole.

Lists are newest first (``order=asc``: oldest first), ``limit`` at a time, with OpenAI's cursor:
``after`` is the id of the previous page's last item and ``has_more`` says whether another page
follows (``page``), which is what the SDK's auto-pagination follows.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar, cast

import redis

from fleet.core.config import GatewaySettings
from fleet.core.errors import NotFound, TooLarge
from fleet.core.keys import Keys, job_ref

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
MULTIPART_SLACK = 64 * 1024  # multipart headers and boundaries around the file's bytes
CHUNK_BYTES = 1 << 20  # an uploaded file's content is read and sent this much at a time
T = TypeVar("T")


def capped_receive(receive: Receive, limit: int) -> Receive:
    """``receive`` that refuses a request body once it passes ``limit`` bytes."""
    seen = 0

    async def wrapped() -> MutableMapping[str, Any]:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise TooLarge(f"file: larger than gateway.max_file_bytes ({limit - MULTIPART_SLACK} bytes)")
        return message

    return wrapped


def page(client: redis.Redis, index: str, *, after: str | None, limit: int, newest_first: bool,
         load: Callable[[str], T | None]) -> tuple[list[T], bool]:
    """One page of a zset index of ids: up to ``limit`` items that ``load`` finds (None skips an
    id: expired, or filtered out) after the id ``after``; and whether more follow. An ``after``
    that is not in the index is NotFound, as an unknown id."""
    start = 0
    if after is not None:
        rank = client.zrevrank(index, after) if newest_first else client.zrank(index, after)
        if rank is None:
            raise NotFound(f"after: no {after!r} in this project's list", param="after")
        start = int(cast(int, rank)) + 1
    found: list[T] = []
    step = limit + 1
    while len(found) <= limit:
        read = client.zrevrange if newest_first else client.zrange
        ids = cast(list[bytes], read(index, start, start + step - 1))
        for raw in ids:
            item = load(raw.decode())
            if item is not None:
                found.append(item)
                if len(found) > limit:
                    break
        if len(ids) < step:
            break
        start += step
    return found[:limit], len(found) > limit


class FileStore:
    def __init__(self, client: redis.Redis, keys: Keys, settings: Callable[[], GatewaySettings]) -> None:
        self.redis = client
        self.keys = keys
        self._settings = settings  # the settings in force (reloaded with the keys)

    def _prune(self, project: str, now: float) -> None:
        index = self.keys.gateway_files(project)
        expired = cast(list[bytes], self.redis.zrangebyscore(
            index, "-inf", now - self._settings().files_ttl_s))
        if expired:
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(index, *expired)
                pipe.hdel(self.keys.gateway_file_bytes(project), *expired)
                pipe.execute()

    def put(self, project: str, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
        """Store a client's upload, held to max_file_bytes, max_files and max_project_bytes; its
        OpenAI file object."""
        settings = self._settings()
        if len(content) > settings.max_file_bytes:
            raise TooLarge(f"file: {len(content)} bytes, over gateway.max_file_bytes "
                           f"({settings.max_file_bytes})")
        now = time.time()
        file_id = f"file-{uuid.uuid4().hex}"
        index, sizes = self.keys.gateway_files(project), self.keys.gateway_file_bytes(project)
        self._prune(project, now)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(index, {file_id: now})
            pipe.hset(sizes, file_id, len(content))
            pipe.hlen(sizes)  # uploads only: a batch's result files are not in the byte table
            pipe.hvals(sizes)
            *_, count, held = pipe.execute()
        over = None
        if count > settings.max_files:
            over = f"the project already holds gateway.max_files ({settings.max_files})"
        elif (total := sum(int(size) for size in held)) > settings.max_project_bytes:
            over = (f"{len(content)} more bytes would make {total}, over gateway.max_project_bytes "
                    f"({settings.max_project_bytes})")
        if over:
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(index, file_id)
                pipe.hdel(sizes, file_id)
                pipe.execute()
            raise TooLarge(f"files: {over}; delete some or wait for them to expire")
        ttl = settings.files_ttl_s
        with self.redis.pipeline(transaction=True) as pipe:
            meta = self._stage(pipe, project, file_id, filename, purpose, len(content), now)
            body = self.keys.gateway_file_body(job_ref(project, file_id))
            pipe.set(body, content, ex=ttl)
            pipe.hset(sizes, file_id, len(content))
            pipe.expire(sizes, ttl)
            pipe.execute()
        return meta

    def stage_result(self, pipe: redis.client.Pipeline, project: str, file_id: str, filename: str,
                     size: int, now: float, batch_id: str, part: str) -> dict[str, Any]:
        """Queue the writes of a batch's result file on ``pipe`` (in the transaction that gives the
        batch its final state): meta only, its content is the batch's ``part``; its file object."""
        meta = self._stage(pipe, project, file_id, filename, "batch_output", size, now)
        pipe.hset(self.keys.gateway_file(job_ref(project, file_id)),
                  mapping={"batch": batch_id, "part": part})
        return meta

    def _stage(self, pipe: redis.client.Pipeline, project: str, file_id: str, filename: str,
               purpose: str, size: int, now: float) -> dict[str, Any]:
        ttl = self._settings().files_ttl_s
        meta = {"id": file_id, "object": "file", "bytes": size, "created_at": int(now),
                "expires_at": int(now + ttl), "filename": filename,
                "purpose": purpose, "status": "processed", "status_details": None}
        key = self.keys.gateway_file(job_ref(project, file_id))
        index = self.keys.gateway_files(project)
        pipe.hset(key, "meta", json.dumps(meta))
        pipe.expire(key, ttl)
        pipe.zadd(index, {file_id: now})
        pipe.expire(index, ttl)
        return meta

    def _meta(self, project: str, file_id: str) -> dict[str, Any] | None:
        raw = self.redis.hget(self.keys.gateway_file(job_ref(project, file_id)), "meta")
        return json.loads(raw) if raw else None

    def meta(self, project: str, file_id: str) -> dict[str, Any]:
        meta = self._meta(project, file_id)
        if meta is None:
            raise NotFound(f"no file {file_id!r} for this project")
        return meta

    def source(self, project: str, file_id: str) -> tuple[str, str] | None:
        """(batch id, part) of a batch's result file; None for an upload. NotFound if neither."""
        meta, batch, part = self.redis.hmget(self.keys.gateway_file(job_ref(project, file_id)),
                                             ["meta", "batch", "part"])
        if meta is None:
            raise NotFound(f"no file {file_id!r} for this project")
        if batch is None or part is None:
            return None
        return cast(bytes, batch).decode(), cast(bytes, part).decode()

    def content(self, project: str, file_id: str) -> bytes:
        """An uploaded file's bytes, whole (a batch's input, read to be parsed)."""
        ref = job_ref(project, file_id)
        raw = self.redis.get(self.keys.gateway_file_body(ref)) or self._stored_whole(ref)
        if raw is None:
            raise NotFound(f"no file {file_id!r} for this project (or it holds no upload)")
        return cast(bytes, raw)

    def body_chunk(self, project: str, file_id: str, start: int) -> bytes:
        """``CHUNK_BYTES`` of an uploaded file from ``start`` (empty past its end)."""
        ref = job_ref(project, file_id)
        chunk = cast(bytes, self.redis.getrange(self.keys.gateway_file_body(ref), start,
                                                start + CHUNK_BYTES - 1))
        return chunk if chunk or start else self._stored_whole(ref) or b""

    def _stored_whole(self, ref: str) -> bytes | None:
        """The bytes of a file stored whole in its meta hash (field ``content``), as gateways
        before the body key kept uploads and result files; such files are gone once
        ``files_ttl_s`` has passed since the upgrade, and this read with them."""
        return cast(bytes | None, self.redis.hget(self.keys.gateway_file(ref), "content"))

    def delete(self, project: str, file_id: str) -> bool:
        ref = job_ref(project, file_id)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self.keys.gateway_files(project), file_id)
            pipe.hdel(self.keys.gateway_file_bytes(project), file_id)
            pipe.delete(self.keys.gateway_file_body(ref))
            pipe.delete(self.keys.gateway_file(ref))
            *_, deleted = pipe.execute()
        return bool(deleted)

    def list(self, project: str, purpose: str | None, *, after: str | None, limit: int,
             newest_first: bool = True) -> tuple[list[dict[str, Any]], bool]:
        """One page of the project's files (``page``), and whether more follow."""
        self._prune(project, time.time())

        def load(file_id: str) -> dict[str, Any] | None:
            meta = self._meta(project, file_id)
            return meta if meta and (purpose is None or meta["purpose"] == purpose) else None

        return page(self.redis, self.keys.gateway_files(project), after=after, limit=limit,
                    newest_first=newest_first, load=load)
