"""Collection against a REAL local HTTP server (http.server in a thread, real sockets) and real
files: normal, slow, huge, binary, redirect-loop and 404 pages, files outside the allowed roots
and a symlink escape. Every bad source ends as E_COLLECT_FAILED naming the source and reason
(fail mode) or as a warning (drop mode); nothing raises anything else."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis

from fleet.core.codes import Code
from fleet.core.config import EXAMPLE_CONFIG, Settings, load_settings
from fleet.core.errors import CollectFailed
from fleet.core.keys import Keys
from fleet.core.models import Job, Message, Source
from fleet.prep.collect import Collector
from fleet.prep.prepare import prepare
from fleet.prep.tokens import TokenCounter

ARTICLE = """<!doctype html><html><head><title>Fleet notes</title>
<script>var tracking = "do not collect me";</script></head><body>
<nav><a href="/">Home</a> | <a href="/about">About</a></nav>
<article><h1>Keeping vLLM full</h1>
<p>The dispatcher admits requests so that the backend stays busy without ever running more
than thirty-two sequences at once, which keeps latency flat for every project.</p>
<p>Prefix caching only reuses whole blocks of one thousand and seventy-two tokens, so the
shared system prompt has to be at least that long before it ever produces a cache hit.</p>
</article><footer>Copyright 2025 Example Corp</footer></body></html>"""
MAX_BYTES = 200_000


PAGES = {  # path -> (content type, body)
    "/article.html": ("text/html; charset=utf-8", ARTICLE.encode()),
    "/data.json": ("application/json", b'{"queue":"fleet.assistant","depth":[1,2]}'),
    "/latin1.txt": ("text/plain; charset=iso-8859-1", "caf\u00e9 cr\u00e8me".encode("latin-1")),
    "/deep.json": ("application/json", b"[" * 100_000 + b"]" * 100_000),
    "/sniff": ("application/octet-stream", b"plain words, no type given"),
    "/binary": ("image/png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(200)),
}
REDIRECTS = {"/redirect": "/article.html", "/loop-a": "/loop-b", "/loop-b": "/loop-a"}


class Site(BaseHTTPRequestHandler):
    release = threading.Event()  # replaced per server; /slow waits on it

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        with contextlib.suppress(OSError):  # the client hangs up on purpose (timeouts, size cap)
            self._route()

    def _route(self) -> None:
        path = self.path
        if path in PAGES:
            self._send(200, *PAGES[path])
        elif path.startswith("/go?to="):  # an open redirect, as many real sites have
            self._redirect(path.split("=", 1)[1])
        elif path in REDIRECTS:
            self._redirect(REDIRECTS[path])
        elif path.startswith("/chain/"):  # a fresh URL every hop: never a loop, never an end
            self._redirect(f"/chain/{int(path.rsplit('/', 1)[1]) + 1}")
        elif path in ("/huge", "/huge-declared"):
            self._stream_huge(declared=path == "/huge-declared")
        elif path == "/slow":
            self.release.wait(30)
            self._send(200, "text/plain", b"too late")
        else:
            self._send(404, "text/plain", b"no such page")

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _stream_huge(self, declared: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        if declared:
            self.send_header("Content-Length", str(50 * MAX_BYTES))
        self.end_headers()
        chunk = b"all work and no play " * 800
        for _ in range(50 * MAX_BYTES // len(chunk)):
            self.wfile.write(chunk)


@pytest.fixture
def site() -> Iterator[str]:
    handler = type("ThisSite", (Site,), {"release": threading.Event()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    handler.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/ (allowed) and outside/ (not), with a symlink from the root to the outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "notes.txt").write_text("inside the allowed root\n", encoding="utf-8")
    (root / "page.html").write_text(ARTICLE, encoding="utf-8")
    (root / "data.json").write_text('{"a": [1, 2]}', encoding="utf-8")
    (root / "sub").mkdir()
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (outside / "secret.txt").write_text("secret outside the root\n", encoding="utf-8")
    os.symlink(outside / "secret.txt", root / "escape.txt")
    os.symlink(outside, root / "outdir")
    return tmp_path


def make_settings(tree: Path, read_timeout_s: float = 10.0, **extra: object) -> Settings:
    """The local test servers listen on 127.0.0.1: allowed here, refused by default."""
    collect = {
        "allowed_roots": [str(tree / "root")],
        "allow_networks": ["127.0.0.1/32"],
        "connect_timeout_s": 2.0,
        "read_timeout_s": read_timeout_s,
        "max_bytes": MAX_BYTES,
        "max_redirects": 4,
        **extra,
    }
    return load_settings(EXAMPLE_CONFIG, env={}, collect=collect)


def closed_port_url() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/x"


# -- content --------------------------------------------------------------------------------
def test_urls_become_readable_text(site: str, tree: Path) -> None:
    sources = [
        Source(type="url", url=f"{site}/article.html"),
        Source(type="url", url=f"{site}/data.json"),
        Source(type="url", url=f"{site}/latin1.txt"),
        Source(type="url", url=f"{site}/sniff"),
        Source(type="url", url=f"{site}/redirect", name="moved"),
    ]
    with Collector(make_settings(tree).collect) as collector:
        html, data, latin, sniff, moved = collector.collect(sources)
    assert all(item.ok for item in (html, data, latin, sniff, moved))
    assert "thirty-two sequences" in html.text and "seventy-two tokens" in html.text
    assert "tracking" not in html.text and "Home | About" not in html.text
    assert json.loads(data.text) == {"queue": "fleet.assistant", "depth": [1, 2]}
    assert '\n  "queue"' in data.text
    assert latin.text == "caf\u00e9 cr\u00e8me"
    assert sniff.text == "plain words, no type given"
    assert moved.name == "moved" and moved.text == html.text
    assert [item.index for item in (html, data, latin, sniff, moved)] == [0, 1, 2, 3, 4]
    assert all(item.untrusted for item in (html, data, latin, sniff, moved))


def test_hostile_json_nesting_is_kept_as_text_with_a_note(site: str, tree: Path) -> None:
    with Collector(make_settings(tree).collect) as collector:
        (item,) = collector.collect([Source(type="url", url=f"{site}/deep.json", name="deep")])
    assert item.ok and len(item.text) == 200_000
    assert item.notes == ["declared JSON but could not be parsed; kept as plain text"]


def test_files_inside_the_root_and_trust_defaults(tree: Path) -> None:
    sources = [
        Source(type="file", path=str(tree / "root" / "notes.txt")),
        Source(type="file", path="page.html"),  # relative: under the first allowed root
        Source(type="file", path="data.json", untrusted=False),
        Source(type="text", text="inline and trusted"),
        Source(type="text", text="inline but pasted from the web", untrusted=True),
    ]
    with Collector(make_settings(tree).collect) as collector:
        notes, page, data, inline, pasted = collector.collect(sources)
    assert notes.text == "inside the allowed root\n" and notes.untrusted
    assert "thirty-two sequences" in page.text and "tracking" not in page.text
    assert data.text == '{\n  "a": [\n    1,\n    2\n  ]\n}' and not data.untrusted
    assert inline.text == "inline and trusted" and not inline.untrusted
    assert inline.name == "text#4" and pasted.untrusted


# -- every way a source can fail --------------------------------------------------------------
def bad_sources(site: str, tree: Path) -> list[tuple[Source, str]]:
    root, outside = tree / "root", tree / "outside"
    return [
        (Source(type="url", url=f"{site}/slow", name="slow"), "read timed out after 0.4s"),
        (Source(type="url", url=f"{site}/huge", name="huge"), f"max_bytes ({MAX_BYTES})"),
        (Source(type="url", url=f"{site}/huge-declared", name="huge2"), "over collect.max_bytes"),
        (Source(type="url", url=f"{site}/binary", name="png"), "binary content (image/png)"),
        (Source(type="url", url=f"{site}/loop-a", name="loop"), "redirect loop"),
        (Source(type="url", url=f"{site}/chain/0", name="chain"), "more than 4 redirects"),
        (Source(type="url", url=f"{site}/missing", name="404"), "HTTP 404 Not Found"),
        (Source(type="url", url=closed_port_url(), name="down"), "request failed (ConnectError"),
        (Source(type="url", url="ftp://127.0.0.1/x", name="ftp"), "only http and https"),
        (
            Source(type="file", path=str(outside / "secret.txt"), name="abs"),
            "leads outside collect.allowed_roots",
        ),
        (
            Source(type="file", path="../outside/secret.txt", name="dotdot"),
            "leads outside collect.allowed_roots",
        ),
        (
            Source(type="file", path=str(root / "escape.txt"), name="link"),
            "goes through a symlink",
        ),
        (
            Source(type="file", path=str(root / "outdir" / "secret.txt"), name="linkdir"),
            "goes through a symlink",
        ),
        (Source(type="file", path=str(root / "nope.txt"), name="nofile"), "no such file"),
        (Source(type="file", path=str(root / "sub"), name="dir"), "not a regular file"),
        (Source(type="file", path=str(root / "blob.bin"), name="blob"), "binary content"),
        (Source(type="file", path="bad\x00name", name="nul"), "cannot resolve the path"),
    ]


def run_prepare(job: Job, settings: Settings, redis_client, key_prefix, counter):
    project = settings.projects[job.project]
    return prepare(job, settings, project, redis_client, Keys(key_prefix), 100_000, counter)


def test_each_bad_source_fails_the_job_with_its_reason(
    site: str, tree: Path, redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    settings = make_settings(tree, read_timeout_s=0.4)
    for source, reason in bad_sources(site, tree):
        job = Job(
            project="research",
            kind="collect+trim+infer",
            sources=[source],
            messages=[Message(role="user", content="summarise")],
        )
        with pytest.raises(CollectFailed) as caught:
            run_prepare(job, settings, redis_client, key_prefix, counter)
        assert caught.value.code is Code.E_COLLECT_FAILED
        assert f"source {source.name!r}" in caught.value.message, source.name
        assert reason in caught.value.message, (source.name, caught.value.message)


def test_drop_mode_keeps_the_good_sources_and_warns_for_each_bad_one(
    site: str, tree: Path, redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    settings = make_settings(tree, read_timeout_s=0.4)
    bad = bad_sources(site, tree)
    good = Source(type="url", url=f"{site}/article.html", name="good")
    job = Job(
        project="research",
        kind="collect+trim+infer",
        on_source_error="drop",
        sources=[good, *(s for s, _ in bad)],
        messages=[Message(role="user", content="summarise")],
    )
    prepared = run_prepare(job, settings, redis_client, key_prefix, counter)
    for source, reason in bad:
        assert any(
            w.startswith(f"source {source.name!r}") and "dropped" in w and reason in w
            for w in prepared.warnings
        ), (source.name, prepared.warnings)
    errors = {m["name"]: m["error"] for m in prepared.material}
    assert errors["good"] is None and all(errors[s.name] for s, _ in bad)
    material = [m for m in prepared.messages if m.untrusted]
    assert len(material) == 1 and "thirty-two sequences" in material[0].text()


def test_required_source_fails_even_in_drop_mode(
    site: str, tree: Path, redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    job = Job(
        project="research",
        kind="collect",
        on_source_error="drop",
        sources=[
            Source(type="url", url=f"{site}/missing", name="optional"),
            Source(type="url", url=f"{site}/missing", name="needed", required=True),
        ],
    )
    with pytest.raises(CollectFailed, match=r"source 'needed' \(url\): HTTP 404") as caught:
        run_prepare(job, make_settings(tree), redis_client, key_prefix, counter)
    assert "optional" not in caught.value.message


def test_no_allowed_roots_means_no_files(tree: Path) -> None:
    settings = load_settings(EXAMPLE_CONFIG, env={})
    with Collector(settings.collect) as collector:
        (item,) = collector.collect([Source(type="file", path=str(tree / "root" / "notes.txt"))])
    assert item.error == "file sources are disabled (collect.allowed_roots is empty)"


def test_download_deadline_stops_a_trickling_server(site: str, tree: Path) -> None:
    ticks = iter(range(0, 10_000, 100))  # every clock reading is 100 s later
    with Collector(make_settings(tree).collect, clock=lambda: float(next(ticks))) as collector:
        (item,) = collector.collect([Source(type="url", url=f"{site}/article.html")])
    assert item.error is not None and "download took longer than" in item.error


# -- a hostile project: collection must not be turned inward ------------------------------------
def serve(handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1") -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}"


class Internal(BaseHTTPRequestHandler):
    """An internal service (metadata endpoint, admin page) nobody outside may read."""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = b"internal secret: aws_access_key=AKIA..."
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def internal() -> Iterator[str]:
    # 127.0.0.2: loopback too, but outside the 127.0.0.1/32 the tests allow
    server, url = serve(Internal, "127.0.0.2")
    yield url
    server.shutdown()
    server.server_close()


def test_internal_addresses_are_refused_by_default(
    site: str, tree: Path, redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    settings = load_settings(EXAMPLE_CONFIG, env={}, collect={"connect_timeout_s": 2.0})
    job = Job(project="research", kind="collect",
              sources=[Source(type="url", url=f"{site}/article.html", name="inward")])
    with pytest.raises(CollectFailed) as caught:
        run_prepare(job, settings, redis_client, key_prefix, counter)
    assert caught.value.code is Code.E_COLLECT_FAILED
    assert "source 'inward' (url): '127.0.0.1' resolves to 127.0.0.1: not a public address" in (
        caught.value.message)
    port = site.rsplit(":", 1)[1]
    hosts = ["localhost", "169.254.169.254", "10.0.0.1", "172.16.5.4", "192.168.1.1", "100.64.0.9",
             "224.0.0.1", "0.0.0.0", "[::1]", "[::ffff:127.0.0.1]", "[fd00::1]", "[fe80::1]",
             "[64:ff9b::7f00:1]", "[2002:7f00:1::1]", "[::]", "[ff02::1]"]
    with Collector(settings.collect) as collector:
        items = collector.collect([Source(type="url", url=f"http://{h}:{port}/") for h in hosts])
    for host, item in zip(hosts, items, strict=True):
        assert item.error is not None and "not a public address" in item.error, (host, item.error)


def test_a_redirect_to_an_internal_address_is_refused(site: str, internal: str, tree: Path) -> None:
    with Collector(make_settings(tree).collect) as collector:
        direct, redirected = collector.collect([
            Source(type="url", url=f"{internal}/latest/meta-data"),
            Source(type="url", url=f"{site}/go?to={internal}/latest/meta-data")])
    for item in (direct, redirected):
        assert item.error is not None and "'127.0.0.2' resolves to 127.0.0.2: not a public address" in (
            item.error)
        assert "internal secret" not in item.text
    allowed = make_settings(tree, allow_networks=["127.0.0.0/8"]).collect
    with Collector(allowed) as collector:
        (item,) = collector.collect([Source(type="url", url=f"{site}/go?to={internal}/x")])
    assert item.ok and "internal secret" in item.text  # the same path works when allowed


def test_an_allowed_host_name_is_reached(site: str, tree: Path) -> None:
    settings = make_settings(tree, allow_networks=[], allow_hosts=["LocalHost"]).collect
    with Collector(settings) as collector:
        by_name, by_ip = collector.collect([
            Source(type="url", url=site.replace("127.0.0.1", "localhost") + "/data.json"),
            Source(type="url", url=f"{site}/data.json")])
    assert by_name.ok and json.loads(by_name.text)["queue"] == "fleet.assistant"
    assert by_ip.error is not None and "not a public address" in by_ip.error


class Trickle(BaseHTTPRequestHandler):
    """Sends its status line and headers one byte at a time, forever: every read gets a byte
    well within any read timeout."""

    stop = threading.Event()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Pad: "
        with contextlib.suppress(OSError):
            for byte in head:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            while not self.stop.wait(0.02):
                self.wfile.write(b"a")
                self.wfile.flush()


def in_thread(work: Callable[[], object], guard_s: float = 60.0) -> list[object]:
    """Runs ``work``; the join bound only keeps a regression from hanging the suite."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    thread.join(guard_s)
    return out


