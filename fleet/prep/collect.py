"""Collection: turn a job's ``Source`` list (fleet/core/models.py) into text, one result per source.

A source is inline ``text``, a ``file`` under ``collect.allowed_roots``, or an HTTP(S) ``url``.
``Collector.collect`` never raises for a bad source: each ``Collected`` carries either its text
or an ``error`` naming the reason, and fleet/prep/prepare.py decides whether that fails the job
(``E_COLLECT_FAILED``) or drops the source with a warning. So a hostile page or a missing file can
end a job, but never crash a prep worker.

Files
  Only under ``collect.allowed_roots``, or, for a project listed in ``collect.project_roots``,
  only under that project's own roots (a relative path is taken under the first root). ``..``
  is applied to the path as written and must stay inside a root ("outside collect.allowed_roots").
  The file is then opened one component at a time from the root's descriptor, each with
  O_NOFOLLOW (directories also O_DIRECTORY): no symlink is followed, whether there before the
  check or swapped in after it ("goes through a symlink"). The last component is opened with
  O_NONBLOCK and must be a regular file by fstat: a FIFO, socket or device is refused at once
  instead of blocking the worker. No roots configured means no file sources at all. Larger
  than ``max_bytes`` is an error.

URLs
  Only http and https, at every hop. Each host is resolved once and every address checked:
  loopback, private, link-local (the 169.254.169.254 metadata address), CGNAT, multicast,
  reserved and unspecified addresses, IPv4 embedded in IPv6 included, are refused ("not a
  public address") unless the host is in ``collect.allow_hosts`` or the address in
  ``collect.allow_networks``; the connection then goes to that checked address (TLS still
  verifies the URL's host name), so DNS cannot answer differently between check and connect.
  Redirects are followed by hand, at most ``max_redirects``, each hop checked the same way; a
  URL seen twice is a "redirect loop". No proxy from the environment is used.
  Time: ``connect_timeout_s`` / ``read_timeout_s`` per network operation, and one deadline of
  ``connect_timeout_s + 4 * read_timeout_s`` over the whole fetch, every hop's connect, headers
  and body included: every socket call gets at most what is left of it ("download took longer
  than"), so a server trickling one byte at a time cannot hold a worker.
  Size: the body is streamed and gzip/deflate decoded by hand, stopping as soon as either the
  bytes received or the bytes decoded pass ``max_bytes`` (a small gzip bomb never inflates past
  the cap): that is an ERROR, not a truncation. (A cut HTML or JSON document is not reliably
  readable, and 5 MB is far beyond any prompt; trimming to the prompt budget happens later, on
  the extracted text, where it can keep head and tail.) HTTP 4xx/5xx is an error with the status.

Content types (URLs by header, files by extension; no type -> sniffed)
  HTML -> readable main text via trafilatura (boilerplate removed; the full page text when it
  finds no main content); JSON -> pretty-printed; text/*, XML, YAML, ... -> decoded text
  (declared charset, else UTF-8, else detected); anything else (images, PDF, archives) or
  bytes that are not text -> "binary content ... is not supported".

Trust: file and URL material is untrusted unless the source says ``untrusted: false``; inline
text is trusted unless it says ``untrusted: true``.
"""

from __future__ import annotations

import email.message
import json
import logging
import math
import mimetypes
import os
import socket
import stat
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import charset_normalizer  # a dependency of trafilatura
import httpcore
import httpx
import trafilatura

from fleet.core.config import CollectSettings
from fleet.core.models import Source
from fleet.prep.netguard import AddressPolicy, AddressRefused, GuardedBackend
from fleet.prep.roots import PathRefused, open_under

log = logging.getLogger(__name__)

USER_AGENT = "fleet-collect/0.1"
DEADLINE_READS = 4  # whole-download deadline = connect timeout + this many read timeouts
SNIFF_BYTES = 8192
_HTML_TYPES = {"text/html", "application/xhtml+xml"}
_TEXT_TYPES = {
    "application/xml",
    "application/javascript",
    "application/x-javascript",
    "application/ecmascript",
    "application/yaml",
    "application/x-yaml",
    "application/toml",
    "application/x-sh",
    "application/sql",
    "application/csv",
}
_SNIFF_TYPES = {"", "application/octet-stream", "binary/octet-stream"}


