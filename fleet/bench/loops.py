"""``fleet bench loops``: what the loop watcher saves, and what it costs.

Runs ``jobs`` inference jobs against ``fleet sim`` (started here as a real process) directly
through ``run_inference`` (no Celery), in the same run and with the same jobs three times: with the
watcher on, on without the short-cycle detector (the watcher before issue 28), and off.
``loop_share`` of them loop on their first attempt only (``[sim:loop/1]``, ``[sim:loop_fuzzy/1]``
and ``[sim:loop_short/1]`` in turn), so a retry can succeed.

Reported per mode:
  wasted reasoning tokens   reasoning tokens of looping jobs spent in attempts whose answer was
                            not the final one, plus, when a looping attempt ran to its forced end,
                            the reasoning past the point where the loop began (lead tokens)
  looping jobs OK in <= 2   share of looping jobs that end with an OK code within two attempts
  attempts, wall time
And the watcher's CPU cost per 1,000 streamed tokens, with and without the short-cycle detector
(their ratio), measured with ``time.process_time`` over a replay of the reasoning corpus
(``reasoning/normal_traces.jsonl``, docs/testing.md; a generated text when it is absent), in
4-character pieces (about one token each), trace by trace in alternating order.

A second table replays looping traces through the watcher alone, with and without the short-cycle
detector: the real looping traces (``reasoning/loop_traces.jsonl``), the seeded generator's
English and Japanese template loops and its short capped loops (fleet/bench/loopgen.py: a real
trace's first 200 - 1,000 words, then a passage of its next 40 - 250 words repeated, verbatim or
with small edits, until a cap of 4,096 tokens), by cycle length, edit and layout. It reports
recall, false alarms (a verdict on a normal trace, or in a generated trace's lead), the tokens
streamed after the loop began before the cut (median, p90, max: what a loop costs) and the
reasoning tokens saved against letting it run to the end of the trace (the thinking budget for the
real ones: most never closed their reasoning; the cap for the short ones, so a cut is a cut before
the cap). The onset of a real loop is the first occurrence of a 20-word span that then repeats 10
or more times (the corpus's own selection rule), so "after onset" there is an upper bound. Tokens
are estimated as 4 characters (English) or 1 character (Japanese).

A third table is the short-cycle detector's margin: the most repetitions of one passage
(``repetition_peak``) in the real normal traces and in generated normal reasoning, against its
threshold ``watcher.cycle_repeats``. Last, each real looping trace: where it was cut, by which
detector, and where the watcher without the short-cycle detector cut it.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from fleet.bench.charts import Charts, LoopTrace
from fleet.bench.loopgen import SHORT_EDITS, generate_loops, generate_short_loops, generated_lead
from fleet.bench.measure import percentile
from fleet.core.config import EXAMPLE_CONFIG, Settings, WatcherSettings, load_settings
from fleet.core.events import EventSink
from fleet.core.keys import Keys
from fleet.core.models import Envelope, Job, Message
from fleet.infer.attempts import InferenceContext, run_turns
from fleet.infer.budget import plan as make_plan
from fleet.infer.loopwatch import LoopWatcher, repetition_peak
from fleet.infer.vllm import VllmClient

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "corpora" / "reasoning" / \
    "normal_traces.jsonl"
LOOP_CORPUS = CORPUS.with_name("loop_traces.jsonl")
CHARS_PER_TOKEN = {"en": 4, "ja": 1}
OLD_WATCHER: dict[str, Any] = {"cycle_repeats": 0}  # the watcher before the short-cycle detector (issue 28)


class _NullSink(EventSink):
    def __init__(self) -> None:  # no Redis writes: the benchmark measures inference only
        pass

    def emit(self, kind: str, **data: Any) -> None:
        return None


def _cpu_texts(max_traces: int) -> list[str]:
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
    return texts


def watcher_cpu_ms_per_1000_tokens(max_traces: int = 300) -> dict[str, float]:
    """CPU ms per 1,000 tokens (4-char pieces) fed to a LoopWatcher, with the default settings
    (``ms``) and with the short-cycle detector off (``old_ms``: the watcher before it), trace by
    trace in alternating order so both see the same machine; and the tokens fed to each."""
    settings = {"new": WatcherSettings(), "old": WatcherSettings(**OLD_WATCHER)}
    cpu = {"new": 0.0, "old": 0.0}
    tokens = 0
    for n, text in enumerate(_cpu_texts(max_traces)):
        for name in (("new", "old") if n % 2 == 0 else ("old", "new")):
            start = time.process_time()
            watcher = LoopWatcher(settings[name])
            for i in range(0, len(text), 4):
                watcher.feed(text[i:i + 4], 0.0)
            cpu[name] += time.process_time() - start
        tokens += (len(text) + 3) // 4
    return {"ms": cpu["new"] / tokens * 1e6, "old_ms": cpu["old"] / tokens * 1e6,
            "ratio": cpu["new"] / cpu["old"], "tokens": tokens}


def _cut_at(text: str, settings: WatcherSettings) -> tuple[int, str] | None:
    """Where (chars fed) and by which detector the watcher cuts ``text`` fed in 16-char pieces."""
    watcher = LoopWatcher(settings)
    for i in range(0, len(text), 16):
        verdict = watcher.feed(text[i:i + 16], 0.0)
        if verdict is not None:
            return i + 16, verdict.kind
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


@dataclass
class _Case:
    """One looping text replayed through the watcher, with and without the short-cycle detector."""

    text: str
    onset: int  # chars
    per: int  # chars per token
    name: str = ""
    new: tuple[int, str] | None = None
    old: tuple[int, str] | None = None

    def replay(self, new: WatcherSettings, old: WatcherSettings) -> _Case:
        self.new, self.old = _cut_at(self.text, new), _cut_at(self.text, old)
        return self


def _after(cases: list[_Case], which: str) -> tuple[list[int], int]:
    """Tokens streamed after the onset before the cut, of the cases cut after their onset; and
    the number cut before it (false alarms)."""
    after: list[int] = []
    early = 0
    for case in cases:
        cut = getattr(case, which)
        if cut is None:
            continue
        if cut[0] < case.onset:
            early += 1
        else:
            after.append((cut[0] - case.onset) // case.per)
    return after, early


def _loop_row(name: str, cases: list[_Case], alarms: int = 0, normals: int = 0) -> dict[str, Any]:
    after, early = _after(cases, "new")
    old_after, _ = _after(cases, "old")
    saved = sum((len(c.text) - c.new[0]) // c.per for c in cases
                if c.new is not None and c.new[0] >= c.onset)
    by = Counter(c.new[1] for c in cases if c.new is not None and c.new[0] >= c.onset)
    return {"set": name, "loops": len(cases), "cut": len(after), "false_alarms": alarms + early,
            "normal_traces": normals,
            "median_tokens_after_onset": _pct(after, 50), "p90_tokens_after_onset": _pct(after, 90),
            "max_tokens_after_onset": max(after) if after else None,
            "tokens_saved": saved, "tokens_if_run_out": sum(len(c.text) // c.per for c in cases),
            "cut_by": dict(by.most_common()),
            "old_cut": len(old_after), "old_median_tokens_after_onset": _pct(old_after, 50),
            "old_p90_tokens_after_onset": _pct(old_after, 90)}


def _pct(values: list[int], q: float) -> int | None:
    return round(percentile(values, q)) if values else None


CYCLE_BINS = ((40, 99), (100, 174), (175, 250))


def bench_template_loops(generated: int = 200, short: int = 200, seed: int = 7,
                         charts: Charts | None = None,
                         traces: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The watcher alone on real, generated template and generated short capped loops (the
    second table), with and without the short-cycle detector; and the detector's margin: the
    most repetitions of a passage in normal reasoning, real and generated, against its threshold."""
    new, old = WatcherSettings(), WatcherSettings(**OLD_WATCHER)
    normals = [t["text"] for t in _read(CORPUS)][:traces or None]
    alarms = sum(1 for text in normals if _cut_at(text, new) is not None)
    old_alarms = sum(1 for text in normals if _cut_at(text, old) is not None)
    rows = []
    real = [_Case(t["text"], _real_onset(t["text"]), 4, t["id"]).replay(new, old)
            for t in _read(LOOP_CORPUS)]
    if real:
        rows.append(_loop_row("real (loop_traces.jsonl)", real, alarms, len(normals)))
    loops = generate_loops(seed, generated, normals)
    for language in ("en", "ja"):
        cases = [_Case(g.text, g.onset_chars, CHARS_PER_TOKEN[language]).replay(new, old)
                 for g in loops if g.language == language]
        rows.append(_loop_row(f"generated template, {language}", cases))
    shorts = generate_short_loops(seed, short, normals)
    short_cases = [_Case(g.text, g.onset_chars, 4).replay(new, old) for g in shorts]
    rows.append(_loop_row("short capped, all", short_cases))
    for low, high in CYCLE_BINS:
        rows.append(_loop_row(f"short capped, cycle {low}-{high} words",
                              [c for c, g in zip(short_cases, shorts, strict=True)
                               if low <= g.cycle_words <= high]))
    for edit in SHORT_EDITS:
        rows.append(_loop_row(f"short capped, {edit}",
                              [c for c, g in zip(short_cases, shorts, strict=True) if g.edit == edit]))
    for layout, run_on in (("paragraphs kept", False), ("run on", True)):
        rows.append(_loop_row(f"short capped, {layout}",
                              [c for c, g in zip(short_cases, shorts, strict=True)
                               if g.run_on == run_on]))
    if charts is not None:
        charts.loops += [_trace(c, "real") for c in real] + [_trace(c, "short capped") for c in short_cases]
    margin = _margin(new, normals, old_alarms)
    margin["real_traces"] = [{"id": c.name, "tokens": len(c.text) // 4, "onset": c.onset // 4,
                              "cut_at": c.new[0] // 4 if c.new else None,
                              "cut_by": c.new[1] if c.new else None,
                              "old_cut_at": c.old[0] // 4 if c.old else None} for c in real]
    return rows, margin


def _trace(case: _Case, kind: str) -> LoopTrace:
    """A replayed case as its chart shows it, in tokens."""
    def tokens(cut: tuple[int, str] | None) -> int | None:
        return None if cut is None else cut[0] // case.per

    return LoopTrace(case.name, kind, len(case.text) // case.per, case.onset // case.per,
                     tokens(case.new), tokens(case.old))


def _margin(settings: WatcherSettings, normals: list[str], old_alarms: int) -> dict[str, Any]:
    from fleet.sim.textgen import ProseStream

    rng = random.Random(5)
    generated = {
        "generated English leads": [generated_lead(rng, "en", 30_000) for _ in range(50)],
        "generated Japanese leads": [generated_lead(rng, "ja", 30_000) for _ in range(50)],
        "fleet sim reasoning": ["".join(ProseStream(random.Random(i)).take(20_000))
                                for i in range(20)],
    }
    peaks = {"real normal traces": [repetition_peak(t, settings) for t in normals]}
    peaks.update({name: [repetition_peak(t, settings) for t in texts]
                  for name, texts in generated.items()})
    return {"threshold": settings.cycle_repeats, "old_alarms": old_alarms,
            "peaks": {name: {"texts": len(v), "max": max(v, default=0),
                             "at_max": v.count(max(v, default=0)),
                             "histogram": dict(sorted(Counter(v).items()))}
                      for name, v in peaks.items()}}


def _jobs(jobs: int, loop_share: float, seed: int) -> list[tuple[Job, bool]]:
    rng = random.Random(seed)
    looping = set(rng.sample(range(jobs), round(jobs * loop_share)))
    out = []
    for i in range(jobs):
        marker = ""
        if i in looping:
            marker = ("[sim:loop/1]", "[sim:loop_fuzzy/1]", "[sim:loop_short/1]")[i % 3]
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
                concurrency: int = 8, seed: int = 1, charts: Charts | None = None,
                short: int = 200, traces: int = 0) -> list[dict[str, Any]]:
    """The three tables (module docstring); ``charts`` keeps each replayed looping trace's cut,
    ``short`` is how many template and short capped loops are generated, ``traces`` how many
    normal traces of the corpus the CPU figure, the false alarms and the margin read (0: all;
    fewer for a short run only: the false-alarm count then covers those alone)."""
    from fleet.sim.server import start_sim_process

    client = redis.Redis.from_url(redis_url)
    proc = start_sim_process(speed=speed, seed=seed, think_min_tokens=300,
                             think_max_tokens=1200, answer_min_tokens=20, answer_max_tokens=80)
    rows: list[dict[str, Any]] = []
    modes: list[tuple[str, dict[str, Any]]] = [
        ("on", {}), ("on, no short-cycle detector", OLD_WATCHER), ("off", {"enabled": False})]
    try:
        for mode, watcher in modes:
            cfg = load_settings(EXAMPLE_CONFIG, env={}, watcher=watcher,
                                retry={"backoff_base_s": 0.0})
            batch = _jobs(jobs, loop_share, seed)
            envelopes, elapsed = _run_mode(proc.base_url, cfg, batch, client, concurrency)
            loops = [e for e, (_, looping) in zip(envelopes, batch, strict=True) if looping]
            rows.append({
                "watcher": mode,
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
    cpu = watcher_cpu_ms_per_1000_tokens(traces or 300)
    for row in rows:
        row["watcher_cpu_ms_per_1000_tokens"] = (
            0 if row["watcher"] == "off" else round(cpu["ms" if row["watcher"] == "on" else "old_ms"], 3))
    _print(rows, cpu)
    template_rows, margin = bench_template_loops(generated=short, short=short, charts=charts, traces=traces)
    _print_template(template_rows, margin)
    return rows + template_rows + [{"cpu": cpu, "margin": margin}]


def _print(rows: list[dict[str, Any]], cpu: dict[str, float]) -> None:
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
    Console().print(f"watcher CPU measured over {cpu['tokens']:,} replayed corpus tokens each: "
                    f"{cpu['ms']:.3f} ms / 1k tokens, {cpu['old_ms']:.3f} without the short-cycle "
                    f"detector (x{cpu['ratio']:.2f})")


def _print_template(rows: list[dict[str, Any]], margin: dict[str, Any]) -> None:
    table = Table(title="looping traces, watcher alone (16-char pieces)")
    for column in ("set", "cut / loops (old)", "false alarms", "tokens after onset: median, p90, "
                   "max (old: median, p90)", "tokens saved / if run out", "cut by"):
        table.add_column(column)
    for r in rows:
        alarms = f"{r['false_alarms']} (of {r['normal_traces']} normal traces)" if r["normal_traces"] \
            else str(r["false_alarms"])
        table.add_row(r["set"], f"{r['cut']} / {r['loops']} ({r['old_cut']})", alarms,
                      f"{r['median_tokens_after_onset']}, {r['p90_tokens_after_onset']}, "
                      f"{r['max_tokens_after_onset']} ({r['old_median_tokens_after_onset']}, "
                      f"{r['old_p90_tokens_after_onset']})",
                      f"{r['tokens_saved']:,} / {r['tokens_if_run_out']:,}",
                      ", ".join(f"{k} {n}" for k, n in r["cut_by"].items()))
    Console().print(table)
    table = Table(title=f"short-cycle detector: repetitions of a passage in normal reasoning "
                        f"(threshold {margin['threshold']})")
    for column in ("texts", "count", "most repetitions", "texts at the most", "histogram"):
        table.add_column(column)
    for name, p in margin["peaks"].items():
        table.add_row(name, str(p["texts"]), str(p["max"]), str(p["at_max"]),
                      ", ".join(f"{k}: {n}" for k, n in p["histogram"].items()))
    Console().print(table)
    if margin["real_traces"]:
        table = Table(title="real looping traces (tokens)")
        for column in ("trace", "length", "onset", "cut at (by)", "after onset", "old cut at"):
            table.add_column(column)
        for t in margin["real_traces"]:
            after = t["cut_at"] - t["onset"] if t["cut_at"] is not None else None
            table.add_row(t["id"].removeprefix("mip-overthinking/"), f"{t['tokens']:,}",
                          f"{t['onset']:,}", f"{t['cut_at']} ({t['cut_by']})", str(after),
                          str(t["old_cut_at"]))
        Console().print(table)
