"""Token counting for collect/trim: exact counts from the backend's ``/tokenize``, cached by
content hash in the process and in Redis, with an estimate when the backend cannot answer.

Why exact counts: the fleet promises that a prompt plus ``max_tokens`` fits ``max_model_len`` and
the project's prompt budget, and the dispatcher reserves KV blocks by the prompt's token count.
A character estimate is off by 2x between English prose, code and Japanese, so the backend's own
tokenizer (the same chat template the request will use) is asked first.

Key schema (fleet/core/keys.py)::

    {p}tokcache:<sha256>   string   the count, TTL ``cache_ttl_s``

The digest is sha256 over the model name, the kind of request ("text" or "chat") and the
canonical JSON of what was counted, so two models (two tokenizers) never share an entry.

In front of Redis each counter keeps the last ``local_entries`` counts it saw (least recently
used dropped first), so a prompt counted before - the same system prompt and question sent
again, a retried job - costs no round trip at all: neither ``/tokenize`` nor Redis (the queue
path's latency, docs/performance.md). The digest names the model and everything counted, so an
entry is as true as the Redis one; a few hundred kilobytes at most.

Failure cases:
  * backend down, slow, or answering garbage -> the estimate (``exact`` False) and
    ``last_failure`` names why; the caller puts that in the job's warnings. After a failure the
    counter does not call the backend again for ``down_s`` seconds (circuit open), so a dead
    backend costs one connect timeout per ``down_s``, not one per piece of text.
  * Redis down -> counted without the cache (logged); the cache is only an optimisation.
  * ``base_url`` empty -> estimate-only mode (benchmarks, offline runs); never exact.

The estimate: about 3.94 characters per token for ASCII text (the deployment's average,
docs/deployment.md) and one token per non-ASCII character (Japanese/Chinese text runs 1-1.5
characters per token), so it errs on the long side, which is the safe side for a fit check.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import httpx
import redis

from fleet.core.keys import Keys

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 3.94
# Chat framing per message (role markers, separators) for the estimate of a message list.
MESSAGE_OVERHEAD_TOKENS = 4


def estimate_text(text: str) -> int:
    """Tokens for ``text`` without a tokenizer (see the module docstring); 0 for ""."""
    if not text:
        return 0
    if text.isascii():
        return math.ceil(len(text) / CHARS_PER_TOKEN)
    non_ascii = sum(1 for ch in text if ord(ch) > 127)
    return math.ceil((len(text) - non_ascii) / CHARS_PER_TOKEN) + non_ascii


def estimate_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> int:
    total = MESSAGE_OVERHEAD_TOKENS  # the generation prompt
    for message in messages:
        total += MESSAGE_OVERHEAD_TOKENS + estimate_text(_message_text(message))
        if message.get("tool_calls"):
            total += estimate_text(json.dumps(message["tool_calls"], ensure_ascii=False))
    if tools:
        total += estimate_text(json.dumps(tools, ensure_ascii=False))
    return total


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class TokenCounter:
    """Counts tokens the way the backend will. Thread-safe: prep workers may share one."""

    def __init__(
        self,
        base_url: str,
        model: str,
        client: redis.Redis | None,
        keys: Keys,
        transport: httpx.BaseTransport | None = None,
        timeout_s: float = 5.0,
        *,
        cache_ttl_s: int = 7 * 24 * 3600,
        down_s: float = 5.0,
        local_entries: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.max_model_len: int | None = None  # as reported by the backend, once it answered
        self.last_failure: str | None = None
        self.backend_calls = 0
        self._redis = client
        self._keys = keys
        self._cache_ttl_s = cache_ttl_s
        self._down_s = down_s
        self._clock = clock
        self._down_until = -math.inf
        self._lock = threading.Lock()
        self._local: OrderedDict[str, int] = OrderedDict()
        self._local_entries = local_entries
        self._http = (
            httpx.Client(base_url=base_url.rstrip("/"), transport=transport, timeout=timeout_s)
            if base_url
            else None
        )
        if self._http is None:
            self.last_failure = "no backend configured"

    # -- public ---------------------------------------------------------------------------
    def count_text(self, text: str) -> tuple[int, bool]:
        """Tokens of a bare piece of text (no chat template, no special tokens)."""
        if not text:
            return 0, True
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return self._count("text", body, lambda: estimate_text(text))

    def count_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[int, bool]:
        """Prompt tokens of a chat request: template, generation prompt and tool schemas."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": True,
        }
        if tools:
            body["tools"] = tools
        return self._count("chat", body, lambda: estimate_messages(messages, tools))

    def close(self) -> None:
        if self._http is not None:
            self._http.close()

    def __enter__(self) -> TokenCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------
    def _count(
        self, kind: str, body: dict[str, Any], estimate: Callable[[], int]
    ) -> tuple[int, bool]:
        digest = self._digest(kind, body)
        cached = self._local_get(digest)
        if cached is not None:
            return cached, True
        cached = self._cache_get(digest)
        if cached is not None:
            self._local_set(digest, cached)
            return cached, True
        count = self._ask_backend(body)
        if count is None:
            return estimate(), False
        self._local_set(digest, count)
        self._cache_set(digest, count)
        return count, True

    def _local_get(self, digest: str) -> int | None:
        with self._lock:
            count = self._local.get(digest)
            if count is not None:
                self._local.move_to_end(digest)
            return count

    def _local_set(self, digest: str, count: int) -> None:
        with self._lock:
            self._local[digest] = count
            self._local.move_to_end(digest)
            while len(self._local) > self._local_entries:
                self._local.popitem(last=False)

    def _digest(self, kind: str, body: dict[str, Any]) -> str:
        canonical = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(f"{kind}\n{canonical}".encode()).hexdigest()

    def _ask_backend(self, body: dict[str, Any]) -> int | None:
        if self._http is None:
            return None
        with self._lock:
            if self._clock() < self._down_until:
                return None
        self.backend_calls += 1
        try:
            response = self._http.post("/tokenize", json=body)
            response.raise_for_status()
            data = response.json()
            count = int(data["count"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._mark_down(exc)
            return None
        if isinstance(data.get("max_model_len"), int):
            self.max_model_len = data["max_model_len"]
        return count

    def _mark_down(self, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        with self._lock:
            self._down_until = self._clock() + self._down_s
            self.last_failure = f"/tokenize failed ({reason})"
        log.warning("token counting falls back to the estimate for %.1fs: %s", self._down_s, reason)

    def _cache_get(self, digest: str) -> int | None:
        if self._redis is None:
            return None
        try:
            value = self._redis.get(self._keys.tokcache(digest))
        except redis.RedisError as exc:
            log.warning("token cache unavailable: %s", exc)
            return None
        return int(value) if value is not None else None

    def _cache_set(self, digest: str, count: int) -> None:
        if self._redis is None:
            return
        try:
            self._redis.set(self._keys.tokcache(digest), count, ex=self._cache_ttl_s)
        except redis.RedisError as exc:
            log.warning("token cache unavailable: %s", exc)
