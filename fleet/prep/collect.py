"""Collection: turn a job's ``Source`` list (fleet/core/models.py) into text, one result per source.

A source is inline ``text``, a ``file`` under ``collect.allowed_roots``, or an HTTP(S) ``url``.
``Collector.collect`` never raises for a bad source: each ``Collected`` carries either its text
or an ``error`` naming the reason, and fleet/prep/prepare.py decides whether that fails the job
(``E_COLLECT_FAILED``) or drops the source with a warning. So a hostile page or a missing file can
end a job, but never crash a prep worker.

Files
  The path is resolved with every symlink followed (a relative path is taken under the first
  allowed root) and must land inside one of the allowed roots; ``..`` and symlinks pointing
  out are refused with "outside collect.allowed_roots". No roots configured means no file
  sources at all. The final open uses O_NOFOLLOW, so a symlink swapped in after the check is
  refused too. Larger than ``max_bytes`` is an error.

URLs
  httpx with ``connect_timeout_s`` / ``read_timeout_s`` (per network read) and a whole-download
  deadline of ``connect_timeout_s + 4 * read_timeout_s`` (so a server trickling a byte at a time
  cannot hold a worker forever). Redirects are followed by hand, at most ``max_redirects``; a
  URL seen twice is a "redirect loop". Only http and https, also after a redirect.
  The body is streamed and the download stops as soon as it passes ``max_bytes``: that is an
  ERROR, not a truncation. (A cut HTML or JSON document is not reliably readable, and 5 MB is
  far beyond any prompt; trimming to the prompt budget happens later, on the extracted text,
  where it can keep head and tail.) HTTP 4xx/5xx is an error with the status.

Content types (URLs by header, files by extension; no type -> sniffed)
  HTML -> readable main text via trafilatura (boilerplate removed; the full page text when it
  finds no main content); JSON -> pretty-printed; text/*, XML, YAML, ... -> decoded text
  (declared charset, else UTF-8, else detected); anything else (images, PDF, archives) or
  bytes that are not text -> "binary content ... is not supported".

Trust: file and URL material is untrusted unless the source says ``untrusted: false``; inline
text is trusted unless it says ``untrusted: true``.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import os
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import charset_normalizer  # a dependency of trafilatura
import httpx
import trafilatura

from fleet.core.config import CollectSettings
from fleet.core.models import Source

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
        transport: httpx.BaseTransport | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_parallel: int = 4,
    ) -> None:
        self.settings = settings
        self._roots = [Path(r).expanduser().resolve() for r in settings.allowed_roots]
        self._clock = clock
        self._max_parallel = max_parallel
        self._deadline_s = settings.connect_timeout_s + DEADLINE_READS * settings.read_timeout_s
        self._http = httpx.Client(
            transport=transport,
            follow_redirects=False,
            timeout=httpx.Timeout(
                connect=settings.connect_timeout_s,
                read=settings.read_timeout_s,
                write=settings.read_timeout_s,
                pool=settings.connect_timeout_s,
            ),
            headers={"User-Agent": USER_AGENT},
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public ---------------------------------------------------------------------------
    def collect(self, sources: list[Source]) -> list[Collected]:
        """Every source collected (in order); files and URLs in parallel threads."""
        slow = [i for i, s in enumerate(sources) if s.type != "text"]
        if len(slow) <= 1 or self._max_parallel <= 1:
            return [self.collect_one(i, s) for i, s in enumerate(sources)]
        with ThreadPoolExecutor(max_workers=min(self._max_parallel, len(slow))) as pool:
            futures = {i: pool.submit(self.collect_one, i, sources[i]) for i in slow}
            return [
                futures[i].result() if i in futures else self.collect_one(i, s)
                for i, s in enumerate(sources)
            ]

    def collect_one(self, index: int, source: Source) -> Collected:
        untrusted = source.untrusted if source.untrusted is not None else source.type != "text"
        item = Collected(index, source_name(source, index), source.type, untrusted, source.required)
        started = self._clock()
        try:
            if source.type == "text":
                item.text = source.text or ""
            elif source.type == "file":
                item.text, item.content_type = self._read_file(source.path or "", item.notes)
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
    def _read_file(self, raw_path: str, notes: list[str]) -> tuple[str, str]:
        real = self._resolve_inside_roots(raw_path)
        body = self._read_capped_file(real)
        content_type = mimetypes.guess_type(real.name)[0] or ""
        return to_text(body, content_type, None, notes), content_type

    def _resolve_inside_roots(self, raw_path: str) -> Path:
        if not self._roots:
            raise SourceError("file sources are disabled (collect.allowed_roots is empty)")
        path = Path(raw_path).expanduser()
        if not path.is_absolute():
            path = self._roots[0] / path
        try:
            real = path.resolve(strict=True)
        except FileNotFoundError as exc:
            raise SourceError("no such file") from exc
        except (OSError, RuntimeError, ValueError) as exc:  # symlink loop, NUL in the path
            raise SourceError(f"cannot resolve the path ({exc})") from exc
        if not self._inside(real):
            lexical = Path(os.path.normpath(path.absolute()))
            how = "through a symlink " if self._inside(lexical) else ""
            raise SourceError(f"the path leads {how}outside collect.allowed_roots")
        return real

    def _inside(self, path: Path) -> bool:
        return any(path.is_relative_to(root) for root in self._roots)

    def _read_capped_file(self, real: Path) -> bytes:
        cap = self.settings.max_bytes
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise SourceError(f"cannot open the file ({exc.strerror})") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise SourceError("not a regular file")
            if info.st_size > cap:
                raise SourceError(f"file is {info.st_size} bytes, over collect.max_bytes ({cap})")
            body = _read_fd(fd, cap + 1)
        except OSError as exc:
            raise SourceError(f"cannot read the file ({exc.strerror})") from exc
        finally:
            os.close(fd)
        if len(body) > cap:
            raise SourceError(f"file grew past collect.max_bytes ({cap})")
        return body

    # -- URLs -----------------------------------------------------------------------------
    def _fetch_url(self, url: str, notes: list[str]) -> tuple[str, str]:
        seen: set[str] = set()
        deadline = self._clock() + self._deadline_s
        for _hop in range(self.settings.max_redirects + 1):
            _check_scheme(url)
            if url in seen:
                raise SourceError(f"redirect loop (back to {url})")
            seen.add(url)
            try:
                outcome = self._get(url, deadline)
            except httpx.TimeoutException as exc:
                raise SourceError(_describe_timeout(exc, self.settings)) from exc
            except httpx.InvalidURL as exc:
                raise SourceError(f"invalid URL ({exc})") from exc
            except httpx.HTTPError as exc:
                raise SourceError(f"request failed ({type(exc).__name__}: {exc})") from exc
            if isinstance(outcome, str):
                url = outcome  # a redirect: follow it
                continue
            body, content_type, charset = outcome
            return to_text(body, content_type, charset, notes), content_type
        raise SourceError(f"more than {self.settings.max_redirects} redirects")

    def _get(self, url: str, deadline: float) -> str | tuple[bytes, str, str | None]:
        """The next URL for a redirect, else (body, content type, charset)."""
        with self._http.stream("GET", url) as response:
            if response.is_redirect:
                return str(response.url.join(response.headers["location"]))
            if response.status_code >= 400:
                raise SourceError(f"HTTP {response.status_code} {response.reason_phrase}".strip())
            content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
            body = self._read_capped_body(response, deadline)
            return body, content_type, response.charset_encoding

    def _read_capped_body(self, response: httpx.Response, deadline: float) -> bytes:
        cap = self.settings.max_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise SourceError(f"body is {declared} bytes, over collect.max_bytes ({cap})")
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > cap:
                raise SourceError(f"body passed collect.max_bytes ({cap}); download stopped")
            if self._clock() > deadline:
                raise SourceError(f"download took longer than {self._deadline_s:g}s")
            chunks.append(chunk)
        return b"".join(chunks)


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


def _describe_timeout(exc: httpx.TimeoutException, settings: CollectSettings) -> str:
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return f"connect timed out after {settings.connect_timeout_s:g}s"
    return f"read timed out after {settings.read_timeout_s:g}s"


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
