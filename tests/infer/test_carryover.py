"""Carry-over after a template loop: the dead ends it found go to the next attempt, and a question
with a missing premise is steered to say so (real looping traces of the reasoning corpus, and the
seeded generator for Japanese)."""

from __future__ import annotations

import json
import os

import pytest

from fleet.bench.loopgen import generate_loops
from fleet.infer import carryover
from tests.support.testenv import SHARED

LOOP_TRACES = os.path.join(SHARED, "corpora", "reasoning", "loop_traces.jsonl")
STEER = "If the question lacks information needed to answer it, say so plainly"


@pytest.mark.skipif(not os.path.exists(LOOP_TRACES), reason=f"corpus absent: {LOOP_TRACES}")
def test_a_cut_template_loop_passes_on_its_dead_ends_and_the_missing_premise_steer() -> None:
    with open(LOOP_TRACES, encoding="utf-8") as f:
        traces = [json.loads(line)["text"] for line in f]
    for text in traces:
        reasoning = text[:30_000]  # about where the watcher cuts these
        dead_ends = carryover.extract_dead_ends(reasoning)
        assert 1 <= len(dead_ends) <= carryover.MAX_DEAD_ENDS
        note = carryover.retry_note(carryover.extract_conclusions(reasoning), "loop watcher", dead_ends)
        assert "tried these and found them impossible" in note
        assert all(d in note for d in dead_ends)
        assert STEER in note
        assert len(note) <= carryover.MAX_NOTE_CHARS + carryover.MAX_DEAD_ENDS * carryover.MAX_SENTENCE_CHARS + 400


def test_dead_ends_of_a_loop_are_distinct_not_the_same_guess_again() -> None:
    loop = ("Maybe V is the volume of a cube, but without knowing the side, I can't compute it.\n\n"
            "Maybe V is the volume of a cone, but without knowing the side, I can't compute it.\n\n") * 30
    assert carryover.extract_dead_ends(loop) == [
        "Maybe V is the volume of a cone, but without knowing the side, I can't compute it."]


def test_japanese_dead_ends_are_found_and_steered() -> None:
    ja = next(g for g in generate_loops(seed=3, count=2) if g.language == "ja")
    dead_ends = carryover.extract_dead_ends(ja.text[ja.onset_chars:])
    assert dead_ends and all(d.endswith("。") for d in dead_ends)
    assert STEER in carryover.retry_note([], "loop watcher", dead_ends)


def test_dead_ends_without_a_missing_premise_ask_for_another_approach() -> None:
    note = carryover.retry_note([], "loop watcher", ["Factoring over the integers is impossible here."])
    assert "Do not try those again" in note and STEER not in note
    assert carryover.retry_note(["So x = 4."], "loop") == (
        "[fleet note] A previous attempt (loop) concluded:\n- So x = 4.\n"
        "Do not redo that work; build on it and conclude with the answer.")
