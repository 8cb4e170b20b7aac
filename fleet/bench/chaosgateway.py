"""Gateway clients for a ``fleet bench chaos`` round: streamed chat requests kept going through a
fault, each read to its end, and what the fleet recorded for each.

A round with ``RoundPlan.gateway`` starts ``fleet gateway`` beside its fleet and, once the first
queue jobs are final, ``GatewayClients``: ``clients`` threads, each sending one streamed request
after another (``[sim:think=N]``, so every request is under way for a while and a killed backend
cuts some mid-reasoning; every other client is the editor, sending its tools and answered with a
call) until the fault has ended, then reading the last one to its end. Each
request's outcome (``Streamed``) is what its client saw:

  code        the ``fleet.code`` of its last chunks, or the code of an error event or of an HTTP
              error answer (``x-fleet-code``); "no end" when the stream stopped without one (a
              broken promise), "hung" when nothing came for ``read_timeout_s``
  done        whether ``data: [DONE]`` closed it

After the round, ``account`` reads the project's gateway results stream (the envelopes the gateway
publishes, fleet/core/results.py) and matches them to the requests by job id (the completion id is
``chatcmpl-<job id>``): every request must have exactly one envelope, with the code its client saw;
the envelopes' ``failovers`` say how many requests a cut moved to another backend.

Nothing here asserts timings; the round's verdict (fleet/bench/chaos.py) fails on a request
without an end, a request whose envelope is missing, doubled or disagrees, and on leases, items or
quota reservations left in the store once everything ended.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis

from fleet.core.models import Envelope

NO_END = "no end"
HUNG = "hung"
# the editor's clients send these (the example's assistant project allows search_docs)
EDITOR_TOOLS = [{"type": "function", "function": {
    "name": "search_docs", "description": "search the project's documents",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


@dataclass
class Streamed:
    job_id: str = ""
    code: str = NO_END
    done: bool = False
    reasoning_chars: int = 0
    content_chars: int = 0
    backend: str = ""  # its x-fleet-backend header: where it began
    ended: bool = False
    calls: int = 0  # tool-call deltas (a tool-bearing request's answer)


@dataclass
class GatewayAccount:
    """What a round's gateway clients saw and what the fleet recorded for them."""

    requests: int = 0
    codes: Counter[str] = field(default_factory=Counter)  # as the clients saw them
    unended: int = 0  # no final code, or hung
    unmatched: int = 0  # envelopes missing, doubled, or with another code than the client saw
    failovers: int = 0  # requests a cut moved to another grant (the envelopes' metadata)
    tool_calls: int = 0  # streams answered with a tool call (the editor's clients)
    left: int = 0  # leases, items and quota reservations left in the store at the end
    mismatched: list[str] = field(default_factory=list)  # "job: the client's code, the envelopes'"

    def broken(self) -> list[str]:
        out = []
        if self.unended:
            out.append(f"{self.unended} gateway streams without an end")
        if self.unmatched:
            out.append(f"{self.unmatched} gateway envelopes missing, doubled or disagreeing")
        if self.left:
            out.append(f"{self.left} entries left in the store")
        return out


def _code_of(payload: dict[str, Any]) -> str | None:
    if isinstance(payload.get("error"), dict):
        return str(payload["error"].get("code") or payload["error"].get("type") or "error")
    fleet = payload.get("fleet")
    return str(fleet["code"]) if isinstance(fleet, dict) and "code" in fleet else None


def stream_once(http: httpx.Client, url: str, key: str, text: str, out: Streamed | None = None,
                tools: list[dict[str, Any]] | None = None) -> Streamed:
    """One streamed chat request read to its end into ``out`` (see the module doc for what is
    recorded; ``out`` is filled as the stream goes, so another thread can watch it)."""
    out = out if out is not None else Streamed()
    try:
        return _read(http, url, key, text, out, tools)
    finally:
        out.ended = True


