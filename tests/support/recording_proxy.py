"""A recording HTTP proxy for the client-library tests: it passes every request through to the
gateway unchanged, relays the answer as it comes (a stream chunk by chunk), and keeps what each
client sent (method, path, the headers a client library adds, the JSON body), so a test can say
what a library sends that the ``openai`` SDK alone does not."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te",
              "trailer", "upgrade", "proxy-authorization", "accept-encoding"}


@dataclass
class Sent:
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # the parsed JSON body, or None


@dataclass
class Recorder:
    url: str = ""
    sent: list[Sent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def chats(self) -> list[dict[str, Any]]:
        """The chat completion bodies sent so far, oldest first."""
        with self.lock:
            return [s.body for s in self.sent if s.path.endswith("/chat/completions") and s.body]

    def mark(self) -> int:
        with self.lock:
            return len(self.sent)

    def since(self, mark: int) -> list[Sent]:
        with self.lock:
            return self.sent[mark:]


@contextmanager
def recording_proxy(upstream: str) -> Iterator[Recorder]:
    """A proxy on a free loopback port in front of ``upstream`` (``http://host:port``); the
    recorder's ``url`` is its base."""
    recorder = Recorder()
    client = httpx.Client(base_url=upstream, timeout=httpx.Timeout(120, connect=10))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # answers end with the connection: streams need no framing

        def log_message(self, *args: object) -> None:
            pass

        def _relay(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            with recorder.lock:
                recorder.sent.append(Sent(self.command, self.path, headers, body))
            request = client.build_request(self.command, self.path, headers=headers, content=raw)
            reply = client.send(request, stream=True)
            try:
                self.send_response(reply.status_code)
                for name, value in reply.headers.items():
                    if name.lower() not in HOP_BY_HOP | {"content-encoding"}:
                        self.send_header(name, value)
                self.end_headers()
                for chunk in reply.iter_raw():
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client hung up
            finally:
                reply.close()  # closes the upstream connection: the gateway sees the hang-up

        do_GET = do_POST = do_DELETE = _relay

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    recorder.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield recorder
    finally:
        server.shutdown()
        server.server_close()
        client.close()
