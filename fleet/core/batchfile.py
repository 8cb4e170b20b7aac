"""The batch JSONL formats: OpenAI Batch API files in, one result line per input line out. Read
and written by ``fleet batch`` (fleet/cli/batch.py) and by the gateway's ``/v1/batches``
(fleet/gateway/batches.py), so both take and give the same lines.

Input lines are either OpenAI batch requests
    {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
or the fleet's own job lines (a ``Job`` as JSON; ``project`` defaults to ``--project``; ``sources``
may replace finished messages). Output lines follow the OpenAI batch output shape
    {"id", "custom_id", "response": {"status_code", "request_id", "body": ...} | null,
     "error": {"code", "message"} | null, "code": "<fleet message code>"}
as results arrive (not in input order: match them by ``custom_id``, which must be unique in a
file). ``body`` is a chat.completion for an answer; an error of the backend (E_UPSTREAM_*) is a
response too, as OpenAI reports one: its HTTP status and ``body.error`` {message, type, code};
any other error is ``error`` {code, message} with ``response`` null. A malformed line becomes an
error line (E_INPUT_INVALID) for that line only.

Job ids: a line without its own ``id`` gets one derived from the batch (the file's content) and
its ``custom_id`` (``batch_job_id``), so the same file sent again - ``fleet batch --resume`` after a
crash, or ``--collect`` to fetch results later - names the same jobs: the fleet runs each once.

Lines end at LF only (a CR before it is tolerated): JSON encoders leave U+2028, U+2029 and U+0085
raw inside strings, and ``str.splitlines`` breaks on them, which would cut a valid line in two.

Results are matched to lines through dicts (job id -> lines, job id -> envelope), so a batch of any
size costs a constant amount of work per result; two lines may share a job id (the same
idempotency key).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from fleet.core.codes import Code
from fleet.core.limits import loads
from fleet.core.models import Envelope, Job, describe_invalid

CHAT_URL = "/v1/chat/completions"
# Body fields of an OpenAI request that the fleet maps onto a Job; anything else is refused.
_BODY_FIELDS = {
    "model", "messages", "thinking_token_budget", "max_tokens", "max_completion_tokens",
    "response_format", "tools", "tool_choice", "temperature", "seed", "stream", "stream_options",
    "priority", "chat_template_kwargs", "top_p", "metadata",
}


# What the backend's errors are as HTTP: an OpenAI batch reports them as the request's response.
UPSTREAM_STATUS = {
    Code.E_UPSTREAM_REJECTED: 400, Code.E_UPSTREAM_ERROR: 500, Code.E_STREAM_DROPPED: 502,
    Code.E_UPSTREAM_UNAVAILABLE: 503, Code.E_UPSTREAM_TIMEOUT: 504, Code.E_CONNECT_TIMEOUT: 504,
    Code.E_FIRST_TOKEN_TIMEOUT: 504, Code.E_STREAM_STALLED: 504,
}


@dataclass
class BatchLine:
    number: int
    custom_id: str
    job: Job | None = None
    error: str | None = None
    code: Code = Code.E_INPUT_INVALID  # the code of ``error``


def _refuse(fields: Iterable[str], refused: Collection[str]) -> None:
    named = sorted(set(fields) & set(refused))
    if named:
        raise ValueError(f"{named[0]}: not allowed in this batch (the caller's key decides it)")


def _job_from_openai(line: dict[str, Any], project: str, refused: Collection[str]) -> Job:
    if line.get("method", "POST") != "POST" or line.get("url", CHAT_URL) != CHAT_URL:
        raise ValueError(f"only POST {CHAT_URL} is supported")
    body = line.get("body")
    if not isinstance(body, dict):
        raise ValueError("'body' must be an object")
    _refuse(body, refused)
    unknown = sorted(set(body) - _BODY_FIELDS)
    if unknown:
        raise ValueError(f"unsupported body fields: {', '.join(unknown)}")
    budget = body.get("thinking_token_budget")
    # the completion limit, planned as the gateway's chat plans it (fleet/infer/budget.py)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    schema = None
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
    data = {
        "project": project, "model": body.get("model"), "messages": body.get("messages"),
        "thinking_budget": budget,
        "max_tokens": limit, "response_schema": schema, "tools": body.get("tools"),
        "tool_choice": body.get("tool_choice"), "temperature": body.get("temperature"),
        "seed": body.get("seed"),
        "metadata": {**(body.get("metadata") or {}), "custom_id": line.get("custom_id")},
    }
    return Job.model_validate({k: v for k, v in data.items() if v is not None})


def batch_job_id(batch: str, custom_id: str) -> str:
    """The job id of a line without one: the same file and custom_id always give the same id."""
    return f"b{batch}-{hashlib.sha256(custom_id.encode()).hexdigest()[:20]}"


def batch_tag(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()[:12]


def parse_line(text: str, project: str, number: int, batch: str | None = None,
               refused: Collection[str] = ()) -> BatchLine:
    """One input line as a Job, or as an error line. ``refused``: fields a line may not set (the
    gateway's batches, whose key decides band and order): such a line is an error naming it."""
    custom_id = f"line-{number}"
    try:
        line = loads(text)  # NestedTooDeep (a ValueError) past MAX_JSON_DEPTH
        if not isinstance(line, dict):
            raise ValueError("a line must be a JSON object")
        custom_id = str(line.get("custom_id") or custom_id)
        if "body" in line or "url" in line or "method" in line:
            job = _job_from_openai(line, project, refused)
        else:
            _refuse(line, refused)
            fields = {k: v for k, v in line.items() if k != "custom_id"}
            job = Job.model_validate({"project": project, **fields,
                                      "metadata": {**fields.get("metadata", {}),
                                                   "custom_id": custom_id}})
        if job.project != project:
            raise ValueError(f"line is for project {job.project!r}, batch is for {project!r}")
        if batch is not None and "id" not in line:
            job = job.model_copy(update={"id": batch_job_id(batch, custom_id)})
        return BatchLine(number, custom_id, job=job)
    except ValidationError as exc:
        return BatchLine(number, custom_id, error=f"line {number}: {describe_invalid(exc, 1)}")
    except (ValueError, TypeError) as exc:
        return BatchLine(number, custom_id, error=f"line {number}: {exc}")


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSONL text: split at LF only, a CR before the LF dropped."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def parse_lines(lines: Iterable[str], project: str, batch: str | None = None,
                refused: Collection[str] = ()) -> list[BatchLine]:
    return [parse_line(text, project, n, batch, refused)
            for n, text in enumerate(lines, 1) if text.strip()]


