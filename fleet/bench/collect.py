"""Benchmark: collect + trim throughput (MB/s of text, jobs/s) on local material.

What runs: a local HTTP server (http.server in a thread, real sockets) serving generated HTML
articles with boilerplate and JSON documents, plus text files in a temporary allowed root. Each
job has ``sources_per_job`` sources (HTML, file, JSON in turn), every job's material is different
(so the token cache does not turn it into a lookup), and jobs run through ``prepare`` on
``workers`` threads (prep workers with a thread pool), once as kind ``collect`` and once as kind
``trim`` (collect + whitespace/duplicates + fit to ``room_tokens``).

Token counts come from a real /tokenize: by default a ``fleet sim`` process started here (exact
counts over HTTP as in production), or ``backend_url`` (an existing server), or ``backend_url=""``
for the character estimate only. The cache lives in Redis (``redis_url``, the bench's) under a private
key prefix that is deleted afterwards. Settings are the shipped example's: nothing of the
operator's fleet.toml or ``FLEET_*`` variables.

Reported per kind: jobs, raw MB fetched/read, MB of extracted text, wall seconds, MB/s of
text, jobs/s, /tokenize calls per job and the p50/p95 job latency.
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import redis
from rich.console import Console
from rich.table import Table

from fleet.bench.measure import percentile
from fleet.core.config import EXAMPLE_CONFIG, Settings, load_settings
from fleet.core.keys import Keys
from fleet.core.models import Job, JobKind, Message, Source
from fleet.prep.collect import Collector
from fleet.prep.prepare import prepare
from fleet.prep.tokens import TokenCounter

VOCAB = [
    "request", "queue", "worker", "lease", "token", "budget", "prefix", "block", "cache",
    "stream", "dispatcher", "admission", "project", "fairness", "latency", "throughput",
    "model", "reasoning", "answer", "retry", "timeout", "backend", "memory", "document",
    "source", "trim", "collect", "paragraph", "summary", "report", "glossary", "tool", "schema",
]  # fmt: skip
BOILERPLATE = "<nav>Home | Products | Pricing | About us | Contact</nav>"
FOOTER = "<footer>Copyright 2025 Example Corp. All rights reserved. Privacy | Terms</footer>"


def paragraphs(rng: random.Random, size_bytes: int) -> list[str]:
    out, total = [], 0
    while total < size_bytes:
        text = " ".join(rng.choice(VOCAB) for _ in range(rng.randint(40, 120))).capitalize() + "."
        out.append(text)
        total += len(text) + 9
    return out


def html_document(seed: int, size_bytes: int) -> bytes:
    rng = random.Random(seed)
    body = "".join(f"<p>{p}</p>\n" for p in paragraphs(rng, size_bytes))
    page = (
        f"<!doctype html><html><head><title>Doc {seed}</title></head><body>{BOILERPLATE}"
        f"<article><h1>Document {seed}</h1>\n{body}</article>{FOOTER}</body></html>"
    )
    return page.encode()


def json_document(seed: int, size_bytes: int) -> bytes:
    rng = random.Random(seed)
    items = [{"id": i, "note": p} for i, p in enumerate(paragraphs(rng, size_bytes))]
    return json.dumps({"seed": seed, "items": items}, separators=(",", ":")).encode()


class Site:
    """Documents served by the material server, generated before the clock starts, and the
    bytes sent so far (thread-safe)."""

    def __init__(self) -> None:
        self.documents: dict[str, tuple[str, bytes]] = {}
        self.bytes_sent = 0
        self.lock = threading.Lock()


@contextmanager
def material_server(site: Site) -> Iterator[str]:
    """Serves ``site.documents`` by path on 127.0.0.1 (a free port)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            content_type, body = site.documents.get(self.path, ("text/plain", b""))
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with suppress(OSError):
                self.wfile.write(body)
            with site.lock:
                site.bytes_sent += len(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Run:
    kind: str
    jobs: int
    raw_bytes: int
    text_chars: int
    wall_s: float
    latencies_s: list[float]
    tokenize_calls: int

    @property
    def text_mb_per_s(self) -> float:
        return self.text_chars / 1e6 / self.wall_s

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.wall_s


def make_jobs(
    kind: JobKind,
    n: int,
    per_job: int,
    base: str,
    root: Path,
    site: Site,
    doc_bytes: int,
    tag: int,
) -> tuple[list[Job], int]:
    """``n`` jobs with unique material; also the bytes of the files written for them."""
    jobs, file_bytes = [], 0
    for j in range(n):
        sources = []
        for s in range(per_job):
            seed = tag * 1_000_000 + j * 100 + s
            if s % 3 == 1:
                path = root / f"doc-{seed}.txt"
                path.write_text("\n\n".join(paragraphs(random.Random(seed), doc_bytes)))
                file_bytes += path.stat().st_size
                sources.append(Source(type="file", path=str(path)))
            elif s % 3 == 0:
                site.documents[f"/doc/{seed}.html"] = ("text/html", html_document(seed, doc_bytes))
                sources.append(Source(type="url", url=f"{base}/doc/{seed}.html"))
            else:
                site.documents[f"/doc/{seed}.json"] = (
                    "application/json",
                    json_document(seed, doc_bytes),
                )
                sources.append(Source(type="url", url=f"{base}/doc/{seed}.json"))
        question = Message(role="user", content="Summarise the material.")
        jobs.append(Job(project="bench", kind=kind, sources=sources, messages=[question]))
    return jobs, file_bytes


def run_jobs(
    jobs: list[Job],
    settings: Settings,
    client: redis.Redis,
    keys: Keys,
    counter: TokenCounter,
    room_tokens: int,
    workers: int,
) -> tuple[list[float], int, float]:
    """Latencies, collected characters and wall seconds of running ``jobs`` on threads."""
    project = settings.projects["bench"]
    with Collector(settings.collect) as collector:

        def one(job: Job) -> tuple[float, int]:
            started = time.perf_counter()
            prepared = prepare(
                job, settings, project, client, keys, room_tokens, counter, collector=collector
            )
            if any(m["error"] for m in prepared.material):
                raise RuntimeError(f"benchmark source failed: {prepared.material}")
            chars = sum(m["collected_chars"] for m in prepared.material)
            return time.perf_counter() - started, chars

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(one, jobs))
        wall_s = time.perf_counter() - started
    return [r[0] for r in results], sum(r[1] for r in results), wall_s


