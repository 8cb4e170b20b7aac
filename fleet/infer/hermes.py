"""Tool calls in a model's raw text, as vLLM's hermes tool parser reads them: for a continued turn,
whose answer comes from the completions route, where no tool parser runs (fleet/infer/resume.py).

The deployment's model (Qwen3, ``--tool-call-parser hermes``) writes a call as a block in its
answer::

    <tool_call>
    {"name": "search_docs", "arguments": {"query": "invoices"}}
    </tool_call>

one block per call, the last one possibly without its closing tag (the stream ended there). The
chat route turns them into ``tool_calls`` and keeps only the text before the first block as the
content; so does ``parse``. A block that is not a JSON object with a string ``name`` makes the
whole answer content, with no calls (so does a block without ``arguments``, or JSON nested too deep to read:
what the parser does with text it cannot read: the fleet's
validation then sees a prose answer, never a half-read call). ``arguments`` are sent on as a JSON
string (``ensure_ascii=False``), the call ids are new (``chatcmpl-tool-`` and 32 hex digits, the
shape vLLM gives them).

``Splitter`` does the same for a stream: ``feed`` passes on the content as it comes, holding back
what may be the start of a ``<tool_call>`` tag and everything from the first block on; ``end``
parses the whole answer and gives what is left to send: the rest of the content (the held text
when it was no call after all) and the calls, as one ``tool_calls`` delta in the chat route's
shape (``index``, ``id``, ``type``, ``function`` with ``name`` and ``arguments``).

Work is linear in the text (``str.find`` from each tag on); nothing here runs a pattern.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call(raw: str) -> dict[str, Any] | None:
    try:
        block = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser goes
        return None
    if not isinstance(block, dict) or not isinstance(block.get("name"), str) or "arguments" not in block:
        return None
    arguments = block["arguments"]
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool calls) of an answer (see the module doc); ``(text, [])`` without a block
    or with one that does not read."""
    first = text.find(OPEN)
    if first < 0:
        return text, []
    calls, at = [], first
    while at >= 0:
        body_at = at + len(OPEN)
        end = text.find(CLOSE, body_at)
        raw = text[body_at:end] if end >= 0 else text[body_at:]
        call = _call(raw.strip())
        if call is None:
            return text, []
        calls.append(call)
        at = text.find(OPEN, end + len(CLOSE)) if end >= 0 else -1
    return text[:first], calls


def as_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as one ``tool_calls`` delta of the chat route: each whole, with its index."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


class Splitter:
    """A streamed answer's content passed on as it comes, tool-call blocks held back (module doc)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.pending = ""  # content not passed on yet: what may be the start of a tag
        self.sent = 0  # characters of content passed on
        self.calling = False  # a block has begun: nothing more is content until the end

    def feed(self, piece: str) -> str:
        """The content ``piece`` lets through now."""
        self.text.append(piece)
        if self.calling:
            return ""
        pending = self.pending + piece
        at = pending.find(OPEN)
        if at >= 0:
            self.calling, out, self.pending = True, pending[:at], ""
        else:
            keep = _partial_tag(pending)
            out, self.pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.sent += len(out)
        return out

    def end(self) -> tuple[str, str, list[dict[str, Any]]]:
        """(the whole content, what of it is still to send, the calls)."""
        content, calls = parse("".join(self.text))
        return content, content[self.sent:], calls


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``OPEN``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
