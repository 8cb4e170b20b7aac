"""One admitted request's stream from vLLM, run on its own thread and handed to the event loop.

The fleet's vLLM client (fleet/infer/vllm.py) is synchronous and enforces every timeout with a
code; the gateway reuses it as is, each stream on a thread of the gateway's stream pool (not the
loop's executor, whose few threads would cap the gateway's concurrency). The pool keeps its
threads: starting a thread per stream cost 75 us at the median but milliseconds at the tail on a
busy host, paid before the request went upstream. The pool has room for twice the fleet's
sequence cap, and a stream only runs while its request holds a lease, so a stream never waits
for a thread. Each delta goes to the request's
``asyncio.Queue`` through ``call_soon_threadsafe``; the last item is ``Finished`` (the assembled
``StreamResult``) or ``Failed`` (a ``FleetError``, with the partial result when there is one).

The loop watcher (fleet/infer/loopwatch.py) reads the reasoning as it streams; a verdict closes
the upstream stream at once and ends the request with ``E_THINK_LOOP``. Setting ``cancel`` (a
``fleet.infer.vllm.Cancel``: the client disconnected, or the lease was lost) shuts the upstream
socket down at once, even in the middle of a blocked read; vLLM aborts the sequence when the
connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from fleet.core.config import WatcherSettings
from fleet.core.errors import FleetError, ThinkLoop
from fleet.infer.loopwatch import LoopWatcher
from fleet.infer.resume import Kept, kept_only
from fleet.infer.vllm import Delta, StreamResult, VllmClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    result: StreamResult


@dataclass(frozen=True)
class Failed:
    error: FleetError
    partial: StreamResult | None


Resume = Callable[[Callable[[Delta], None]], StreamResult]


class UpstreamStream:
    def __init__(self, client: VllmClient, body: dict[str, Any], watcher: WatcherSettings | None,
                 cancel: threading.Event, loop: asyncio.AbstractEventLoop, pool: Executor,
                 kept: Kept | None = None, resume: Resume | None = None) -> None:
        self.client = client
        self.body = body
        # A continuation after a failover (fleet/gateway/chat.py): ``resume(on_delta)`` streams the
        # rest of the ``kept`` reasoning, which the watcher reads first (a loop across the cut).
        self.kept, self.resume = kept, resume
        self.watcher = LoopWatcher(watcher) if watcher is not None and watcher.enabled else None
        self.cancel = cancel
        self.queue: asyncio.Queue[Delta | Finished | Failed] = asyncio.Queue()
        self._loop = loop
        self._pool = pool
        self.done = asyncio.Event()

    def start(self) -> UpstreamStream:
        self._pool.submit(self._run)
        return self

    def _post(self, item: Delta | Finished | Failed) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _primed(self) -> Failed | None:
        """The watcher's verdict on the kept reasoning of a continuation, before anything is sent."""
        if self.watcher is None or self.kept is None:
            return None
        seen = self.watcher.read_before(self.kept["reasoning"])
        if seen is None:
            return None
        return Failed(ThinkLoop(f"loop watcher: {seen.kind}: {seen.detail}"), kept_only(self.kept))

    def _on_delta(self, delta: Delta) -> None:
        if self.watcher is not None:
            now = time.monotonic()
            verdict = self.watcher.feed(delta.reasoning, now) if delta.reasoning else None
            if delta.content or delta.tool_calls or delta.held:  # the answer goes on: no stall
                self.watcher.touch(now)
            verdict = verdict or self.watcher.check_stall(now)
            if verdict is not None:
                raise ThinkLoop(f"loop watcher: {verdict.kind}: {verdict.detail}")
        if not delta.keepalive:
            self._post(delta)

    def _run(self) -> None:
        try:
            seen = self._primed()
            if seen is not None:
                self._post(seen)
                return
            if self.resume is not None:
                result = self.resume(self._on_delta)
            else:
                result = self.client.stream_chat(self.body, self._on_delta, self.cancel)
            self._post(Finished(result))
        except FleetError as exc:
            self._post(Failed(exc, getattr(exc, "partial", None)))
        except Exception as exc:  # a bug must still end the client's request, with a code
            log.exception("gateway stream failed")
            self._post(Failed(FleetError(f"gateway stream failed: {type(exc).__name__}"), None))
        finally:
            self._loop.call_soon_threadsafe(self.done.set)
