"""Collection against a REAL local HTTP server (http.server in a thread, real sockets) and real
files: normal, slow, huge, binary, redirect-loop and 404 pages, files outside the allowed roots
and a symlink escape. Every bad source ends as E_COLLECT_FAILED naming the source and reason
(fail mode) or as a warning (drop mode); nothing raises anything else."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
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


def make_settings(tree: Path, read_timeout_s: float = 10.0) -> Settings:
    collect = {
        "allowed_roots": [str(tree / "root")],
        "connect_timeout_s": 2.0,
        "read_timeout_s": read_timeout_s,
        "max_bytes": MAX_BYTES,
        "max_redirects": 4,
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
            "through a symlink outside",
        ),
        (
            Source(type="file", path=str(root / "outdir" / "secret.txt"), name="linkdir"),
            "through a symlink outside",
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
