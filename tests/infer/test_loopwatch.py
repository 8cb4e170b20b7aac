"""The loop watcher: catches exact and near-duplicate loops and stalls, never fires on normal
reasoning (the 1,188 real traces of the reasoning corpus, docs/testing.md, fed as a stream)."""

from __future__ import annotations

import json
import os
import random

import pytest

from fleet.core.config import WatcherSettings
from fleet.infer.loopwatch import LoopWatcher
from tests.support.testenv import SHARED, corpus_file

TRACES = os.path.join(SHARED, "corpora", "reasoning", "normal_traces.jsonl")
SETTINGS = WatcherSettings()


def stream(watcher: LoopWatcher, text: str, piece: int = 4, t0: float = 0.0):
    for i in range(0, len(text), piece):
        verdict = watcher.feed(text[i:i + piece], t0 + i / 1000)
        if verdict is not None:
            return verdict, i
    return None, len(text)


def prose(rng: random.Random, paragraphs: int) -> str:
    words = ["the", "value", "of", "each", "step", "follows", "from", "the", "previous", "one",
             "so", "we", "check", "again", "whether", "total", "count", "limit", "budget",
             "seven", "twelve", "result", "answer", "holds", "because", "of", "this", "case"]
    out = []
    for p in range(paragraphs):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 20))) + f" {p}."
                     for _ in range(rng.randint(3, 6))]
        out.append(" ".join(sentences))
    return "\n\n".join(out)


def test_exact_loop_is_caught_within_a_few_periods() -> None:
    rng = random.Random(1)
    intro = prose(rng, 3)
    period = "So the total is 12 apples, but wait, let me recompute the first step again. "
    verdict, at = stream(LoopWatcher(SETTINGS), intro + "\n\n" + period * 100)
    assert verdict is not None and verdict.kind == "repeat"
    assert verdict.period_chars == len(period)
    looped = at - len(intro)
    assert looped <= max(SETTINGS.min_repeat_span_chars, 3 * len(period)) + 2 * len(period)


def test_long_period_loop_up_to_max_period() -> None:
    rng = random.Random(2)
    block = prose(rng, 4)[:1800] + "\n\n"
    verdict, _ = stream(LoopWatcher(SETTINGS), prose(rng, 2) + "\n\n" + block * 5, piece=7)
    assert verdict is not None and verdict.period_chars == len(block)


def test_near_duplicate_paragraphs_are_caught() -> None:
    template = ("Wait, maybe I should check case {n} again: if the budget is fixed and the "
                "reserve stays where it was then the total must still fit inside the window, "
                "so the {w} result holds, and I should verify it once more before I answer "
                "the question about the queue and its deadline.")
    words = ["first", "second", "same", "earlier", "previous", "other"]
    text = prose(random.Random(3), 2) + "\n\n" + "\n\n".join(
        template.format(n=n, w=words[n % len(words)]) for n in range(3, 20))
    verdict, _ = stream(LoopWatcher(SETTINGS), text)
    assert verdict is not None and verdict.kind == "paragraphs"
    assert verdict.repeats >= SETTINGS.similar_paragraphs


def test_stall_only_after_the_first_text() -> None:
    watcher = LoopWatcher(SETTINGS)
    assert watcher.check_stall(1000.0) is None  # nothing streamed yet: not the watcher's call
    watcher.feed("thinking", 10.0)
    assert watcher.check_stall(10.0 + SETTINGS.stall_s - 1) is None
    watcher.feed("   ", 10.0 + SETTINGS.stall_s - 1)  # whitespace is not progress
    watcher.touch(10.0 + SETTINGS.stall_s - 0.5)  # answer content is
    assert watcher.check_stall(10.0 + SETTINGS.stall_s) is None
    verdict = watcher.check_stall(10.0 + 2 * SETTINGS.stall_s)
    assert verdict is not None and verdict.kind == "stall"


def test_normal_generated_reasoning_never_fires() -> None:
    rng = random.Random(4)
    for _ in range(5):
        verdict, _ = stream(LoopWatcher(SETTINGS), prose(rng, 120), piece=rng.randint(1, 9))
        assert verdict is None


def test_simulator_reasoning_normal_and_looping() -> None:
    textgen = pytest.importorskip("fleet.sim.textgen")
    watcher = LoopWatcher(SETTINGS)
    pieces = textgen.ProseStream(random.Random(5)).take(30_000)
    assert all(watcher.feed(p, 0.0) is None for p in pieces)
    for exact in (True, False):
        watcher = LoopWatcher(SETTINGS)
        pieces = textgen.LoopStream(random.Random(6), exact=exact).take(8_000)
        caught = next((i for i, p in enumerate(pieces) if watcher.feed(p, 0.0)), None)
        assert caught is not None and caught < 3_000, (exact, caught)


def test_zero_alarms_on_the_real_normal_traces() -> None:
    if corpus_file("reasoning", "normal_traces.jsonl") is None:
        pytest.skip(f"corpus absent: {TRACES}")
    alarms = []
    count = 0
    with open(TRACES, encoding="utf-8") as f:
        for line in f:
            trace = json.loads(line)
            count += 1
            verdict, _ = stream(LoopWatcher(SETTINGS), trace["text"], piece=16)
            if verdict is not None:
                alarms.append((trace["id"], verdict))
    assert count == 1188
    assert alarms == []


LOOP_TRACES = os.path.join(SHARED, "corpora", "reasoning", "loop_traces.jsonl")


def _normal_texts(limit: int) -> list[str]:
    if not os.path.exists(TRACES):
        return []
    with open(TRACES, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(limit), f, strict=False)]


@pytest.mark.skipif(not os.path.exists(LOOP_TRACES), reason=f"corpus absent: {LOOP_TRACES}")
def test_every_real_template_loop_trace_is_cut() -> None:
    missed = []
    with open(LOOP_TRACES, encoding="utf-8") as f:
        traces = [json.loads(line) for line in f]
    assert len(traces) == 10
    for trace in traces:
        verdict, at = stream(LoopWatcher(SETTINGS), trace["text"], piece=16)
        # Cut while most of the budget is still ahead: these traces run 44,000 - 158,000 chars.
        if verdict is None or at > len(trace["text"]) * 0.85:
            missed.append(trace["id"])
    assert missed == []


@pytest.mark.parametrize("language", ["en", "ja"])
def test_generated_template_loops_are_cut_after_they_begin(language: str) -> None:
    from fleet.bench.loopgen import generate_loops

    loops = [g for g in generate_loops(seed=11, count=80, leads=_normal_texts(200))
             if g.language == language]
    rng = random.Random(13)
    cut, early = 0, []
    for g in loops:
        verdict, at = stream(LoopWatcher(SETTINGS), g.text, piece=rng.randint(1, 9))
        if verdict is not None and at < g.onset_chars:
            early.append((g.onset_chars, at, verdict))
        elif verdict is not None:
            cut += 1
    assert early == []  # a verdict in the normal lead is a false alarm
    assert cut / len(loops) >= 0.95


def test_template_loop_state_stays_bounded() -> None:
    from fleet.bench.loopgen import generate_loops

    settings = WatcherSettings(repeat_share=1.0, paragraph_jaccard=1.0, similar_paragraphs=16)
    watcher = LoopWatcher(settings)
    text = generate_loops(seed=12, count=1, loop_chars=200_000)[0].text
    stream(watcher, text, piece=64)
    assert watcher.verdict is None  # it streamed to the end, so the state saw all 200,000 chars
    share = watcher._share
    assert len(share._old) + len(share._new) <= 2 * settings.share_history_grams
    assert len(share._window) <= settings.share_window_chunks
