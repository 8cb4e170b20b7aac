"""Incremental Server-Sent Events parsing for vLLM's streaming responses.

vLLM frames every chunk as ``data: <json>\\n\\n`` and ends with ``data: [DONE]\\n\\n``; 0.33 may
send ``: keep-alive`` comment lines between chunks. Bytes arrive in arbitrary pieces (a UTF-8
character or a line can be split across two reads, several events can arrive in one), so the
parser keeps the unfinished tail and yields only complete events.

Lines end only at CR, LF or CRLF (the SSE specification), never at the other characters
``str.splitlines`` breaks on: vLLM's JSON encoder escapes control characters but leaves U+2028,
U+2029 and U+0085 raw inside JSON strings, so splitting on them would cut a chunk in two. A CR
that ends one read may be the first half of a CRLF whose LF starts the next read; that LF is
skipped.

An event is either ``SseEvent(data=...)`` (the ``data:`` lines of one event joined by ``\\n``) or
``SseEvent(comment=...)`` for a comment line. ``event:``/``id:``/``retry:`` fields are accepted and
ignored: vLLM does not use them.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

DONE = "[DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class SseEvent:
    data: str | None = None
    comment: str | None = None

    @property
    def is_done(self) -> bool:
        return self.data is not None and self.data.strip() == DONE


class SseParser:
    """Feed bytes, get complete events. One parser per response."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tail = ""
        self._after_cr = False
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> Iterator[SseEvent]:
        text = self._decoder.decode(chunk)
        if not text:
            return
        if self._after_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split across two reads
        self._after_cr = text.endswith("\r")
        lines = _LINE_END.split(self._tail + text)
        self._tail = lines.pop()
        for line in lines:
            event = self._line(line)
            if event is not None:
                yield event

    def close(self) -> Iterator[SseEvent]:
        """End of the body: an unterminated last event still counts (servers forget the \\n\\n)."""
        rest = self._tail + self._decoder.decode(b"", final=True)
        self._tail = ""
        if rest.strip():
            event = self._line(rest)
            if event is not None:
                yield event
        if self._data:
            yield self._flush()

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            return self._flush() if self._data else None
        if line.startswith(":"):
            return SseEvent(comment=line[1:].strip())
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        return None

    def _flush(self) -> SseEvent:
        event = SseEvent(data="\n".join(self._data))
        self._data = []
        return event


def iter_events(body: Iterable[bytes]) -> Iterator[SseEvent]:
    """The events of a whole body read in pieces (``httpx.Response.iter_bytes()``)."""
    parser = SseParser()
    for chunk in body:
        yield from parser.feed(chunk)
    yield from parser.close()