def _read(http: httpx.Client, url: str, key: str, text: str, out: Streamed,
          tools: list[dict[str, Any]] | None) -> Streamed:
    body: dict[str, Any] = {"model": "local", "stream": True, "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": text}]}
    if tools:
        body["tools"] = tools
    try:
        with http.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status_code != 200:
                response.read()
                out.code = response.headers.get("x-fleet-code") or f"HTTP {response.status_code}"
                out.done = True
                return out
            out.backend = response.headers.get("x-fleet-backend", "")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    out.done = True
                    break
                payload = json.loads(data)
                out.job_id = out.job_id or str(payload.get("id", "")).removeprefix("chatcmpl-")
                out.code = _code_of(payload) or out.code
                for choice in payload.get("choices") or []:
                    delta = choice.get("delta") or {}
                    out.reasoning_chars += len(delta.get("reasoning") or "")
                    out.content_chars += len(delta.get("content") or "")
                    out.calls += len(delta.get("tool_calls") or [])
    except httpx.TimeoutException:
        out.code = HUNG
    except httpx.HTTPError:
        pass  # the connection broke: "no end" unless a final code came first
    return out


class GatewayClients:
    """``clients`` threads of streamed requests until ``stop`` (see the module doc)."""

    def __init__(self, base_url: str, key: str, clients: int, think: int, answer: int,
                 read_timeout_s: float = 120.0) -> None:
        self.url = f"{base_url}/v1/chat/completions"
        self.key, self.clients, self.think, self.answer = key, clients, think, answer
        self.read_timeout_s = read_timeout_s
        self.outcomes: list[Streamed] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> GatewayClients:
        for n in range(self.clients):
            thread = threading.Thread(target=self._run, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, n: int) -> None:
        timeout = httpx.Timeout(10.0, read=self.read_timeout_s)
        with httpx.Client(timeout=timeout) as http:
            sent = 0
            while not self._stop.is_set():
                # odd clients are the editor: its tools with each request, and a call to answer with
                editor = n % 2 == 1
                call = " [sim:tool=search_docs]" if editor else f" [sim:answer={self.answer}]"
                text = f"[sim:think={self.think}]{call} chaos client {n} request {sent}"
                outcome = Streamed()
                with self._lock:
                    self.outcomes.append(outcome)
                stream_once(http, self.url, self.key, text, outcome, EDITOR_TOOLS if editor else None)
                sent += 1

    def thinking_on(self, backend: str) -> int:
        """Streams under way that began on ``backend`` and have streamed reasoning, no answer."""
        with self._lock:
            return sum(1 for o in self.outcomes if not o.ended and o.backend == backend
                       and o.reasoning_chars and not o.content_chars)

    def stop(self, timeout_s: float) -> None:
        """No new requests; the ones under way are read to their end (up to ``timeout_s``)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=timeout_s)

    def account(self, reader: redis.Redis, stream_key: str, store_keys: list[str]) -> GatewayAccount:
        """The clients' outcomes against the gateway's envelopes (``stream_key``) and the store's
        leftovers (``store_keys``: hashes that must be empty once everything ended)."""
        with self._lock:
            outcomes = [o for o in self.outcomes if o.ended]
        envelopes: dict[str, list[Envelope]] = {}
        entries: Any = reader.xrange(stream_key)
        for _entry_id, fields in entries:
            envelope = Envelope.model_validate_json(fields[b"envelope"])
            envelopes.setdefault(envelope.job_id, []).append(envelope)
        account = GatewayAccount(requests=len(outcomes), codes=Counter(o.code for o in outcomes),
                                 tool_calls=sum(1 for o in outcomes if o.calls))
        for o in outcomes:
            if o.code in (NO_END, HUNG):
                account.unended += 1
            if not o.job_id:  # refused before its first chunk: no id to match (an HTTP error)
                continue
            mine = envelopes.get(o.job_id, [])
            if len(mine) != 1 or mine[0].code.value != o.code:
                account.unmatched += 1
                account.mismatched.append(f"{o.job_id}: client {o.code}, envelopes {[e.code.value for e in mine]}")
            account.failovers += sum(1 for e in mine if int(e.metadata.get("failovers") or 0) > 0)
        account.left = sum(int(reader.hlen(key)) for key in store_keys)
        return account
