"""Request validation with vLLM's answers: which bodies are refused, with what status and JSON.

Every refusal is an ``APIError`` rendered as ``{"error": {"message", "type", "param", "code"}}``:

- 400 ``BadRequestError``: body not JSON, no messages, ``stream_options`` without ``stream``,
  ``thinking_token_budget`` not an integer >= -1 (floats and booleans too), ``max_tokens`` /
  ``max_completion_tokens`` below 1, ``tool_choice`` without tools, ``n`` other than 1, a
  ``cache_salt`` that is not a non-empty string, a malformed
  ``response_format``; prompt too long (``param: "input_tokens"``, checked by the app once the
  prompt is tokenized).
- 404 ``NotFoundError``: a ``model`` none of the served model names (``--served-model-name``).

Fields vLLM ignores are ignored here too (``priority`` under fcfs, ``guided_json``, unknown keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class APIError(Exception):
    TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = APIError.TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class ChatRequest:
    body: dict[str, Any]
    model: str
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    budget: int | None
    thinking: bool
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    response_format: dict[str, Any] | None
    cache_salt: str | None = None
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer, got {value!r}", key)
    if value < minimum:
        raise _bad(f"{key} must be at least {minimum}, got {value}.", key)
    return value


def _budget(body: dict[str, Any]) -> int | None:
    value = opt_int(body, "thinking_token_budget", -1)
    return None if value is None or value == -1 else value


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad("each message must be an object with a role", "messages")
    return messages


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise _bad(f"invalid tool_choice {choice!r}", "tool_choice")
    return tools, choice


def response_format_of(body: dict[str, Any]) -> dict[str, Any] | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format.type must be text, json_object or json_schema",
                   "response_format")
    if rf["type"] == "json_schema" and not isinstance(rf.get("json_schema"), dict):
        raise _bad("response_format.json_schema is required", "response_format")
    return None if rf["type"] == "text" else rf


def salt_of(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return salt


def parse_chat(body: Any, served_models: tuple[str, ...]) -> ChatRequest:
    """The request; ``model`` (of the response) is the first served name, as vLLM answers."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    asked = body.get("model") or served_models[0]
    if asked not in served_models:
        raise APIError(404, f"The model `{asked}` does not exist.", "model")
    model = served_models[0]
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    if body.get("n") not in (None, 1):
        raise _bad("the simulator supports n=1 only", "n")
    kwargs = body.get("chat_template_kwargs") or {}
    tools, choice = _tools(body)
    max_tokens = opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", 1)
    return ChatRequest(
        body=body,
        model=model,
        messages=_messages(body),
        stream=stream,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        continuous_usage=bool(isinstance(options, dict) and options.get("continuous_usage_stats")),
        max_tokens=max_tokens,
        budget=_budget(body),
        thinking=kwargs.get("enable_thinking", True) is not False if isinstance(kwargs, dict)
        else True,
        tools=tools,
        tool_choice=choice,
        response_format=response_format_of(body),
        cache_salt=salt_of(body),
    )