class SourceError(Exception):
    """Why one source could not be collected; becomes ``Collected.error``."""


@dataclass
class Collected:
    index: int
    name: str
    type: str
    untrusted: bool
    required: bool | None
    text: str = ""
    error: str | None = None
    content_type: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


def source_name(source: Source, index: int) -> str:
    return source.name or source.url or source.path or f"text#{index + 1}"


class Collector:
    """Collects sources with one shared HTTP client (connection reuse across jobs)."""

    def __init__(
        self,
        settings: CollectSettings,
        network: httpcore.NetworkBackend | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_parallel: int = 4,
        resolve: Callable[..., list[Any]] = socket.getaddrinfo,
    ) -> None:
        self.settings = settings
        self._roots = _resolve_roots(settings.allowed_roots)
        self._project_roots = {p: _resolve_roots(r) for p, r in settings.project_roots.items()}
        self._clock = clock
        self._max_parallel = max_parallel
        self._deadline_s = settings.connect_timeout_s + DEADLINE_READS * settings.read_timeout_s
        self._timeouts = {
            "connect": settings.connect_timeout_s,
            "read": settings.read_timeout_s,
            "write": settings.read_timeout_s,
            "pool": settings.connect_timeout_s,
        }
        policy = AddressPolicy(settings.allow_hosts, settings.allow_networks, resolve)
        self._network = GuardedBackend(policy, clock, network)
        # httpcore, not httpx: its network backend is where addresses are pinned and the
        # deadline enforced, and it hands over the body still encoded, to be decoded under the cap.
        self._http = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(), network_backend=self._network
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public ---------------------------------------------------------------------------
    def collect(self, sources: list[Source], project: str | None = None) -> list[Collected]:
        """Every source collected (in order); files and URLs in parallel threads. ``project``
        picks its file roots (``collect.project_roots``)."""
        slow = [i for i, s in enumerate(sources) if s.type != "text"]
        if len(slow) <= 1 or self._max_parallel <= 1:
            return [self.collect_one(i, s, project) for i, s in enumerate(sources)]
        with ThreadPoolExecutor(max_workers=min(self._max_parallel, len(slow))) as pool:
            futures = {i: pool.submit(self.collect_one, i, sources[i], project) for i in slow}
            return [
                futures[i].result() if i in futures else self.collect_one(i, s, project)
                for i, s in enumerate(sources)
            ]

    def collect_one(self, index: int, source: Source, project: str | None = None) -> Collected:
        untrusted = source.untrusted if source.untrusted is not None else source.type != "text"
        item = Collected(index, source_name(source, index), source.type, untrusted, source.required)
        started = self._clock()
        try:
            if source.type == "text":
                item.text = source.text or ""
            elif source.type == "file":
                item.text, item.content_type = self._read_file(source.path or "", item.notes, project)
            else:
                item.text, item.content_type = self._fetch_url(source.url or "", item.notes)
        except SourceError as exc:
            item.error = str(exc)
            log.info("source %s (%s) failed: %s", item.name, source.type, exc)
        else:
            log.debug(
                "source %s: %d chars in %.3fs", item.name, len(item.text), self._clock() - started
            )
        return item

    # -- files ----------------------------------------------------------------------------
    def _read_file(self, raw_path: str, notes: list[str], project: str | None) -> tuple[str, str]:
        roots, setting = self._roots_of(project)
        try:
            fd = open_under(roots, raw_path, setting)
        except PathRefused as exc:
            raise SourceError(str(exc)) from exc
        try:
            body = self._read_capped_file(fd)
        finally:
            os.close(fd)
        content_type = mimetypes.guess_type(raw_path)[0] or ""
        return to_text(body, content_type, None, notes), content_type

    def _roots_of(self, project: str | None) -> tuple[list[Path], str]:
        if project in self._project_roots:
            roots, setting = self._project_roots[project], f"collect.project_roots.{project}"
        else:
            roots, setting = self._roots, "collect.allowed_roots"
        if not roots:
            raise SourceError(f"file sources are disabled ({setting} is empty)")
        return roots, setting

    def _read_capped_file(self, fd: int) -> bytes:
        cap = self.settings.max_bytes
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise SourceError("not a regular file")
            if info.st_size > cap:
                raise SourceError(f"file is {info.st_size} bytes, over collect.max_bytes ({cap})")
            body = _read_fd(fd, cap + 1)
        except OSError as exc:
            raise SourceError(f"cannot read the file ({exc.strerror})") from exc
        if len(body) > cap:
            raise SourceError(f"file grew past collect.max_bytes ({cap})")
        return body

    # -- URLs -----------------------------------------------------------------------------
    def _fetch_url(self, url: str, notes: list[str]) -> tuple[str, str]:
        seen: set[str] = set()
        self._network.deadline.at = self._clock() + self._deadline_s
        try:
            for _hop in range(self.settings.max_redirects + 1):
                _check_scheme(url)
                if url in seen:
                    raise SourceError(f"redirect loop (back to {url})")
                seen.add(url)
                outcome = self._get(url)
                if isinstance(outcome, str):
                    url = outcome  # a redirect: follow it (checked like the first hop)
                    continue
                body, content_type, charset = outcome
                return to_text(body, content_type, charset, notes), content_type
        finally:
            self._network.deadline.at = math.inf
        raise SourceError(f"more than {self.settings.max_redirects} redirects")

    def _get(self, url: str) -> str | tuple[bytes, str, str | None]:
        """The next URL for a redirect, else (body, content type, charset); errors translated."""
        try:
            target = httpx.URL(url)
            with self._http.stream("GET", str(target), headers=_REQUEST_HEADERS,
                                   extensions={"timeout": self._timeouts}) as response:
                return self._answer(target, response)
        except AddressRefused as exc:
            raise SourceError(str(exc)) from exc
        except httpcore.TimeoutException as exc:
            raise SourceError(self._describe_timeout(exc)) from exc
        except httpx.InvalidURL as exc:
            raise SourceError(f"invalid URL ({exc})") from exc
        except _HTTPCORE_ERRORS as exc:
            raise SourceError(f"request failed ({type(exc).__name__}: {exc})") from exc

    def _answer(self, url: httpx.URL, response: httpcore.Response) -> str | tuple[bytes, str, str | None]:
        fields = httpx.Headers(response.headers)
        if response.status in _REDIRECTS and "location" in fields:
            return str(url.join(fields["location"]))
        if response.status >= 400:
            reason = response.extensions.get("reason_phrase", b"").decode("ascii", "replace")
            raise SourceError(f"HTTP {response.status} {reason}".strip())
        header = fields.get("content-type", "")
        cap = self.settings.max_bytes
        declared = fields.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise SourceError(f"body is {declared} bytes, over collect.max_bytes ({cap})")
        body = _Inflater(fields.get("content-encoding", ""), cap)
        for chunk in response.iter_stream():
            body.feed(chunk)
        return body.finish(), header.split(";")[0].strip().lower(), _charset(header)

    def _describe_timeout(self, exc: httpcore.TimeoutException) -> str:
        if self._clock() >= self._network.deadline.at:
            return f"download took longer than {self._deadline_s:g}s"
        if isinstance(exc, httpcore.ConnectTimeout | httpcore.PoolTimeout):
            return f"connect timed out after {self.settings.connect_timeout_s:g}s"
        return f"read timed out after {self.settings.read_timeout_s:g}s"


