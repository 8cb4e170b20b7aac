"""Trimming: pure functions that make texts fit a token limit. No I/O here; the caller passes a
counting function (``count(text) -> tokens``), which in the fleet is the backend's /tokenize
behind a cache (fleet/prep/tokens.py) and in tests a deterministic local function.

The steps, in the order fleet/prep/prepare.py applies them:
  1. ``normalise_whitespace``: CRLF -> LF, trailing blanks dropped, runs of blanks inside a line
     collapsed (indentation kept, so code survives), three or more newlines -> one blank line.
  2. ``drop_near_duplicates``: paragraphs (blank-line separated) that repeat an earlier one are
     dropped. Near-duplicate means the same words (letters and digits) after lower-casing,
     whatever the punctuation and whitespace (repeated boilerplate, a page's nav and footer),
     or sharing the first or last three words with an earlier paragraph and >= 80% of its
     distinct words (a word or two changed). Digits count as words, so table rows or log lines
     that differ only in their numbers are kept. Short paragraphs (``}``, ``---``) never drop.
  3. ``fit_text``: cut to a token limit, keeping the head, the tail or both, with an elision
     marker ``\\n[... N tokens elided ...]\\n`` where the text was cut.
  4. ``allocate``: share a token budget between several texts (max-min fair: texts smaller
     than an equal share keep everything, the big ones split the rest).

The guarantee of ``fit_text``: the returned text was measured with ``count`` and fits, or it is
the empty string (0 tokens). It never trusts an estimate: candidate cuts are guessed from the
text's own characters-per-token ratio (so a guess is usually within a few percent), then
counted; a miss shrinks the guess by the measured overshoot plus a safety margin. The number of
``count`` calls is bounded by ``max_counts`` (default 8) whatever the text, so a backend
``/tokenize`` is asked a handful of times per text, not hundreds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Count = Callable[[str], int]
Strategy = str  # "head_tail" | "head" | "tail"

MARKER = "\n[... {n} tokens elided ...]\n"
SAFETY_MARGIN = 0.03  # shrink a missed guess by this much more than the measured overshoot
GOOD_ENOUGH = 0.97  # stop searching once a fitting cut uses this share of the limit
SNAP_CHARS = 200  # move a cut back to a line or word boundary within this many characters
SNAP_SHARE = 8  # ... and at most 1/8 of the kept part, so a short cut keeps most of its room
MARKER_TOKENS_GUESS = 12  # what the elision marker costs, for the first guess only
MIN_DUPLICATE_CHARS = 40  # shorter paragraphs are never treated as duplicates
SIMILAR_WORDS = 0.8


@dataclass(frozen=True)
class Fitted:
    text: str
    tokens: int
    trimmed: bool
    elided_tokens: int = 0
    counts: int = 0  # calls made to ``count``


# -- 1. whitespace ------------------------------------------------------------------------
_INLINE_BLANKS = re.compile(r"(?<=\S)[ \t\f\v]{2,}")
_TRAILING_BLANKS = re.compile(r"[ \t\f\v]+$", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n{3,}")


def normalise_whitespace(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING_BLANKS.sub("", text)
    text = _INLINE_BLANKS.sub(" ", text)
    return _BLANK_LINES.sub("\n\n", text).strip("\n")


# -- 2. near-duplicate paragraphs ---------------------------------------------------------
_PARAGRAPH_SPLIT = re.compile(r"\n[ \t]*\n")
_WORD = re.compile(r"[^\W_]+")


def drop_near_duplicates(text: str) -> tuple[str, int]:
    """``text`` without paragraphs that repeat an earlier one; also how many were dropped."""
    kept: list[str] = []
    exact: set[str] = set()
    by_edge: dict[tuple[str, ...], list[set[str]]] = {}
    dropped = 0
    for paragraph in _PARAGRAPH_SPLIT.split(text):
        if len(paragraph.strip()) < MIN_DUPLICATE_CHARS:
            kept.append(paragraph)
            continue
        words = [w.lower() for w in _WORD.findall(paragraph)]
        key = " ".join(words)
        edges = [("<", *words[:3]), (">", *words[-3:])]
        if key in exact or _similar_to_earlier(set(words), edges, by_edge):
            dropped += 1
            continue
        exact.add(key)
        for edge in edges:
            by_edge.setdefault(edge, []).append(set(words))
        kept.append(paragraph)
    return "\n\n".join(kept), dropped


def _similar_to_earlier(
    words: set[str], edges: list[tuple[str, ...]], by_edge: dict[tuple[str, ...], list[set[str]]]
) -> bool:
    if not words:
        return False
    for edge in edges:
        for earlier in by_edge.get(edge, [])[-20:]:  # bounded: cost stays linear in paragraphs
            if len(words & earlier) / len(words | earlier) >= SIMILAR_WORDS:
                return True
    return False


# -- 3. cutting to a limit ----------------------------------------------------------------
def marker(elided_tokens: int) -> str:
    return MARKER.format(n=elided_tokens)


def cut(text: str, keep_chars: int, strategy: Strategy, head_fraction: float, ratio: float) -> str:
    """``text`` cut down to about ``keep_chars`` characters plus an elision marker.

    ``ratio`` is the text's characters per token, used to state how many tokens were elided.
    """
    keep_chars = max(0, min(keep_chars, len(text)))
    if keep_chars >= len(text):
        return text
    if strategy == "head":
        head_chars, tail_chars = keep_chars, 0
    elif strategy == "tail":
        head_chars, tail_chars = 0, keep_chars
    else:
        head_chars = round(keep_chars * head_fraction)
        tail_chars = keep_chars - head_chars
    head_end = _snap_back(text, head_chars, min(SNAP_CHARS, head_chars // SNAP_SHARE))
    tail_start = _snap_forward(
        text, len(text) - tail_chars, min(SNAP_CHARS, tail_chars // SNAP_SHARE)
    )
    elided = max(1, round((tail_start - head_end) / ratio))
    return text[:head_end] + marker(elided) + text[tail_start:]


def _snap_back(text: str, end: int, reach: int) -> int:
    """A cut at ``end`` moved back to just after a newline (else a space) within ``reach``."""
    if end <= 0 or end >= len(text):
        return max(0, min(end, len(text)))
    window = text[max(0, end - reach) : end]
    for sep in ("\n", " "):
        at = window.rfind(sep)
        if at >= 0:
            return end - len(window) + at + 1
    return end


def _snap_forward(text: str, start: int, reach: int) -> int:
    if start <= 0 or start >= len(text):
        return max(0, min(start, len(text)))
    window = text[start : start + reach]
    for sep in ("\n", " "):
        at = window.find(sep)
        if at >= 0:
            return start + at + 1
    return start


def fit_text(
    text: str,
    limit_tokens: int,
    count: Count,
    *,
    strategy: Strategy = "head_tail",
    head_fraction: float = 0.6,
    tokens: int | None = None,
    max_counts: int = 8,
) -> Fitted:
    """``text`` cut so that ``count(result) <= limit_tokens`` (see the module docstring).

    ``tokens`` is the count of ``text`` when the caller already knows it.
    """
    if limit_tokens < 0:
        raise ValueError(f"limit_tokens must be >= 0, got {limit_tokens}")
    calls = 0
    if tokens is None:
        tokens, calls = count(text), 1
    if tokens <= limit_tokens:
        return Fitted(text, tokens, False, 0, calls)
    ratio = max(len(text), 1) / max(tokens, 1)
    target = limit_tokens - max(1, math.floor(limit_tokens * SAFETY_MARGIN))
    best: Fitted | None = None
    fits_at, misses_at = -1, len(text)  # largest fitting / smallest missing kept-char count
    points: list[tuple[int, int]] = []
    guess = math.floor((target - MARKER_TOKENS_GUESS) * ratio)
    while calls < max_counts and fits_at + 1 <= misses_at - 1:
        guess = max(fits_at + 1, min(guess, misses_at - 1))
        candidate = cut(text, guess, strategy, head_fraction, ratio)
        measured = count(candidate)
        calls += 1
        points.append((guess, measured))
        if measured > limit_tokens:
            misses_at = guess
        else:
            fits_at = guess
            if best is None or measured > best.tokens:
                best = Fitted(candidate, measured, True, max(0, tokens - measured), calls)
            if measured >= limit_tokens * GOOD_ENOUGH:
                break
        guess = _next_guess(points, ratio, target, fits_at, misses_at)
    if best is not None:
        return Fitted(best.text, best.tokens, True, best.elided_tokens, calls)
    return _smallest_cut(text, limit_tokens, count, strategy, head_fraction, ratio, tokens, calls)


def _next_guess(
    points: list[tuple[int, int]], ratio: float, target: int, fits_at: int, misses_at: int
) -> int:
    """Secant step towards ``target`` tokens from the last measurements.

    The slope (tokens per kept character) comes from the last two points when they give a
    usable one, else from the whole text's ratio; the offset absorbs the marker and boundary
    effects. A step that lands outside the open bracket (fits_at, misses_at) bisects instead.
    """
    g1, m1 = points[-1]
    slope = 1 / ratio
    if len(points) >= 2:
        g0, m0 = points[-2]
        if g1 != g0 and (m1 - m0) / (g1 - g0) > 0:
            slope = (m1 - m0) / (g1 - g0)
    guess = math.floor(g1 + (target - m1) / slope)
    if fits_at < guess < misses_at:
        return guess
    return fits_at + max(1, (misses_at - fits_at) // 2)


def _smallest_cut(
    text: str,
    limit_tokens: int,
    count: Count,
    strategy: Strategy,
    head_fraction: float,
    ratio: float,
    tokens: int,
    calls: int,
) -> Fitted:
    """Out of guesses: the marker alone if it fits, else nothing (0 tokens always fits)."""
    only_marker = cut(text, 0, strategy, head_fraction, ratio)
    measured = count(only_marker)
    if measured <= limit_tokens:
        return Fitted(only_marker, measured, True, tokens, calls + 1)
    return Fitted("", 0, True, tokens, calls + 1)


# -- 4. sharing a budget ------------------------------------------------------------------
def allocate(sizes: Sequence[int], budget: int) -> list[int]:
    """Per-text limits summing to at most ``budget``: max-min fair ("water filling").

    Texts no bigger than an equal share of what is left keep all their tokens; the rest share
    the remainder equally. ``allocate([100, 5000, 9000], 3000) == [100, 1450, 1450]``.
    """
    budget = max(0, budget)
    limits = [0] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    left, remaining = budget, len(sizes)
    for i in order:
        share = left // remaining
        limits[i] = min(sizes[i], share)
        left -= limits[i]
        remaining -= 1
    return limits
