"""The loop generator of ``fleet bench loops`` (fleet/bench/loopgen.py): short capped loops built
from the reasoning corpus (generated prose when it is absent)."""

from __future__ import annotations

import json
import re

import pytest

from fleet.bench.loopgen import SHORT_EDITS, ShortLoop, generate_short_loops
from tests.support.testenv import corpus_file

CAP_CHARS = 4096 * 4


def _leads() -> list[str]:
    path = corpus_file("reasoning", "normal_traces.jsonl")
    if path is None:
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(300), f, strict=False)]


@pytest.fixture(scope="module")
def loops() -> list[ShortLoop]:
    return generate_short_loops(seed=3, count=48, leads=_leads())


def _opening(g: ShortLoop) -> re.Pattern[str]:
    """The passage's first eight words, any numbers and spacing."""
    words = g.text[g.onset_chars:].split()[:8]
    pattern = r"\s+".join(re.sub(r"\d+", r"\\d+", re.escape(w)) for w in words)
    return re.compile(pattern, re.IGNORECASE)


def test_short_loops_are_capped_and_begin_200_to_1000_words_in(loops: list[ShortLoop]) -> None:
    for g in loops:
        assert len(g.text) == CAP_CHARS  # the cap ends every one of them
        assert 200 <= len(g.text[:g.onset_chars].split()) <= 1000
        assert 40 <= g.cycle_words <= 250
        # The cap leaves room for many repetitions: more than the watcher needs.
        assert g.repetitions >= 8


def test_every_edit_and_both_layouts_are_drawn(loops: list[ShortLoop]) -> None:
    assert {(g.edit, g.run_on) for g in loops} == {(e, r) for e in SHORT_EDITS for r in (False, True)}
    for g in loops:
        if g.run_on:
            assert "\n" not in g.text[g.onset_chars:]


def test_the_passage_keeps_coming_back(loops: list[ShortLoop]) -> None:
    for g in loops:
        found = len(_opening(g).findall(g.text[g.onset_chars:]))
        # Restarts break some repetitions off before their end, never before their opening.
        assert found >= g.repetitions - 1, (g.edit, found, g.repetitions)


def test_edits_change_repetitions_and_verbatim_does_not(loops: list[ShortLoop]) -> None:
    for g in loops:
        loop = g.text[g.onset_chars:]
        starts = [m.start() for m in _opening(g).finditer(loop)]
        repetitions = {loop[a:b].strip() for a, b in zip(starts, starts[1:], strict=False)}
        if g.edit == "verbatim":
            assert len(repetitions) == 1
        else:
            assert len(repetitions) > 1, g.edit
        if g.edit == "restarts":
            assert any(opener in loop for opener in ("Wait, ", "Hmm, ", "Okay, "))


def test_the_same_seed_gives_the_same_loops() -> None:
    leads = _leads()[:50]
    assert generate_short_loops(9, 8, leads) == generate_short_loops(9, 8, leads)
    assert generate_short_loops(9, 8, leads) != generate_short_loops(10, 8, leads)


def test_without_a_corpus_the_leads_are_generated() -> None:
    loops = generate_short_loops(seed=4, count=8)
    assert len(loops) == 8 and all(len(g.text) == CAP_CHARS for g in loops)
