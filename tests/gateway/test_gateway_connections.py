"""What a client without a key can hold open in a real ``fleet gateway`` process: more half-open
connections (request headers never finished) than the per-address and per-process caps, from
addresses of the loopback network, against a gateway whose open-file limit is below the flood,
while another address asks ``/health``; a body trickled after its refusal; and the log, which
summarises rather than reporting each connection."""

from __future__ import annotations

import re
import selectors
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from fleet.core.config import load_settings
from tests.support.gateway_support import config_with_keys, lone_gateway
from tests.support.testenv import TEST_REDIS_URL, delete_prefix
from tests.support.waiting import wait_until

PER_ADDRESS = 50
CAP = 120
FLOOD = 600  # more than the gateway's open-file limit: before the caps, accept() met EMFILE
NOFILE = 500
HEADER_TIMEOUT_S = 1.5
LOG_INTERVAL_S = 1.0
HALF_OPEN = b"GET /health HTTP/1.1\r\nHost: gateway\r\n"  # the blank line never comes


class Gateway:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log
        self.port = urlsplit(url).port or 0

    def health(self, source: str) -> httpx.Response:
        """``/health`` from a client on another loopback address."""
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport, timeout=10) as client:
            return client.get(f"{self.url}/health")

    def log_lines(self, pattern: str) -> list[int]:
        """The counts of the log's summary lines matching ``pattern``."""
        text = self.log.read_text(encoding="utf-8", errors="replace")
        return [int(n) for n in re.findall(rf"closed (\d+) connections? {pattern}", text)]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config, _ = config_with_keys(
        tmp_path_factory.mktemp("gateway-connections"),
        backend={"url": "http://127.0.0.1:9", "max_num_seqs": 1},
        gateway={"header_timeout_s": HEADER_TIMEOUT_S, "max_connections": CAP,
                 "max_connections_per_address": PER_ADDRESS, "listen_backlog": 256,
                 "connection_log_interval_s": LOG_INTERVAL_S})
    with lone_gateway(config, nofile=NOFILE) as (url, _):
        yield Gateway(url, config.with_name("gateway.log"))
    client = redis.Redis.from_url(TEST_REDIS_URL)
    delete_prefix(client, load_settings(config, env={}).key_prefix)
    client.close()


def half_open(port: int, source: str, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        sock.sendall(HALF_OPEN)
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def read_response(sock: socket.socket) -> bytes:
    """One whole response (headers and a Content-Length body), however the segments arrive: a
    part of it left unread would stand before the next answer."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response: {data + body!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def answers(sockets: list[socket.socket]) -> Counter[int]:
    """Wait until the gateway closed every socket; the HTTP status each got (0: none)."""
    received = {sock: b"" for sock in sockets}
    selector = selectors.DefaultSelector()
    for sock in sockets:
        selector.register(sock, selectors.EVENT_READ)

    def drain() -> bool:
        for key, _ in selector.select(timeout=0):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            received[sock] += data
            if not data:
                selector.unregister(sock)
                sock.close()
        return not selector.get_map()

    wait_until(drain, timeout_s=30, what="the gateway to close every half-open connection")
    selector.close()
    return Counter(int(data[9:12]) if data.startswith(b"HTTP/1.1 ") else 0 for data in received.values())


def test_a_flood_from_one_address_is_capped_then_timed_out(gateway: Gateway) -> None:
    started = time.monotonic()
    sockets = half_open(gateway.port, "127.0.0.1", FLOOD)
    # Another client is served while the flood holds what its address may.
    assert gateway.health("127.0.0.2").status_code == 200
    statuses = answers(sockets)
    # Past the cap: 429 at once; the ones held: 408 once their headers' time ran out.
    assert set(statuses) == {408, 429}, statuses
    assert statuses[408] >= PER_ADDRESS and statuses[429] + statuses[408] == FLOOD, statuses
    over = wait_until(lambda: sum(gateway.log_lines("over gateway.max_connections_per_address"))
                      == statuses[429] and gateway.log_lines("over gateway.max_connections_per"),
                      what="the log's summaries of the connections over the per-address cap")
    timed_out = wait_until(lambda: sum(gateway.log_lines("without complete request headers"))
                           == statuses[408] and gateway.log_lines("without complete request headers"),
                           what="the log's summaries of the header timeouts")
    # One line the first time, then one per interval at most: not one per connection.
    most = 2 + (time.monotonic() - started) / LOG_INTERVAL_S
    assert len(over) <= most and len(timed_out) <= most, (over, timed_out)
    log = gateway.log.read_text(encoding="utf-8", errors="replace")
    assert "Too many open files" not in log and "out of system resource" not in log


def test_the_process_cap_answers_503_until_connections_close(gateway: Gateway) -> None:
    sockets = [sock for source in ("127.0.0.3", "127.0.0.4", "127.0.0.5")
               for sock in half_open(gateway.port, source, PER_ADDRESS)]
    statuses = answers(sockets)
    assert statuses[503] >= 1 and statuses[408] >= CAP, statuses
    assert statuses[503] + statuses[408] == 3 * PER_ADDRESS, statuses
    wait_until(lambda: gateway.log_lines(r"over gateway.max_connections \("),
               what="the log's summary of the connections over the process cap")
    assert gateway.health("127.0.0.6").status_code == 200


def test_a_body_trickled_after_its_answer_is_cut_off(gateway: Gateway) -> None:
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10,
                                    source_address=("127.0.0.7", 0))
    sock.sendall(b"POST /v1/tasks HTTP/1.1\r\nHost: gateway\r\nContent-Length: 1000000\r\n\r\n{")
    assert sock.recv(65536).startswith(b"HTTP/1.1 401 ")  # no key: refused before the body is read
    sock.setblocking(False)

    def closed() -> bool:
        try:
            sock.send(b" ")  # a byte at a time: uvicorn's keep-alive timer restarts with each
            return sock.recv(65536) == b""
        except BlockingIOError:
            return False
        except (BrokenPipeError, ConnectionResetError):
            return True

    wait_until(closed, what="the gateway to close a connection trickling an unread body", every_s=0.2)
    sock.close()


def test_a_kept_alive_connection_gets_the_header_timeout_for_its_next_request(gateway: Gateway) -> None:
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10,
                                    source_address=("127.0.0.8", 0))
    sock.sendall(b"GET /livez HTTP/1.1\r\nHost: gateway\r\n\r\n")
    assert read_response(sock).startswith(b"HTTP/1.1 200 ")
    sock.sendall(HALF_OPEN)
    sock.setblocking(False)
    assert answers([sock]) == {408: 1}