def _read_fd(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 20, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _check_scheme(url: str) -> None:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("http", "https"):
        raise SourceError(f"only http and https URLs are collected, not {url[:80]!r}")


_REQUEST_HEADERS = [(b"User-Agent", USER_AGENT.encode()), (b"Accept-Encoding", b"gzip, deflate")]
_HTTPCORE_ERRORS = (
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    httpcore.ProxyError,
)


def _resolve_roots(roots: list[str]) -> list[Path]:
    return [Path(r).expanduser().resolve() for r in roots]


def _charset(content_type: str) -> str | None:
    header = email.message.Message()
    header["content-type"] = content_type
    return header.get_content_charset()


class _Inflater:
    """A body decoded as it arrives, stopping as soon as the bytes received or the bytes decoded
    pass the cap: zlib is asked for at most what is left, so nothing is inflated past it."""

    def __init__(self, encoding: str, cap: int) -> None:
        self.encoding = encoding.strip().lower() or "identity"
        if self.encoding not in ("identity", "gzip", "x-gzip", "deflate"):
            raise SourceError(f"content-encoding {self.encoding!r} is not supported")
        # 32 + MAX_WBITS: a gzip or zlib header, whichever comes
        self._zlib = None if self.encoding == "identity" else zlib.decompressobj(32 + zlib.MAX_WBITS)
        self.cap = cap
        self.received = 0
        self.decoded = 0
        self._chunks: list[bytes] = []

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self.cap:
            raise SourceError(f"body passed collect.max_bytes ({self.cap}); download stopped")
        if self._zlib is None:
            self._keep(data)
            return
        try:
            while data:
                self._keep(self._zlib.decompress(data, self.cap + 1 - self.decoded))
                data = self._zlib.unconsumed_tail
        except zlib.error as exc:
            raise SourceError(f"body is not valid {self.encoding} ({exc})") from exc

    def finish(self) -> bytes:
        if self._zlib is not None:
            self._keep(self._zlib.flush(self.cap + 1 - self.decoded))
        return b"".join(self._chunks)

    def _keep(self, piece: bytes) -> None:
        self.decoded += len(piece)
        if self.decoded > self.cap:
            raise SourceError(
                f"body decoded past collect.max_bytes ({self.cap}) from {self.received} bytes "
                f"received ({self.encoding}); download stopped"
            )
        self._chunks.append(piece)


# -- URLs -----------------------------------------------------------------------------------------
_REDIRECTS = {301, 302, 303, 307, 308}
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


# -- bytes to text --------------------------------------------------------------------------
def to_text(body: bytes, content_type: str, charset: str | None, notes: list[str]) -> str:
    """Readable text from a body of the given type, or SourceError for binary content."""
    kind = _kind(content_type)
    if kind == "binary":
        raise SourceError(f"binary content ({content_type}) is not supported")
    text = _decode(body, charset, content_type)
    if kind == "html" or (kind == "sniff" and _looks_like_html(text)):
        return html_to_text(text)
    if kind == "json":
        return _pretty_json(text, notes)
    return text


def _kind(content_type: str) -> str:
    if content_type in _HTML_TYPES:
        return "html"
    if content_type == "application/json" or content_type.endswith("+json"):
        return "json"
    if content_type.startswith("text/") or content_type in _TEXT_TYPES:
        return "text"
    if content_type.endswith("+xml"):
        return "text"
    if content_type in _SNIFF_TYPES:
        return "sniff"
    return "binary"


def _decode(body: bytes, charset: str | None, content_type: str) -> str:
    if b"\x00" in body[:SNIFF_BYTES]:
        raise SourceError(f"binary content ({content_type or 'no type'}) is not supported")
    if charset:
        try:
            return body.decode(charset, errors="replace")
        except LookupError:
            pass  # an unknown charset name: fall through to UTF-8 and detection
    try:
        return body.decode("utf-8-sig")
    except UnicodeDecodeError:
        best = charset_normalizer.from_bytes(body).best()
        if best is None:
            raise SourceError(
                f"binary content ({content_type or 'no type'}) is not supported"
            ) from None
        return str(best)


def _looks_like_html(text: str) -> bool:
    head = text[:1024].lstrip().lower()
    return head.startswith(("<!doctype html", "<html"))


def html_to_text(html: str) -> str:
    """The page's readable main text (trafilatura), else all its visible text."""
    try:
        text = trafilatura.extract(html, include_comments=False, include_tables=True)
        if not text:
            text = trafilatura.html2txt(html)
    except Exception as exc:  # a third-party parser on hostile input: no failure may escape
        raise SourceError(f"HTML could not be parsed ({type(exc).__name__})") from exc
    return text or ""


def _pretty_json(text: str, notes: list[str]) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):  # RecursionError: hostile nesting depth
        notes.append("declared JSON but could not be parsed; kept as plain text")
        return text
