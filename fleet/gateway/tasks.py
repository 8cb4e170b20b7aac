"""Fleet jobs over HTTP, for producers without a Celery client.

    POST   /v1/tasks              a fleet Job (fleet/core/models.py) -> {"id", "object", "status"}
    GET    /v1/tasks/{id}         its state, and its Envelope once final
    GET    /v1/tasks/{id}/events  the job's events as SSE (``event: <type>``), ending with
                                  ``event: final`` whose data is the Envelope, or with
                                  ``event: error`` (an error body with its code) when the
                                  gateway cannot follow any more (Redis away)
    DELETE /v1/tasks/{id}         cancel -> {"id", "object", "cancelled"}

The API key is the credential: the job goes through ``fleet.Client`` signed with the key's
project secret, so the prep worker verifies it like any other. The gateway assigns the id and the
project (a job naming another project is refused), and a project only ever sees its own tasks:
an id whose job record belongs to another project answers 404 ``E_NOT_FOUND``, exactly as an
unknown id does, so ids of other projects cannot even be confirmed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import redis
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from fleet.core.errors import FleetError, InputInvalid, NotFound
from fleet.core.keys import job_ref
from fleet.core.models import Job, describe_invalid
from fleet.gateway.auth import Caller
from fleet.gateway.wire import error_body, json_object, read_body, redis_failure

if TYPE_CHECKING:
    from fleet.gateway.app import Gateway

log = logging.getLogger(__name__)


def _task(job_id: str, **fields: Any) -> dict[str, Any]:
    return {"id": job_id, "object": "fleet.task", **fields}


async def _job_from(request: Request, caller: Caller, max_body_bytes: int) -> Job:
    data = json_object(await read_body(request, max_body_bytes), "a JSON object (a fleet Job)")
    if "id" in data:
        raise InputInvalid("id: the gateway assigns task ids; use idempotency_key to deduplicate")
    if data.setdefault("project", caller.project) != caller.project:
        raise InputInvalid(f"project: this key belongs to project {caller.project!r}")
    try:
        return Job.model_validate(data)
    except ValidationError as exc:
        raise InputInvalid(describe_invalid(exc)) from exc


class TaskRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def _own(self, caller: Caller, job_id: str) -> str:
        """The task's ref in the caller's own project (ids are per project, so another project's
        task is simply not there); NotFound when the project has no such task."""
        ref = job_ref(caller.project, job_id)
        record: dict[str, str] = await self.gw.run(self.gw.runtime.results.job_record, ref)
        if record.get("project") != caller.project:
            raise NotFound(f"no task {job_id!r} for this project")
        return ref

    async def submit(self, request: Request, caller: Caller) -> Response:
        job = await _job_from(request, caller, self.gw.live.settings.gateway.max_body_bytes)
        job_id = await self.gw.run(self.gw.client.submit, job, record=self.gw.key_tag(caller, job))
        return JSONResponse(_task(job_id, status="queued"))

    async def get(self, request: Request, caller: Caller) -> Response:
        job_id = request.path_params["task_id"]
        ref = await self._own(caller, job_id)
        status: dict[str, Any] = await self.gw.run(self.gw.client.status, job_id, project=caller.project)
        envelope = await self.gw.run(self.gw.runtime.results.final, ref)
        return JSONResponse(_task(job_id, status=status.get("state", "unknown"),
                                  envelope=envelope.model_dump(mode="json") if envelope else None))

    async def cancel(self, request: Request, caller: Caller) -> Response:
        job_id = request.path_params["task_id"]
        await self._own(caller, job_id)
        cancelled = await self.gw.run(self.gw.client.cancel, job_id, project=caller.project)
        return JSONResponse(_task(job_id, cancelled=cancelled))

    async def events(self, request: Request, caller: Caller) -> Response:
        job_id = request.path_params["task_id"]
        ref = await self._own(caller, job_id)
        return StreamingResponse(self._follow(caller.project, job_id, ref), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def _follow(self, project: str, job_id: str, ref: str) -> AsyncIterator[bytes]:
        """The job's events as they come, from the gateway's one shared reader
        (fleet/gateway/events.py), until the final one (or a rejection of the job's own message).
        The 200 is sent by then, so a failure (Redis away past ``gateway.broker_wait_s``) ends
        the stream with ``event: error`` carrying the error body and its code."""
        try:
            async for event in self.gw.events.follow(self.gw.runtime.keys.events(ref)):
                data = event.get("data")
                final = event["type"] == "final"
                if final:
                    envelope = await self.gw.run(self.gw.runtime.results.final, ref)
                    data = envelope.model_dump(mode="json") if envelope else data
                yield _sse_event(event["type"], data)
                if final or (event["type"] == "rejected"
                             and await self.gw.run(self.gw.runtime.results.final, ref) is not None):
                    return
        except (FleetError, redis.RedisError) as caught:
            exc = redis_failure(caught) if isinstance(caught, redis.RedisError) else caught
            log.warning("task %s events: %s (%s)", ref, exc.code.value, exc.message)
            yield _sse_event("error", error_body(exc.code, exc.message, exc.param))


def _sse_event(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
