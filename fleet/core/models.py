"""The fleet's public data shapes: the ``Job`` a project submits and the ``Envelope`` it gets back.

Both reject unknown fields, so a typo in a producer is an ``E_INPUT_INVALID`` rather than a
setting silently ignored. Messages are OpenAI chat messages plus one fleet field, ``untrusted``,
which marks material from outside (documents, web pages, tool output): such a job is never sent
with tools and its text has chat-template control tags neutralised (fleet/core/request.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleet.core.codes import Code
from fleet.core.schema import check_schema

JobKind = Literal["infer", "collect", "trim", "collect+trim+infer"]
Band = Literal["interactive", "batch"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def describe_invalid(exc: ValidationError, limit: int = 5) -> str:
    """A job's validation errors in one line that names each field (``E_INPUT_INVALID``)."""
    parts = []
    for item in exc.errors()[:limit]:
        where = ".".join(str(part) for part in item["loc"]) or "job"
        what = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
        parts.append(f"{where}: {what}")
    return "; ".join(parts)


# Fields of an answer's message that client libraries send back and vLLM ignores: name -> when
# the value is dropped (otherwise it is refused as an unknown field).
COPIED_BACK: dict[str, Callable[[Any], bool]] = {
    "refusal": lambda value: True, "annotations": lambda value: True,
    "audio": lambda value: value is None, "function_call": lambda value: value is None,
    "provider_specific_fields": lambda value: True,
}


