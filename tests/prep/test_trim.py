"""fleet/prep/trim.py: pure trimming functions with deterministic local counting functions, and a
hypothesis property: whatever the text, limit, strategy and counter, the result fits."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.prep.trim import (
    allocate,
    cut,
    drop_near_duplicates,
    fit_text,
    normalise_whitespace,
)

_PIECES = re.compile(r"\w{1,5}|[^\w\s]|\s+")


def count_pieces(text: str) -> int:
    """A BPE-ish local count: words in chunks of 5, each punctuation mark, whitespace runs."""
    return len(_PIECES.findall(text))


def count_quarter(text: str) -> int:
    return (len(text) + 3) // 4


def count_lumpy(text: str) -> int:
    """Not proportional to length: digits are expensive, spaces free, a bonus for 'x'."""
    return sum(3 if c.isdigit() else 0 if c == " " else 1 for c in text) + 5 * text.count("x")


COUNTERS = [count_pieces, count_quarter, count_lumpy]


def prose(paragraphs: int, seed: int = 0) -> str:
    words = [
        "the",
        "model",
        "reads",
        "long",
        "documents",
        "and",
        "answers",
        "questions",
        "about",
        "them",
    ]
    out = []
    for p in range(paragraphs):
        out.append(" ".join(words[(p * 3 + i + seed) % len(words)] + str(p) for i in range(40)))
    return "\n\n".join(out)


def test_normalise_whitespace_keeps_indentation_and_collapses_the_rest() -> None:
    text = "title  \r\n\r\n\r\n\r\ndef f():\n    return  1   \t\n\n\n\nend"
    assert normalise_whitespace(text) == "title\n\ndef f():\n    return 1\n\nend"


def test_near_duplicates_dropped_but_short_and_distinct_paragraphs_kept() -> None:
    boiler = "Subscribe to our newsletter for the latest news and offers, 2024 edition!"
    changed = "The quarterly report shows revenue grew in every region we operate in this year."
    rows = [
        f"Region {r}: revenue grew {n} percent over the previous quarter"
        for r, n in [("north", 5), ("south", 7)]
    ]
    text = "\n\n".join(
        [
            boiler,
            changed,
            "}",
            "Subscribe to our NEWSLETTER for the latest news and offers -- 2024 edition",
            "The quarterly report shows revenue grew in every region we operate in that year.",
            "}",
            *rows,
            "A completely different paragraph about token budgets and KV cache blocks.",
        ]
    )
    kept, dropped = drop_near_duplicates(text)
    assert dropped == 2
    assert kept.split("\n\n") == [boiler, changed, "}", "}", *rows, text.split("\n\n")[-1]]


def test_cut_head_tail_keeps_both_ends_with_a_marker() -> None:
    text = "\n".join(f"line {i:03d} of the document" for i in range(200))
    out = cut(text, 1000, "head_tail", 0.6, ratio=4.0)
    assert out.startswith("line 000") and out.endswith("line 199 of the document")
    assert re.search(r"\n\[\.\.\. \d+ tokens elided \.\.\.\]\n", out)
    head, tail = out.split(" tokens elided ...]\n")
    assert head.rsplit("[... ", 1)[0].endswith("document\n\n")  # cut on a line break
    assert tail.startswith("line ") and len(out) < len(text)


@pytest.mark.parametrize("strategy", ["head", "tail", "head_tail"])
def test_fit_text_strategies(strategy: str) -> None:
    text = prose(60)
    total = count_pieces(text)
    fitted = fit_text(text, 300, count_pieces, strategy=strategy)
    assert fitted.trimmed and count_pieces(fitted.text) == fitted.tokens <= 300
    assert fitted.tokens >= 300 * 0.8  # uses most of the room, not a timid cut
    assert fitted.counts <= 9
    first, last = text[:20], text[-20:]
    assert fitted.text.startswith(first) == (strategy != "tail")
    assert fitted.text.endswith(last) == (strategy != "head")
    assert 0 < fitted.elided_tokens < total


def test_fit_text_leaves_a_fitting_text_alone_and_counts_once() -> None:
    calls: list[str] = []

    def counting(text: str) -> int:
        calls.append(text)
        return count_pieces(text)

    fitted = fit_text("short text", 100, counting)
    assert fitted.text == "short text" and not fitted.trimmed and len(calls) == 1


def test_fit_text_bounded_counts_on_a_big_text() -> None:
    calls = 0

    def counting(text: str) -> int:
        nonlocal calls
        calls += 1
        return count_lumpy(text)

    fitted = fit_text(prose(2000), 5000, counting, max_counts=8)
    assert calls <= 9 and fitted.tokens <= 5000 and count_lumpy(fitted.text) == fitted.tokens


def test_fit_text_limit_too_small_for_the_marker_gives_empty() -> None:
    fitted = fit_text(prose(3), 2, count_pieces)
    assert fitted.text == "" and fitted.tokens == 0 and fitted.trimmed


def test_allocate_is_max_min_fair() -> None:
    assert allocate([100, 5000, 9000], 3000) == [100, 1450, 1450]
    assert allocate([10, 20], 1000) == [10, 20]
    assert allocate([10, 20], 0) == [0, 0]


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(
        alphabet=st.sampled_from(list("abcxyz 0123.,;\n\t日本語")), min_size=0, max_size=3000
    ),
    limit=st.integers(min_value=0, max_value=800),
    strategy=st.sampled_from(["head", "tail", "head_tail"]),
    head_fraction=st.floats(min_value=0, max_value=1),
    counter=st.sampled_from(COUNTERS),
)
def test_property_trimmed_text_never_exceeds_its_limit(
    text: str, limit: int, strategy: str, head_fraction: float, counter
) -> None:
    fitted = fit_text(text, limit, counter, strategy=strategy, head_fraction=head_fraction)
    assert counter(fitted.text) == fitted.tokens <= limit
    if counter(text) <= limit:
        assert fitted.text == text and not fitted.trimmed


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
    budget=st.integers(min_value=-5, max_value=30_000),
)
def test_property_allocation_fits_the_budget(sizes: list[int], budget: int) -> None:
    limits = allocate(sizes, budget)
    assert sum(limits) <= max(0, budget)
    assert all(0 <= lim <= size for lim, size in zip(limits, sizes, strict=True))
    if sum(sizes) <= budget:
        assert limits == sizes
