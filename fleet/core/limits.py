"""Size caps on a job, so that what a producer sends costs a bounded amount of work.

Two checks, both at submit (``fleet.Client``) and in prep (fleet/worker/jobs/prep.py):

``check_message``: the signed message as it arrived, measured before it is verified or parsed.
The measure walks the decoded message and stops as soon as it passes the cap, so a 50 MB message
costs no more than a message at the cap. The size is the message's bytes as compact JSON
(UTF-8; escapes are not counted, so the measure never exceeds the real size and a message the
producer's check passed is never refused by the worker's).

``check_job``: the parsed job's counts (messages, sources, tools) and sizes (metadata, inline
source text).

Failures raise ``InputInvalid`` (``E_INPUT_INVALID``) naming the setting and the value found.
Response schemas have caps of their own (fleet/core/schema.py).

Nesting: JSON that arrives from outside (a gateway request body, a batch input line, a model's
answer or tool arguments: ``loads``; a signed message: ``check_message``) may nest arrays and
objects at most ``MAX_JSON_DEPTH`` levels deep. Python's parser raises RecursionError near 1,000
levels, and a structure of a few hundred still reaches every recursive walker after it (pydantic,
jsonschema, ``json.dumps`` deep in a worker's stack), so the depth is bounded once, where the JSON
is read: ``loads`` scans the raw text before parsing it (strings removed, then the innermost
bracket pairs peeled off one level a pass, at most ``MAX_JSON_DEPTH`` passes), so a body of
100,000 levels is refused before the parser sees it. Past the limit: ``NestedTooDeep``, a
``ValueError`` naming the top-level field (``param``) where it could tell.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.core.errors import InputInvalid

if TYPE_CHECKING:
    from fleet.core.config import LimitsSettings
    from fleet.core.models import Job

_LITERALS = {True: 4, False: 5, None: 4}  # true, false, null

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in JSON from outside. A job's own shape takes
about 6 levels (the signed message, its job, tools, a tool's function and parameters), a
response schema at most ``MAX_SCHEMA_DEPTH`` (32, fleet/core/schema.py) more."""
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_PAIRS = bytes.maketrans(b"[{]}", b"(())")
_SPACE = re.compile(r"[ \t\n\r]*")


class NestedTooDeep(ValueError):
    """JSON nested past ``MAX_JSON_DEPTH``; ``param``: the top-level field at fault, if known."""

    def __init__(self, param: str | None = None) -> None:
        super().__init__(f"nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects")
        self.param = param


def too_deep(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``raw`` nests arrays and objects deeper than ``limit``, without
    parsing it (exact for valid JSON; for invalid JSON only a hint, which the parser then refuses)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    brackets = _STRING.sub(b"", data).translate(_PAIRS, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"()", b"")  # every innermost pair: one level less
    return bool(brackets)


def loads(raw: bytes | str) -> Any:
    """``json.loads`` of JSON from outside, refused with ``NestedTooDeep`` past ``MAX_JSON_DEPTH``
    before it is parsed; ``ValueError`` for text that is not JSON."""
    if too_deep(raw):
        raise NestedTooDeep(_deep_member(raw))
    return json.loads(raw)


def _deep_member(raw: bytes | str) -> str | None:
    """The key of the top-level object's member nested too deep (None: not an object, or no
    single member is)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        return None
    decoder = json.JSONDecoder()
    at = _SPACE.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("{", at):
        return None
    at += 1
    while True:
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
        try:
            key, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
        if not isinstance(key, str) or not text.startswith(":", at):
            return None
        start = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
        try:
            _, at = decoder.raw_decode(text, start)
        except RecursionError:
            return key
        except ValueError:
            return None
        if too_deep(text[start:at], MAX_JSON_DEPTH - 1):  # the object itself is one level
            return key
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
        if not text.startswith(",", at):
            return None
        at += 1


@dataclass(frozen=True)
class Size:
    """``bytes`` of compact JSON and nesting ``depth``; once a stop is passed, at least these."""

    bytes: int
    depth: int


def _scalar_bytes(item: Any) -> int:
    if isinstance(item, str):
        return len(item.encode("utf-8", "surrogatepass")) + 2
    if item is None or isinstance(item, bool):
        return _LITERALS[item]
    return len(str(item))


def measure(value: Any, stop_bytes: int | None = None, stop_depth: int | None = None) -> Size:
    """Size of ``value`` as JSON, walking without recursion and stopping past either limit."""
    total, deepest = 0, 0
    stack: list[Iterator[Any]] = [iter((value,))]
    while stack:
        item = next(stack[-1], stack)  # the stack itself marks an exhausted iterator
        if item is stack:
            stack.pop()
            continue
        if isinstance(item, Mapping):
            total += 2 + max(0, 2 * len(item) - 1)  # braces, colons, commas
            stack.append(itertools.chain.from_iterable(item.items()))
        elif isinstance(item, list | tuple):
            total += 2 + max(0, len(item) - 1)
            stack.append(iter(item))
        elif isinstance(item, str) and stop_bytes is not None and total + len(item) > stop_bytes:
            total += len(item) + 2  # already past the cap: no need to encode it
        else:
            total += _scalar_bytes(item)
        deepest = max(deepest, len(stack) - 1)
        if (stop_bytes is not None and total > stop_bytes) or (stop_depth is not None and deepest > stop_depth):
            break
    return Size(total, deepest)


def check_message(signed: Any, limits: LimitsSettings) -> None:
    """Refuse a signed message over ``limits.max_message_bytes`` or nested deeper than
    ``MAX_JSON_DEPTH`` (before verifying or parsing it)."""
    # the job may nest MAX_JSON_DEPTH levels; the signed message around it is one more
    size = measure(signed, stop_bytes=limits.max_message_bytes, stop_depth=MAX_JSON_DEPTH + 1)
    if size.depth > MAX_JSON_DEPTH + 1:
        raise InputInvalid(f"the message is {NestedTooDeep().args[0]}")
    if size.bytes > limits.max_message_bytes:
        raise InputInvalid(f"the message has at least {size.bytes} bytes; "
                           f"limits.max_message_bytes is {limits.max_message_bytes}")


def _over(name: str, value: int, cap: int, what: str) -> None:
    if value > cap:
        raise InputInvalid(f"the job has {value} {what}; limits.{name} is {cap}")


def check_job(job: Job, limits: LimitsSettings) -> None:
    """Refuse a job over any of the count and size caps of ``limits``."""
    _over("max_messages", len(job.messages), limits.max_messages, "messages")
    _over("max_sources", len(job.sources), limits.max_sources, "sources")
    _over("max_tools", len(job.tools or []), limits.max_tools, "tools")
    metadata = measure(job.metadata, stop_bytes=limits.max_metadata_bytes).bytes
    _over("max_metadata_bytes", metadata, limits.max_metadata_bytes, "bytes of metadata (at least)")
    inline = sum(len(s.text.encode("utf-8", "surrogatepass")) for s in job.sources if s.text is not None)
    _over("max_source_text_bytes", inline, limits.max_source_text_bytes, "bytes of inline source text")