def test_headers_trickled_a_byte_at_a_time_end_at_the_deadline(tree: Path) -> None:
    handler = type("ThisTrickle", (Trickle,), {"stop": threading.Event()})
    server, url = serve(handler)
    settings = make_settings(tree, read_timeout_s=0.5, connect_timeout_s=0.5).collect
    try:
        with Collector(settings) as collector:
            done = in_thread(lambda: collector.collect([Source(type="url", url=f"{url}/slowloris")]))
    finally:
        handler.stop.set()
        server.shutdown()
        server.server_close()
    assert done, "the fetch did not end"
    [item] = done[0]  # type: ignore[misc]
    assert item.error == "download took longer than 2.5s"  # 0.5 + 4 * 0.5


BOMB_BYTES = 64 * 1024 * 1024


class Bomb(BaseHTTPRequestHandler):
    body = gzip.compress(bytes(BOMB_BYTES), compresslevel=9)  # ~64 KiB on the wire

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        with contextlib.suppress(OSError):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)


def test_a_gzip_bomb_stops_at_the_cap_while_decoding(tree: Path) -> None:
    server, url = serve(Bomb)
    try:
        with Collector(make_settings(tree).collect) as collector:
            tracemalloc.start()
            try:
                (item,) = collector.collect([Source(type="url", url=f"{url}/bomb", name="bomb")])
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    finally:
        server.shutdown()
        server.server_close()
    assert len(Bomb.body) < MAX_BYTES < BOMB_BYTES
    assert item.error is not None and f"decoded past collect.max_bytes ({MAX_BYTES})" in item.error
    assert peak < 20 * MAX_BYTES, peak  # 4 MB: nothing near the 64 MiB the body inflates to