class Message(_Strict):
    """An OpenAI chat message as vLLM takes it. ``developer`` (OpenAI's name for system
    instructions) becomes ``system``: vLLM hands the role to the chat template as it is, and the
    Qwen3 templates render only system, user, assistant and tool, so a developer message would be
    dropped unseen. An assistant message may carry the reasoning the server returned
    (``reasoning``, or vLLM's older ``reasoning_content``, read as ``reasoning``): it goes to vLLM,
    which gives it to the template (Qwen3's keeps it only for the turns after the last user
    message); on any other role vLLM ignores it, and so does the fleet. Fields a client library
    copies from an answer back into its next request and vLLM ignores are dropped: OpenAI's
    ``refusal`` and ``annotations``, ``audio`` and ``function_call`` when null, and litellm's own
    ``provider_specific_fields``."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    untrusted: bool = False

    @model_validator(mode="before")
    @classmethod
    def _openai_names(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not (COPIED_BACK.keys() & data.keys() or "reasoning_content" in data
                                              or data.get("role") == "developer"):
            return data
        data = {k: v for k, v in data.items() if not (k in COPIED_BACK and COPIED_BACK[k](v))}
        if data.get("role") == "developer":
            data["role"] = "system"
        older = data.pop("reasoning_content", None)
        if data.get("reasoning") is None:
            data["reasoning"] = older
        return data

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if not self.content:
            return ""
        return "".join(str(p.get("text", "")) for p in self.content if isinstance(p, dict))

    def to_openai(self) -> dict[str, Any]:
        drop = {"untrusted"} if self.role == "assistant" else {"untrusted", "reasoning"}
        return self.model_dump(exclude_none=True, exclude=drop)


class Source(_Strict):
    """Material to collect before inference (fleet/prep/collect.py)."""

    type: Literal["text", "file", "url"]
    text: str | None = None
    path: str | None = None
    url: str | None = None
    name: str | None = None
    untrusted: bool | None = None  # None: text is trusted, files and URLs are not
    quota_tokens: int | None = Field(None, gt=0)
    required: bool | None = None  # None: the job's on_source_error decides

    @model_validator(mode="after")
    def _one_value(self) -> Source:
        value = {"text": self.text, "file": self.path, "url": self.url}[self.type]
        if value is None:
            raise ValueError(f"a {self.type!r} source needs its {self.type if self.type != 'file' else 'path'!r} field")
        return self


class TrimPolicy(_Strict):
    """How fleet/prep/trim.py cuts material that does not fit (see fleet/prep/prepare.py)."""

    strategy: Literal["head_tail", "head", "tail"] = "head_tail"
    drop_near_duplicates: bool = True
    normalise_whitespace: bool = True
    head_fraction: float = Field(default=0.6, ge=0, le=1)  # head_tail: share of the kept text from the head


class Job(_Strict):
    # unique within the project; no "/", braces or glob characters (fleet/core/keys.py)
    id: str = Field(default_factory=lambda: uuid.uuid4().hex, pattern=r"^[A-Za-z0-9._:-]{1,128}$")
    project: str = Field(min_length=1)
    kind: JobKind = "infer"
    model: str | None = Field(None, min_length=1, max_length=256)  # None: the project's default
    messages: list[Message] = Field(default_factory=list)
    sources: list[Source] = Field(default_factory=list)
    on_source_error: Literal["fail", "drop"] = "fail"
    trim: TrimPolicy | None = None
    allow_trim: bool = True
    thinking_budget: int | None = Field(None, ge=-1)
    content_reserve: int | None = Field(None, gt=0)
    # A client's completion limit (OpenAI's max_tokens): the thinking budget gives way so the
    # content reserve fits; below the reserve the job is refused (fleet/infer/budget.py).
    max_tokens: int | None = Field(None, gt=0)
    response_schema: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    seed: int | None = None
    band: Band = "batch"
    priority: int = Field(0, ge=-10, le=10)
    deadline: float | None = None  # unix seconds
    idempotency_key: str | None = Field(None, max_length=200)
    metadata: dict[str, Any] = Field(default_factory=dict)
    submitted_at: float = Field(default_factory=time.time)

    @field_validator("response_schema")
    @classmethod
    def _usable_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # Refused here, before any slot or token is spent, not after inference (fleet/core/schema.py).
        if value is not None:
            check_schema(value)
        return value

    @model_validator(mode="after")
    def _has_input(self) -> Job:
        if self.kind in ("infer",) and not self.messages:
            raise ValueError("an infer job needs at least one message")
        if self.kind != "infer" and not self.sources and not self.messages:
            raise ValueError(f"a {self.kind} job needs sources or messages")
        return self

    @property
    def untrusted(self) -> bool:
        return any(m.untrusted for m in self.messages)


class Usage(_Strict):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    # of prompt_tokens, those vLLM's prefix cache held (its usage.prompt_tokens_details)
    cached_tokens: int = 0


class Timings(_Strict):
    queued_s: float | None = None
    first_token_s: float | None = None
    total_s: float | None = None


class Attempt(_Strict):
    number: int
    code: Code
    cause: str = ""
    finish_reason: str | None = None
    thinking_budget: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    usage: Usage = Field(default_factory=Usage)
    carried: list[str] = Field(default_factory=list)
    started_at: float = 0.0
    duration_s: float = 0.0
    backend: str = ""  # the name of the backend it ran on ([[backends]]); '' in older envelopes
    # reasoning tokens an earlier attempt cut by its backend had generated and this one continued
    # instead of generating them again (routing.continue_cut_turns = "continue")
    continued_tokens: int = 0


class Envelope(_Strict):
    """The one result shape every consumer gets, whatever happened."""

    job_id: str
    project: str
    kind: JobKind = "infer"
    code: Code
    message: str = ""
    retryable: bool = False
    attempts: list[Attempt] = Field(default_factory=list)
    content: str | None = None
    reasoning: str | None = None
    parsed: Any = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    # Tool rounds the fleet ran (project mode "run"): number, calls (id, name, arguments, error:
    # why it was not run, result: ok/content/error/duration_s), started_at, timeout_s, duration_s.
    tool_rounds: list[dict[str, Any]] = Field(default_factory=list)
    material: list[dict[str, Any]] | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    warnings: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    finished_at: float = Field(default_factory=time.time)
    # the backend that served its last model turn ('' when none ran: refused before admission)
    backend: str = ""
    # answered from the project's exact-repeat cache: no model turn ran for it (fleet/core/repeatcache.py)
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.code.ok

    @classmethod
    def failure(
        cls, job_id: str, project: str, code: Code, message: str, **extra: Any
    ) -> Envelope:
        return cls(
            job_id=job_id,
            project=project,
            code=code,
            message=message,
            retryable=code.retryable,
            **extra,
        )
