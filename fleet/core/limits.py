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
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.core.errors import InputInvalid

if TYPE_CHECKING:
    from fleet.core.config import LimitsSettings
    from fleet.core.models import Job

_LITERALS = {True: 4, False: 5, None: 4}  # true, false, null


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
    """Refuse a signed message over ``limits.max_message_bytes`` (before verifying or parsing it)."""
    size = measure(signed, stop_bytes=limits.max_message_bytes)
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