def duplicate_custom_ids(lines: Iterable[BatchLine]) -> list[str]:
    counts = Counter(line.custom_id for line in lines)
    return sorted(custom_id for custom_id, n in counts.items() if n > 1)


class ResultMatcher:
    """Envelopes onto input lines: O(1) per envelope, O(1) per line."""

    def __init__(self, job_of: Mapping[int, str]) -> None:
        self._job_of = dict(job_of)  # line number -> job id
        self._lines_per_job = Counter(self._job_of.values())
        self._lines_of: dict[str, list[int]] = {}
        for number, job_id in self._job_of.items():
            self._lines_of.setdefault(job_id, []).append(number)
        self.envelopes: dict[str, Envelope] = {}

    def add(self, envelope: Envelope) -> int:
        """Record a result; the number of lines it answers (0 for an unknown or repeated job)."""
        if envelope.job_id in self.envelopes:
            return 0
        self.envelopes[envelope.job_id] = envelope
        return self._lines_per_job.get(envelope.job_id, 0)

    def lines_of(self, job_id: str) -> list[int]:
        """The line numbers a job answers."""
        return self._lines_of.get(job_id, [])

    def envelope_for(self, line: BatchLine) -> Envelope | None:
        job_id = self._job_of.get(line.number)
        return None if job_id is None else self.envelopes.get(job_id)


def output_line(line: BatchLine, envelope: Envelope | None, model: str) -> dict[str, Any]:
    if envelope is None:
        code = line.code if line.error else Code.E_INTERNAL
        message = line.error or "no result"
        return {"id": f"batch_req_line{line.number}", "custom_id": line.custom_id,
                "response": None, "error": {"code": code.value, "message": message},
                "code": code.value}
    out: dict[str, Any] = {"id": f"batch_req_{envelope.job_id}", "custom_id": line.custom_id,
                           "code": envelope.code.value}
    if envelope.code in UPSTREAM_STATUS:
        error = {"message": envelope.message, "type": "upstream_error", "param": None,
                 "code": envelope.code.value}
        out.update(response={"status_code": UPSTREAM_STATUS[envelope.code],
                             "request_id": envelope.job_id, "body": {"error": error}}, error=None)
        return out
    if not envelope.ok:
        out.update(response=None, error={"code": envelope.code.value, "message": envelope.message})
        return out
    reply: dict[str, Any] = {"role": "assistant", "content": envelope.content, "refusal": None}
    if envelope.reasoning:
        reply["reasoning"] = envelope.reasoning
    if envelope.tool_calls:
        reply["tool_calls"] = envelope.tool_calls
    finish = "tool_calls" if envelope.tool_calls else (
        "length" if envelope.code == Code.OK_TRUNCATED else "stop")
    usage = envelope.usage
    body = {
        "id": f"chatcmpl-{envelope.job_id}", "object": "chat.completion",
        "created": int(envelope.finished_at), "model": model,
        "choices": [{"index": 0, "message": reply, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": usage.prompt_tokens,
                  "completion_tokens": usage.completion_tokens,
                  "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
                  "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}},
        "fleet": {"attempts": len(envelope.attempts), "warnings": envelope.warnings,
                  "parsed": envelope.parsed},
    }
    out.update(response={"status_code": 200, "request_id": envelope.job_id, "body": body},
               error=None)
    return out