def test_small_gzip_bodies_are_decoded(tree: Path) -> None:
    handler = type("Small", (Bomb,), {"body": gzip.compress("caf\u00e9 au lait".encode())})
    server, url = serve(handler)
    try:
        with Collector(make_settings(tree).collect) as collector:
            (item,) = collector.collect([Source(type="url", url=f"{url}/small")])
    finally:
        server.shutdown()
        server.server_close()
    assert item.ok and item.text == "caf\u00e9 au lait"


def test_a_fifo_under_the_root_is_refused_without_blocking(tree: Path) -> None:
    fifo = tree / "root" / "pipe.txt"
    os.mkfifo(fifo)
    try:
        with Collector(make_settings(tree).collect) as collector:
            done = in_thread(lambda: collector.collect([Source(type="file", path=str(fifo))]))
    finally:  # a blocked reader (the bug) is released by a writer
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert done, "open() blocked on the FIFO"
    [item] = done[0]  # type: ignore[misc]
    assert item.error == "not a regular file"


def test_a_directory_swapped_for_a_symlink_never_leads_out(tree: Path) -> None:
    """A racing swap: root/d flips between a real folder and a symlink to outside/ while the
    collector reads root/d/secret.txt over and over; only the inside file may ever be read."""
    root = tree / "root"
    (root / "d").mkdir()
    (root / "d" / "secret.txt").write_text("inside", encoding="utf-8")
    os.symlink(tree / "outside", root / "d-link")
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            os.rename(root / "d", root / "d-real")
            os.rename(root / "d-link", root / "d")
            os.rename(root / "d", root / "d-link")
            os.rename(root / "d-real", root / "d")

    flipper = threading.Thread(target=flip, daemon=True)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the two threads as finely as the GIL allows
    try:
        flipper.start()
        with Collector(make_settings(tree).collect) as collector:
            texts = [collector.collect_one(0, Source(type="file", path=str(root / "d" / "secret.txt"))).text
                     for _ in range(3000)]
    finally:
        sys.setswitchinterval(old_interval)
        stop.set()
        flipper.join()
    assert "secret outside the root\n" not in texts
    assert "inside" in texts


def test_project_roots_confine_a_projects_files(tree: Path) -> None:
    (tree / "root" / "sub" / "mine.txt").write_text("research only", encoding="utf-8")
    settings = make_settings(tree, project_roots={"research": [str(tree / "root" / "sub")]}).collect
    with Collector(settings) as collector:
        own, other = collector.collect([Source(type="file", path="mine.txt"),
                                        Source(type="file", path=str(tree / "root" / "notes.txt"))],
                                       project="research")
        shared = collector.collect([Source(type="file", path="notes.txt")], project="assistant")[0]
    assert own.text == "research only"
    assert other.error == "the path leads outside collect.project_roots.research"
    assert shared.text == "inside the allowed root\n"
