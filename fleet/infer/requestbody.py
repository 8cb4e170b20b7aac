"""What goes to vLLM: the body of one chat request and its seed, built here for both paths that
send one, the queue's attempt loop (fleet/infer/attempts.py) and the gateway's chat
(fleet/gateway/app.py builds a request's first attempt, fleet/gateway/chat.py a loop retry), so
the two cannot drift apart. The body, in this order (fleet/core/request.py decides messages and
tools)::

    messages               untrusted parts neutralised and fenced; retry notes (carry-over,
                           re-ask) appended to the leading system message
    max_completion_tokens  plan.max_tokens = thinking budget + content reserve (a client's
                           own max_tokens lowers the budget: fleet/infer/budget.py, on both
                           paths). Only this field: vLLM lets it
                           win over the deprecated max_tokens, and sending one number keeps the
                           two from ever disagreeing
    thinking_token_budget  TOP LEVEL (anywhere else vLLM silently drops it); -1 = unlimited
    stream, stream_options {"include_usage": true, "continuous_usage_stats": true}: the usage
                           chunk gives reasoning_tokens; every chunk carries the completion
                           tokens so far (vLLM's running count), so a turn cut mid-stream (its
                           worker dead, its stream dropped) is counted exactly as far as it was
                           received
    request_id             f"{job id}-{attempt}" (also X-Request-Id)
    seed                   ``attempt_seed``: a new one every attempt, ``SEED_STEP`` apart. The
                           first: the job's own, else one drawn from the job id on the queue
                           path (``job_seed``); a gateway request without one sends none
    temperature            the job's, else DEFAULT_TEMPERATURE (``base_temperature``; the queue
                           path raises it after an answer-level failure)
    (sampling)             the gateway's passthrough fields (fleet/gateway/wire.py PASSTHROUGH)
    cache_salt             the project's (fleet/core/seal.py ``cache_salt``: its own, or its
                           cache group's), so vLLM's prefix cache never serves one project's
                           blocks to another's prompt; set after the passthrough, never a client's
    response_format        json_schema of the job or project (fleet/infer/validate.py)
    tools, tool_choice     as allowed; once tools are off only ``tool_choice: "none"``

Nothing here fails: the callers have checked every value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from fleet.core.models import Job

DEFAULT_TEMPERATURE = 0.6  # Qwen3 thinking models' recommended sampling
SEED_STEP = 1_000_003  # between the seeds of two attempts of one request


def base_temperature(requested: float | None) -> float:
    """The temperature of a request's first attempt: its own, else DEFAULT_TEMPERATURE."""
    return requested if requested is not None else DEFAULT_TEMPERATURE


def attempt_seed(base: int, number: int) -> int:
    """The seed of attempt ``number`` (1 the first) of a request whose first seed is ``base``:
    each attempt samples anew."""
    return (base + (number - 1) * SEED_STEP) % (2**31)


def job_seed(job: Job, number: int) -> int:
    """The queue path's seed of attempt ``number``: from the job's own, else from its id (the
    same in every delivery of the job)."""
    base = job.seed
    if base is None:
        base = int(hashlib.sha256(job.id.encode()).hexdigest()[:8], 16)
    return attempt_seed(base, number)


def request_id(job_id: str, number: int) -> str:
    return f"{job_id}-{number}"


def request_body(job_id: str, number: int, messages: list[dict[str, Any]], *, max_tokens: int,
                 thinking_budget: int, seed: int | None, temperature: float, cache_salt: str,
                 sampling: Mapping[str, Any] | None = None,
                 response_format: dict[str, Any] | None = None,
                 tools: list[dict[str, Any]] | None = None,
                 tool_choice: str | dict[str, Any] | None = None,
                 tools_off: bool = False) -> dict[str, Any]:
    """The body of attempt ``number`` of job ``job_id`` (see the module doc); a None is left out."""
    # every chunk says the tokens so far: a turn cut mid-stream is counted exactly
    options = {"include_usage": True, "continuous_usage_stats": True}
    body: dict[str, Any] = {
        "messages": messages,
        "max_completion_tokens": max_tokens,
        "thinking_token_budget": thinking_budget,
        "stream": True,
        "stream_options": options,
        "request_id": request_id(job_id, number),
    }
    if seed is not None:
        body["seed"] = seed
    body["temperature"] = temperature
    body.update(sampling or {})
    body["cache_salt"] = cache_salt  # after the passthrough: a client never picks its own
    if response_format is not None:
        body["response_format"] = response_format
    if tools_off:
        body["tool_choice"] = "none"
        return body
    if tools:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return body


def retry_body(body: dict[str, Any], job_id: str, number: int) -> dict[str, Any]:
    """``body`` (a first attempt's) as attempt ``number``: its own request id and seed, stepped
    from the first one (0 when it had none), as the queue path steps its attempts' seeds."""
    return {**body, "request_id": request_id(job_id, number),
            "seed": attempt_seed(body.get("seed", 0), number)}
