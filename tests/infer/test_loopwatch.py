"""The loop watcher: catches exact and near-duplicate loops, template loops, short cycles and
stalls, never fires on normal reasoning (the 1,188 real traces of the reasoning corpus,
docs/testing.md, fed as a stream)."""

from __future__ import annotations

import json
import os
import random
import re

import pytest

from fleet.core.config import WatcherSettings
from fleet.infer.loopwatch import LoopWatcher, repetition_peak
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
    assert SETTINGS.cycle_repeats > 0  # the short-cycle detector was part of it


def test_the_most_repetitive_normal_trace_stays_below_the_cycle_threshold() -> None:
    """The margin of the short-cycle detector: how many times in a row a passage is written in
    normal reasoning, real and generated, against ``cycle_repeats``."""
    from fleet.bench.loopgen import generated_lead
    from fleet.sim.textgen import ProseStream

    rng = random.Random(21)
    generated = [generated_lead(rng, language, 30_000) for language in ("en", "ja") * 5]
    generated += ["".join(ProseStream(random.Random(i)).take(20_000)) for i in range(3)]
    generated += [prose(rng, 120) for _ in range(3)]
    assert max(repetition_peak(text, SETTINGS) for text in generated) < SETTINGS.cycle_repeats
    if corpus_file("reasoning", "normal_traces.jsonl") is not None:
        real = [repetition_peak(text, SETTINGS) for text in _normal_texts(2000)]
        assert max(real) <= SETTINGS.cycle_repeats - 2  # two repetitions short of a verdict


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


# -- short cycles: a passage that keeps coming back, counted in repetitions -------------------------

# Only the repetition count: the exact period, paragraphs and the repeated share never decide.
CYCLE_ONLY = WatcherSettings(min_repeat_span_chars=10**9, similar_paragraphs=10**6,
                             share_min_grams=10**9)


def passage_loop(lead: str, passage: str, times: int, rng: random.Random | None = None) -> str:
    """``lead``, then ``passage`` ``times`` times; with ``rng`` its numbers change each time and
    some repetitions break off and restart with "Wait,"."""
    parts = [lead + "\n\n"]
    for _ in range(times):
        again = passage
        if rng is not None:
            again = re.sub(r"\d+", lambda _: str(rng.randint(2, 999)), passage)
            if rng.random() < 0.3:
                again = "Wait, " + again[: rng.randint(len(again) // 2, len(again))].lower()
        parts.append(again + " ")
    return "".join(parts)


PASSAGE = ("So the second pump fills 12 litres a minute and the first 7, which gives 19 litres "
           "together; the tank holds 380 litres, so it takes 20 minutes. But the drain takes 3 "
           "litres a minute away, so the net rate is 16 and the time is 23.75 minutes, which is "
           "not a whole number, so I should check the rates again.")


@pytest.mark.parametrize("edited", [False, True])
def test_a_passage_coming_back_is_cut_after_the_same_repetitions_whatever_came_before(
        edited: bool) -> None:
    rng = random.Random(17)
    for lead_paragraphs in (2, 60):  # ~200 words or ~6,000 words of normal reasoning before it
        lead = prose(rng, lead_paragraphs)
        text = passage_loop(lead, PASSAGE, 12, random.Random(3) if edited else None)
        verdict, at = stream(LoopWatcher(CYCLE_ONLY), text, piece=5)
        assert verdict is not None and verdict.kind == "cycle", lead_paragraphs
        assert verdict.repeats == CYCLE_ONLY.cycle_repeats
        # The evidence is the count: the verdict comes in the passage's 5th or 6th repetition
        # (it needs 30 words of it, and the words are read in batches of 256 characters).
        repetitions = (at - len(lead)) / len(PASSAGE)
        assert CYCLE_ONLY.cycle_repeats - 1 < repetitions < CYCLE_ONLY.cycle_repeats + 1.5


def test_four_repetitions_of_a_passage_are_not_a_loop() -> None:
    rng = random.Random(18)
    text = passage_loop(prose(rng, 4), PASSAGE, 4, random.Random(4)) + prose(rng, 30)
    assert stream(LoopWatcher(SETTINGS), text)[0] is None
    assert repetition_peak(text, SETTINGS) == 4


def test_a_passage_back_only_after_a_long_gap_starts_a_new_count() -> None:
    rng = random.Random(19)
    parts = []
    for _ in range(8):  # the passage again every ~450 words: a restated problem, not a loop
        parts += [PASSAGE, prose(rng, 5)]
    text = "\n\n".join(parts)
    assert stream(LoopWatcher(SETTINGS), text)[0] is None
    assert repetition_peak(text, SETTINGS) == 1


def test_cycle_state_stays_bounded() -> None:
    watcher = LoopWatcher(SETTINGS.model_copy(update={"cycle_repeats": 10**6}))
    stream(watcher, prose(random.Random(20), 600), piece=64)
    cycle = watcher._cycle
    assert watcher.verdict is None and cycle is not None
    assert cycle._n > 10 * SETTINGS.cycle_max_gap_words  # it saw all ~40,000 words
    assert len(cycle._seen) <= 2 * SETTINGS.cycle_max_gap_words
    assert len(cycle._hits) <= SETTINGS.cycle_passage_words


@pytest.mark.parametrize("edit", ["verbatim", "numbers", "restarts", "sentence"])
def test_generated_short_capped_loops_are_cut_before_the_cap(edit: str) -> None:
    from fleet.bench.loopgen import generate_short_loops

    loops = [g for g in generate_short_loops(seed=23, count=96, leads=_normal_texts(400))
             if g.edit == edit]
    rng = random.Random(29)
    for settings in (CYCLE_ONLY, SETTINGS):
        cut, early = 0, []
        for g in loops:
            verdict, at = stream(LoopWatcher(settings), g.text, piece=rng.randint(1, 9))
            if verdict is not None and at < g.onset_chars:
                early.append((g.onset_chars, at, verdict))
            elif verdict is not None:  # the text ends at the cap: a verdict is a cut before it
                cut += 1
        assert early == []
        assert cut / len(loops) >= 0.95, (settings is CYCLE_ONLY, cut, len(loops))