def render(runs: list[Run], tokenizer: str, workers: int) -> Table:
    table = Table(title=f"collect + trim throughput ({workers} prep threads, counts: {tokenizer})")
    for column in (
        "kind",
        "jobs",
        "raw MB",
        "text MB",
        "wall s",
        "text MB/s",
        "jobs/s",
        "/tokenize per job",
        "p50 ms",
        "p95 ms",
    ):
        table.add_column(column, justify="left" if column == "kind" else "right")
    for run in runs:
        table.add_row(
            run.kind,
            str(run.jobs),
            f"{run.raw_bytes / 1e6:.1f}",
            f"{run.text_chars / 1e6:.1f}",
            f"{run.wall_s:.2f}",
            f"{run.text_mb_per_s:.2f}",
            f"{run.jobs_per_s:.1f}",
            f"{run.tokenize_calls / run.jobs:.1f}",
            f"{percentile(run.latencies_s, 50) * 1000:.0f}",
            f"{percentile(run.latencies_s, 95) * 1000:.0f}",
        )
    return table


@contextmanager
def _token_backend(backend_url: str | None) -> Iterator[tuple[str, str]]:
    """(url, label): a started ``fleet sim`` when None, else the given URL ("" = estimate)."""
    if backend_url is not None:
        yield backend_url, backend_url or "estimate"
        return
    from fleet.sim.server import free_port, start_sim_process

    process = start_sim_process(free_port())
    try:
        yield process.base_url, "fleet sim /tokenize"
    finally:
        process.stop()


def bench_collect(
    jobs: int = 30,
    sources_per_job: int = 3,
    doc_kb: int = 100,
    room_tokens: int = 16_000,
    workers: int = 4,
    backend_url: str | None = None,
    redis_url: str = "",
) -> Table:
    """Run ``jobs`` collect jobs and ``jobs`` trim jobs against the Redis of ``redis_url``; print
    and return the table."""
    client = redis.Redis.from_url(redis_url)
    keys = Keys(f"bench-collect-{uuid.uuid4().hex[:8]}:")
    doc_bytes = doc_kb * 1000
    runs: list[Run] = []
    try:
        with (
            tempfile.TemporaryDirectory(prefix="fleet-bench-collect-") as tmp,
            _token_backend(backend_url) as (url, label),
        ):
            settings = _bench_settings(tmp, doc_bytes)
            site = Site()
            counter = TokenCounter(url, settings.backend.model, client, keys)
            with material_server(site) as base:
                kinds: tuple[JobKind, ...] = ("collect", "trim")
                for tag, kind in enumerate(kinds, start=1):
                    batch, file_bytes = make_jobs(
                        kind, jobs, sources_per_job, base, Path(tmp), site, doc_bytes, tag
                    )
                    sent_before, calls_before = site.bytes_sent, counter.backend_calls
                    latencies, chars, wall_s = run_jobs(
                        batch, settings, client, keys, counter, room_tokens, workers
                    )
                    raw = site.bytes_sent - sent_before + file_bytes
                    calls = counter.backend_calls - calls_before
                    runs.append(Run(kind, jobs, raw, chars, wall_s, latencies, calls))
            counter.close()
    finally:
        for key in client.scan_iter(match=f"{keys.prefix}*", count=1000):
            client.delete(key)
        client.close()
    table = render(runs, label, workers)
    Console().print(table)
    return table


def _bench_settings(root: str, doc_bytes: int) -> Settings:
    return load_settings(
        EXAMPLE_CONFIG, env={},
        # the material server listens on 127.0.0.1, a non-public address refused by default
        collect={"allowed_roots": [root], "max_bytes": max(5_000_000, 4 * doc_bytes),
                 "allow_networks": ["127.0.0.1/32"]},
        projects={"bench": {"secret": "bench-secret-not-used"}},
    )
