"""OpenAI files of the gateway's projects (``/v1/files``), kept in Redis per project.

    {p}gwfile:{<project>/<file id>}  hash: meta (the OpenAI file object, JSON), content (bytes)
    {p}gwfiles:<project>             zset of the project's file ids, score = created_at

Every key is named by the caller's project, so a key of project B can neither read, list nor
delete a file of project A: another project's file id is simply not there (404 ``E_NOT_FOUND``,
exactly as an unknown id, so ids cannot even be confirmed).

Limits (``gateway.*``, 413 ``E_TOO_LARGE``):
- a file holds at most ``max_file_bytes``: the upload is counted while it is received
  (``capped_receive``) and refused the moment it passes the cap, so nothing larger is ever
  spooled or stored;
- a project holds at most ``max_files`` uploads at once: an upload is added to the index, counted,
  and taken back when over, so concurrent uploads may be refused together but never exceed it;
- everything expires after ``files_ttl_s``; index entries of expired files are pruned by score
  (every file has the same TTL). A batch's output file is always stored (batches have their own
  cap) and, like any file, counts against ``max_files`` for later uploads.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

import redis

from fleet.core.config import GatewaySettings
from fleet.core.errors import NotFound, TooLarge
from fleet.core.keys import Keys, job_ref

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
MULTIPART_SLACK = 64 * 1024  # multipart headers and boundaries around the file's bytes


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


class FileStore:
    def __init__(self, client: redis.Redis, keys: Keys, settings: Callable[[], GatewaySettings]) -> None:
        self.redis = client
        self.keys = keys
        self._settings = settings  # the settings in force (reloaded with the keys)

    def _prune(self, project: str, now: float) -> None:
        self.redis.zremrangebyscore(self.keys.gateway_files(project), "-inf",
                                    now - self._settings().files_ttl_s)

    def put(self, project: str, filename: str, purpose: str, content: bytes, *,
            file_id: str | None = None, counted: bool = True) -> dict[str, Any]:
        """Store one file; its OpenAI file object. ``counted``: a client's upload, held to
        max_file_bytes and max_files; a batch's output file (the fleet's own, as large as its
        results) is neither, or a large batch could never finish."""
        settings = self._settings()
        if counted and len(content) > settings.max_file_bytes:
            raise TooLarge(f"file: {len(content)} bytes, over gateway.max_file_bytes "
                           f"({settings.max_file_bytes})")
        now = time.time()
        file_id = file_id or f"file-{uuid.uuid4().hex}"
        index = self.keys.gateway_files(project)
        self._prune(project, now)
        self.redis.zadd(index, {file_id: now})
        if counted and self.redis.zcard(index) > settings.max_files:
            self.redis.zrem(index, file_id)
            raise TooLarge(f"files: the project already holds gateway.max_files "
                           f"({settings.max_files}); delete some or wait for them to expire")
        meta = {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(now),
                "expires_at": int(now + settings.files_ttl_s), "filename": filename,
                "purpose": purpose, "status": "processed", "status_details": None}
        key = self.keys.gateway_file(job_ref(project, file_id))
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"meta": json.dumps(meta), "content": content})
            pipe.expire(key, settings.files_ttl_s)
            pipe.expire(index, settings.files_ttl_s)
            pipe.execute()
        return meta

    def meta(self, project: str, file_id: str) -> dict[str, Any]:
        raw = self.redis.hget(self.keys.gateway_file(job_ref(project, file_id)), "meta")
        if raw is None:
            raise NotFound(f"no file {file_id!r} for this project")
        meta: dict[str, Any] = json.loads(raw)
        return meta

    def content(self, project: str, file_id: str) -> bytes:
        raw = self.redis.hget(self.keys.gateway_file(job_ref(project, file_id)), "content")
        if raw is None:
            raise NotFound(f"no file {file_id!r} for this project")
        return raw if isinstance(raw, bytes) else str(raw).encode()

    def delete(self, project: str, file_id: str) -> bool:
        self.redis.zrem(self.keys.gateway_files(project), file_id)
        return bool(self.redis.delete(self.keys.gateway_file(job_ref(project, file_id))))

    def list(self, project: str, purpose: str | None, limit: int) -> list[dict[str, Any]]:
        """The project's files, newest first."""
        self._prune(project, time.time())
        found = []
        for raw_id in cast(list[bytes], self.redis.zrevrange(self.keys.gateway_files(project), 0, -1)):
            file_id = raw_id.decode()
            raw = self.redis.hget(self.keys.gateway_file(job_ref(project, file_id)), "meta")
            meta = json.loads(raw) if raw else None
            if meta and (purpose is None or meta["purpose"] == purpose):
                found.append(meta)
                if len(found) >= limit:
                    break
        return found
