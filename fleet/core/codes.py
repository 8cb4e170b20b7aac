"""The message-code catalogue: every outcome the fleet reports has exactly one code from here.

A code has a stable name (what consumers match on), a stable number (for logs and metrics that
want an integer), a retryable flag (whether trying the same job again can succeed, and whether
the inference worker retries it itself) and a one-line meaning. docs/codes.md's table is generated
from ``CATALOGUE`` (``python -m fleet.core.codes``) and a test checks that the two agree.

Numbering: 0-99 success, 100-199 the job itself, 200-299 the model's answer, 300-399 the
backend, 400-499 the job's life cycle, 500+ the fleet itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Code(StrEnum):
    OK = "OK"
    OK_TRUNCATED = "OK_TRUNCATED"
    OK_THINKING_FORCED = "OK_THINKING_FORCED"
    OK_MATERIAL = "OK_MATERIAL"
    E_INPUT_INVALID = "E_INPUT_INVALID"
    E_AUTH = "E_AUTH"
    E_PROMPT_TOO_LONG = "E_PROMPT_TOO_LONG"
    E_COLLECT_FAILED = "E_COLLECT_FAILED"
    E_NOT_FOUND = "E_NOT_FOUND"
    E_TOO_LARGE = "E_TOO_LARGE"
    E_MESSAGE_REFUSED = "E_MESSAGE_REFUSED"
    E_TOOL_REJECTED = "E_TOOL_REJECTED"
    E_THINK_LOOP = "E_THINK_LOOP"
    E_EMPTY_ANSWER = "E_EMPTY_ANSWER"
    E_OUTPUT_INVALID = "E_OUTPUT_INVALID"
    E_TOOL_INVALID = "E_TOOL_INVALID"
    E_TOOL_TIMEOUT = "E_TOOL_TIMEOUT"
    E_TOOL_FAILED = "E_TOOL_FAILED"
    E_UPSTREAM_TIMEOUT = "E_UPSTREAM_TIMEOUT"
    E_CONNECT_TIMEOUT = "E_CONNECT_TIMEOUT"
    E_FIRST_TOKEN_TIMEOUT = "E_FIRST_TOKEN_TIMEOUT"
    E_STREAM_STALLED = "E_STREAM_STALLED"
    E_STREAM_DROPPED = "E_STREAM_DROPPED"
    E_UPSTREAM_UNAVAILABLE = "E_UPSTREAM_UNAVAILABLE"
    E_UPSTREAM_ERROR = "E_UPSTREAM_ERROR"
    E_UPSTREAM_REJECTED = "E_UPSTREAM_REJECTED"
    E_CANCELLED = "E_CANCELLED"
    E_DEADLINE = "E_DEADLINE"
    E_QUEUE_TIMEOUT = "E_QUEUE_TIMEOUT"
    E_BUSY = "E_BUSY"
    E_QUOTA_EXCEEDED = "E_QUOTA_EXCEEDED"
    E_INTERNAL = "E_INTERNAL"
    E_BROKER_UNAVAILABLE = "E_BROKER_UNAVAILABLE"
    E_BROKER_UNSAFE = "E_BROKER_UNSAFE"

    @property
    def info(self) -> CodeInfo:
        return CATALOGUE[self]

    @property
    def number(self) -> int:
        return CATALOGUE[self].number

    @property
    def retryable(self) -> bool:
        return CATALOGUE[self].retryable

    @property
    def ok(self) -> bool:
        return self.value.startswith("OK")


@dataclass(frozen=True)
class CodeInfo:
    number: int
    retryable: bool
    meaning: str


CATALOGUE: dict[Code, CodeInfo] = {
    Code.OK: CodeInfo(0, False, "The answer came back complete and passed every check."),
    Code.OK_TRUNCATED: CodeInfo(
        1, False, "An answer came back but was cut by max_tokens (finish_reason length)."
    ),
    Code.OK_THINKING_FORCED: CodeInfo(
        2, False, "The thinking budget ran out and vLLM forced </think>; the answer still came."
    ),
    Code.OK_MATERIAL: CodeInfo(
        3, False, "A collect or trim job finished; the material is in the envelope."
    ),
    Code.E_INPUT_INVALID: CodeInfo(
        100, False, "The job is malformed: unknown field, bad type or an impossible setting."
    ),
    Code.E_AUTH: CodeInfo(
        101, False, "Bad signature, unknown project, stale timestamp, replayed nonce, another "
        "project's record, or a prepared job without the workers' seal."
    ),
    Code.E_PROMPT_TOO_LONG: CodeInfo(
        102, False, "Prompt plus max_tokens cannot fit max_model_len or the project's budget."
    ),
    Code.E_COLLECT_FAILED: CodeInfo(
        103, False, "A required source could not be collected (the source and reason are named)."
    ),
    Code.E_NOT_FOUND: CodeInfo(
        104, False, "No such job in its project (never submitted, or its record expired after "
        "result_ttl_s or was lost with the broker's data; a gateway batch's line whose job is gone), "
        "or the gateway has no such task, file, batch, model or route for this key's project."
    ),
    Code.E_TOO_LARGE: CodeInfo(
        105, False, "A gateway request body, file or batch is over the size or line limit, or a project over its "
        "count or byte quota of files or batches (413)."
    ),
    Code.E_MESSAGE_REFUSED: CodeInfo(
        106, False, "A worker refused a broker message before running anything: not one of the "
        "fleet's tasks (Celery's built-ins included), or carrying callbacks, errbacks, a chain, "
        "chord, group, eta or headers the fleet never sends (the rejections stream names it)."
    ),
    Code.E_TOOL_REJECTED: CodeInfo(
        107, False, "The request brought a tool its project's allowed_tools does not name, and the project "
        "refuses such requests (disallowed_tools = \"refuse\"; the gateway: 400 naming the tool)."
    ),
    Code.E_THINK_LOOP: CodeInfo(
        200, True, "The reasoning looped or stalled on every attempt; no answer was produced."
    ),
    Code.E_EMPTY_ANSWER: CodeInfo(
        201, True, "The model finished without any answer content, even with a larger reserve."
    ),
    Code.E_OUTPUT_INVALID: CodeInfo(
        202, True, "The answer failed the job's JSON Schema or text checks after re-asking."
    ),
    Code.E_TOOL_INVALID: CodeInfo(
        203, False, "The model kept calling tools with an unknown name or arguments that fail "
        "the tool's schema, after being told the error each time."
    ),
    Code.E_TOOL_TIMEOUT: CodeInfo(
        410, False, "A tool the model called did not answer within its timeout."
    ),
    Code.E_TOOL_FAILED: CodeInfo(
        411, False, "A tool the model called failed, or the job used up its tool rounds."
    ),
    Code.E_UPSTREAM_TIMEOUT: CodeInfo(
        300, True, "An attempt ran past its total time limit; the stream was closed."
    ),
    Code.E_CONNECT_TIMEOUT: CodeInfo(
        301, True, "The backend did not accept the connection in time."
    ),
    Code.E_FIRST_TOKEN_TIMEOUT: CodeInfo(
        302, True, "No first token arrived within the first-token timeout."
    ),
    Code.E_STREAM_STALLED: CodeInfo(
        303, True, "The stream went silent for longer than the idle-gap timeout."
    ),
    Code.E_STREAM_DROPPED: CodeInfo(
        304, True, "The connection closed in the middle of the stream."
    ),
    Code.E_UPSTREAM_UNAVAILABLE: CodeInfo(
        310, True, "The backend is down or busy (connection refused, 502/503/504, dead engine)."
    ),
    Code.E_UPSTREAM_ERROR: CodeInfo(
        311, True, "The backend failed the request (HTTP 500 or an error event mid-stream)."
    ),
    Code.E_UPSTREAM_REJECTED: CodeInfo(
        312, False, "The backend refused the request as invalid (HTTP 400/404/422)."
    ),
    Code.E_CANCELLED: CodeInfo(400, False, "The job was cancelled by a caller."),
    Code.E_DEADLINE: CodeInfo(
        401, False, "The job's deadline passed before it could finish (a gateway batch's line: "
        "not done within the batch's completion window)."
    ),
    Code.E_QUEUE_TIMEOUT: CodeInfo(
        402, True, "A gateway request waited past gateway.max_queue_wait_s for admission (429)."
    ),
    Code.E_BUSY: CodeInfo(
        403, True, "A gateway project already has gateway.batch_calls_per_project batch calls "
        "in flight (429 with Retry-After): its other batch calls wait for none of them; or a "
        "gateway connection over gateway.max_connections_per_address (429) or "
        "gateway.max_connections (503), answered and closed at once."
    ),
    Code.E_QUOTA_EXCEEDED: CodeInfo(
        404, True, "The project's quota (projects.<name>.quota) has no room for the turn: with "
        "over = \"refuse\" a new job or gateway request while its window is full (429 with "
        "Retry-After and x-ratelimit-* headers), a gateway request still held by its quota after "
        "gateway.max_queue_wait_s, or a job whose next turn grew past a token limit; the message "
        "names the limit and when its window resets. A request larger than a token limit is "
        "E_INPUT_INVALID (400)."
    ),
    Code.E_INTERNAL: CodeInfo(
        500, True, "A fault inside the fleet; the job was closed so nothing is lost."
    ),
    Code.E_BROKER_UNAVAILABLE: CodeInfo(
        501, True, "The broker (Redis at broker_url) does not answer; nothing was sent or read "
        "(the gateway: 503 with Retry-After)."
    ),
    Code.E_BROKER_UNSAFE: CodeInfo(
        502, False, "The broker's Redis keeps no append-only file or may evict keys, and "
        "[redis] on_unsafe = \"refuse\" (docs/operations.md)."
    ),
}


def markdown_table() -> str:
    """docs/codes.md's table, generated so the two never drift apart."""
    rows = ["| code | number | retryable | meaning |", "|---|---|---|---|"]
    for code, info in CATALOGUE.items():
        rows.append(
            f"| `{code.value}` | {info.number} | {'yes' if info.retryable else 'no'} "
            f"| {info.meaning} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
