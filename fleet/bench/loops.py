"""``fleet bench loops``: what the loop watcher saves, and what it costs.

Runs ``jobs`` inference jobs against ``fleet sim`` (started here as a real process) directly
through ``run_inference`` (no Celery), once with the watcher on and once with it off, in the same
run and with the same jobs. ``loop_share`` of them loop on their first attempt only
(``[sim:loop/1]`` and ``[sim:loop_fuzzy/1]`` alternately), so a retry can succeed.

Reported per mode:
  wasted reasoning tokens   reasoning tokens of looping jobs spent in attempts whose answer was
                            not the final one, plus, when a looping attempt ran to its forced end,
                            the reasoning past the point where the loop began (lead tokens)
  looping jobs OK in <= 2   share of looping jobs that end with an OK code within two attempts
  attempts, wall time
And the watcher's CPU cost per 1,000 streamed tokens, measured with ``time.process_time`` over a
replay of the reasoning corpus (``reasoning/normal_traces.jsonl``, docs/testing.md; a generated
text when it is absent), in 4-character pieces (about one token each).

A second table replays template loops through the watcher alone: the real looping traces
(``reasoning/loop_traces.jsonl``) and the seeded generator's English and Japanese loops
(fleet/bench/loopgen.py, leads cut from the normal traces), and reports recall, false alarms (a
verdict on a normal trace, or in a generated trace's lead), how far past the onset the loop was cut
and the reasoning tokens saved against letting it run to the end of the trace (the thinking budget
for the real ones: most never closed their reasoning). The onset of a real loop is the first
occurrence of a 20-word span that then repeats 10 or more times (the corpus's own selection rule),
so "after onset" there is an upper bound. Tokens are estimated as 4 characters (English) or 1
character (Japanese).
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from fleet.bench.loopgen import generate_loops
from fleet.core.config import EXAMPLE_CONFIG, Settings, WatcherSettings, load_settings
from fleet.core.events import EventSink
from fleet.core.keys import Keys
from fleet.core.models import Envelope, Job, Message
from fleet.infer.attempts import InferenceContext, run_turns
from fleet.infer.budget import plan as make_plan
from fleet.infer.loopwatch import LoopWatcher
from fleet.infer.vllm import VllmClient

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "corpora" / "reasoning" / \
    "normal_traces.jsonl"
LOOP_CORPUS = CORPUS.with_name("loop_traces.jsonl")
CHARS_PER_TOKEN = {"en": 4, "ja": 1}


class _NullSink(EventSink):
    def __init__(self) -> None:  # no Redis writes: the benchmark measures inference only
        pass

    def emit(self, kind: str, **data: Any) -> None:
        return None


def watcher_cpu_ms_per_1000_tokens(max_traces: int = 300) -> tuple[float, int]:
    """CPU ms per 1,000 tokens (4-char pieces) fed to a LoopWatcher, and the tokens fed."""
    texts: list[str] = []
    if CORPUS.exists():
        with CORPUS.open(encoding="utf-8") as f:
            for line in f:
                texts.append(json.loads(line)["text"])
                if len(texts) >= max_traces:
                    break
    else:
        rng = random.Random(0)
        words = ["so", "the", "value", "then", "check", "each", "step", "again", "total"]
        texts = [" ".join(rng.choice(words) for _ in range(3000)) for _ in range(20)]
    settings = WatcherSettings.model_validate({})
    tokens = 0
    start = time.process_time()
    for text in texts:
        watcher = LoopWatcher(settings)
        for i in range(0, len(text), 4):
            watcher.feed(text[i:i + 4], 0.0)
        tokens += (len(text) + 3) // 4
    cpu_s = time.process_time() - start
    return cpu_s / tokens * 1000 * 1000, tokens


def _cut_at(text: str, settings: WatcherSettings) -> int | None:
    watcher = LoopWatcher(settings)
    for i in range(0, len(text), 16):
        if watcher.feed(text[i:i + 16], 0.0) is not None:
            return i + 16
    return None


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _real_onset(text: str, span: int = 20, repeats: int = 10) -> int:
    words = [(m.start(), m.group()) for m in re.finditer(r"\S+", text)]
    first: dict[tuple[str, ...], int] = {}
    counts: Counter[tuple[str, ...]] = Counter()
    for i in range(len(words) - span + 1):
        key = tuple(w for _, w in words[i:i + span])
        first.setdefault(key, i)
        counts[key] += 1
    looping = [first[k] for k, c in counts.items() if c >= repeats]
    return words[min(looping)][0] if looping else 0


def _loop_row(name: str, cases: list[tuple[str, int, str]], alarms: int, normals: int,
              settings: WatcherSettings) -> dict[str, Any]:
    after: list[int] = []
    saved = total = 0
    for text, onset, language in cases:
        per = CHARS_PER_TOKEN[language]
        total += len(text) // per
        at = _cut_at(text, settings)
        if at is None:
            continue
        if at < onset:
            alarms += 1
            continue
        after.append((at - onset) // per)
        saved += (len(text) - at) // per
    after.sort()
    return {"set": name, "loops": len(cases), "cut": len(after), "false_alarms": alarms,
            "normal_traces": normals,
            "median_tokens_after_onset": after[len(after) // 2] if after else None,
            "max_tokens_after_onset": after[-1] if after else None,
            "tokens_saved": saved, "tokens_if_run_out": total}


def bench_template_loops(generated: int = 200, seed: int = 7) -> list[dict[str, Any]]:
    """The watcher alone on real and generated template loops (the second table)."""
    settings = WatcherSettings.model_validate({})
    normals = [t["text"] for t in _read(CORPUS)]
    alarms = sum(1 for text in normals if _cut_at(text, settings) is not None)
    real = [(t["text"], _real_onset(t["text"]), "en") for t in _read(LOOP_CORPUS)]
    rows = [_loop_row("real (loop_traces.jsonl)", real, alarms, len(normals), settings)] if real else []
    loops = generate_loops(seed, generated, normals)
    for language in ("en", "ja"):
        cases = [(g.text, g.onset_chars, g.language) for g in loops if g.language == language]
        rows.append(_loop_row(f"generated, {language}", cases, 0, 0, settings))
    return rows


def _jobs(jobs: int, loop_share: float, seed: int) -> list[tuple[Job, bool]]:
    rng = random.Random(seed)
    looping = set(rng.sample(range(jobs), round(jobs * loop_share)))
    out = []
    for i in range(jobs):
        marker = ""
        if i in looping:
            marker = "[sim:loop/1]" if i % 2 == 0 else "[sim:loop_fuzzy/1]"
        text = f"Bench job {uuid.uuid4().hex[:8]}: check the invoices. {marker}"
        out.append((Job(project="reports", messages=[Message(role="user", content=text)],
                        thinking_budget=4000), i in looping))
    return out


def _run_mode(base_url: str, cfg: Settings, jobs: list[tuple[Job, bool]], client: redis.Redis,
              concurrency: int) -> tuple[list[Envelope], float]:
    keys = Keys(f"bench-{uuid.uuid4().hex[:8]}:")
    vllm = VllmClient(base_url, "local", timeouts=cfg.timeouts)
    project = cfg.projects["reports"]

    def one(job: Job) -> Envelope:
        ctx = InferenceContext(settings=cfg, project=project, redis=client, keys=keys,
                               events=_NullSink(), cancel=threading.Event(), client=vllm)
        return run_turns(job, make_plan(job, project, cfg, 200), ctx)

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        envelopes = list(pool.map(one, [j for j, _ in jobs]))
    elapsed = time.monotonic() - start
    for key in client.scan_iter(match=f"{keys.prefix}*"):
        client.delete(key)
    vllm.close()
    return envelopes, elapsed


def _wasted(env: Envelope, lead_tokens: int) -> int:
    tokens = sum(a.usage.reasoning_tokens for a in env.attempts[:-1])
    last = env.attempts[-1] if env.attempts else None
    if last is not None and len(env.attempts) == 1:  # the loop ran to its forced end
        tokens += max(0, last.usage.reasoning_tokens - lead_tokens)
    return tokens


def _ok_share(loops: list[Envelope]) -> float:
    return sum(1 for e in loops if e.code.ok and len(e.attempts) <= 2) / max(1, len(loops))


def bench_loops(redis_url: str, jobs: int = 40, loop_share: float = 0.2, speed: float = 40.0,
                concurrency: int = 8, seed: int = 1) -> list[dict[str, Any]]:
    from fleet.sim.server import start_sim_process

    client = redis.Redis.from_url(redis_url)
    proc = start_sim_process(speed=speed, seed=seed, think_min_tokens=300,
                             think_max_tokens=1200, answer_min_tokens=20, answer_max_tokens=80)
    rows: list[dict[str, Any]] = []
    try:
        for enabled in (True, False):
            cfg = load_settings(EXAMPLE_CONFIG, env={}, watcher={"enabled": enabled},
                                retry={"backoff_base_s": 0.0})
            batch = _jobs(jobs, loop_share, seed)
            envelopes, elapsed = _run_mode(proc.base_url, cfg, batch, client, concurrency)
            loops = [e for e, (_, looping) in zip(envelopes, batch, strict=True) if looping]
            rows.append({
                "watcher": "on" if enabled else "off",
                "jobs": jobs,
                "looping_jobs": len(loops),
                "wasted_reasoning_tokens": sum(_wasted(e, 200) for e in loops),
                "looping_ok_within_2": _ok_share(loops),
                "looping_codes": sorted({e.code.value for e in loops}),
                "attempts": sum(len(e.attempts) for e in envelopes),
                "wall_s": round(elapsed, 1),
            })
    finally:
        proc.stop()
        client.close()
    cpu_ms, tokens = watcher_cpu_ms_per_1000_tokens()
    for row in rows:
        row["watcher_cpu_ms_per_1000_tokens"] = round(cpu_ms, 3) if row["watcher"] == "on" else 0
    _print(rows, tokens)
    template_rows = bench_template_loops()
    _print_template(template_rows, cpu_ms)
    return rows + template_rows


def _print(rows: list[dict[str, Any]], tokens: int) -> None:
    table = Table(title=f"loop watcher: {rows[0]['jobs']} jobs, {rows[0]['looping_jobs']} looping")
    for column in ("watcher", "wasted reasoning tokens", "looping OK in <=2 attempts",
                   "looping codes", "attempts", "wall s", "CPU ms / 1k tokens"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["watcher"], str(r["wasted_reasoning_tokens"]),
                      f"{r['looping_ok_within_2']:.0%}", ", ".join(r["looping_codes"]),
                      str(r["attempts"]), str(r["wall_s"]),
                      str(r["watcher_cpu_ms_per_1000_tokens"]))
    Console().print(table)
    Console().print(f"watcher CPU measured over {tokens} replayed corpus tokens")


def _print_template(rows: list[dict[str, Any]], cpu_ms: float) -> None:
    table = Table(title=f"template loops, watcher alone (CPU {cpu_ms:.3f} ms / 1k tokens)")
    for column in ("set", "cut / loops", "false alarms", "tokens after onset (median, max)",
                   "tokens saved / if run out"):
        table.add_column(column)
    for r in rows:
        alarms = f"{r['false_alarms']} (of {r['normal_traces']} normal traces)" if r["normal_traces"] \
            else str(r["false_alarms"])
        table.add_row(r["set"], f"{r['cut']} / {r['loops']}", alarms,
                      f"{r['median_tokens_after_onset']}, {r['max_tokens_after_onset']}",
                      f"{r['tokens_saved']:,} / {r['tokens_if_run_out']:,}")
    Console().print(table)
