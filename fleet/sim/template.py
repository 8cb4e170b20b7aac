"""The chat template the simulator renders before counting prompt tokens.

It follows the shape of Qwen3's ChatML template so that a request costs what it would cost on the
real server: every message is ``<|im_start|>ROLE\\nTEXT<|im_end|>\\n``; tool schemas are serialised
as JSON, one per line, inside a tools section of the system message (which is why 63 tool schemas
cost ~20K tokens); assistant tool calls are ``<tool_call>`` JSON blocks; tool results go back as a
user turn wrapped in ``<tool_response>``. With ``add_generation_prompt`` the prompt ends with the
assistant header and ``<think>\\n`` (thinking on), or an empty ``<think>\\n\\n</think>\\n\\n`` block
(``enable_thinking: false``). The wording of the tools preamble is the simulator's own.

Two templates (``fleet sim --chat-template``): ``qwen3`` (the default, the deployment's thinking
model: the generation prompt opens ``<think>``) and ``plain`` (a template whose generation prompt
is the assistant header only and leaves ``<think>`` to the model, as hybrid templates do). The
inference worker checks which one a server has before it continues a cut reasoning on it
(fleet/infer/resume.py): a partial reasoning can only be appended to a prompt that opened it.
"""

from __future__ import annotations

import json
from typing import Any

TEMPLATES = ("qwen3", "plain")

_TOOLS_HEADER = (
    "# Tools\n\nThe following functions may be called to help answer the user. Their signatures "
    "are listed inside <tools></tools>:\n<tools>\n"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments "
    'inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def message_text(content: Any) -> str:
    """Message ``content`` (a string, null, or a list of parts) -> its text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def _tools_block(tools: list[Any]) -> str:
    lines = [json.dumps(t, ensure_ascii=False) for t in tools]
    return _TOOLS_HEADER + "\n".join(lines) + _TOOLS_FOOTER


def tools_in(text: str) -> list[dict[str, Any]]:
    """The tool schemas a rendered prompt's tools section holds (``_tools_block``'s lines), as
    the completions route reads them back: a text prompt carries no ``tools`` field."""
    start = text.find(_TOOLS_HEADER)
    if start < 0:
        return []
    end = text.find(_TOOLS_FOOTER, start + len(_TOOLS_HEADER))
    block = text[start + len(_TOOLS_HEADER): end if end >= 0 else len(text)]
    tools = []
    for line in block.split("\n"):
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        if isinstance(tool, dict):
            tools.append(tool)
    return tools


def _tool_calls_text(calls: Any) -> str:
    out = []
    for call in calls or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        name = fn.get("name", "")
        out.append(f'\n<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>')
    return "".join(out)


def _render_message(msg: dict[str, Any]) -> str:
    role = msg.get("role", "user")
    text = message_text(msg.get("content"))
    if role == "tool":
        return f"<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n"
    if role == "assistant":
        text = text + _tool_calls_text(msg.get("tool_calls"))
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[Any] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    template: str = "qwen3",
) -> str:
    parts: list[str] = []
    rest = messages
    if tools:
        system = ""
        if messages and messages[0].get("role") in ("system", "developer"):
            system = message_text(messages[0].get("content")) + "\n\n"
            rest = messages[1:]
        parts.append(f"<|im_start|>system\n{system}{_tools_block(tools)}<|im_end|>\n")
    parts.extend(_render_message(m) for m in rest if isinstance(m, dict))
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
        if template == "qwen3":
            parts.append("<think>\n" if enable_thinking else "<think>\n\n</think>\n\n")
    return "".join(parts)
