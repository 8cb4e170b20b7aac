"""Carry-over between attempts: what an aborted attempt established goes into the next one.

A retry is a new stateless request; without help the model redoes the work of the attempt that
looped and often loops the same way. So when an attempt is aborted (loop, stall, dropped stream,
forced end without an answer), its reasoning is mined for conclusions - sentences with a concluding
marker ("so", "therefore", "thus", "the answer is", "we get", an equation with a number ...) -
de-duplicated (exact after normalising, and near-duplicates by word-set Jaccard, which a loop
produces by the dozen), and bounded (``MAX_NOTE_CHARS``, the latest conclusions win). The retry gets
a note::

    [fleet note] A previous attempt concluded:
    - ...
    Do not redo that work; build on it and conclude with the answer.

A template loop concludes nothing: it cycles through guesses that each end in "but without the
X, I can't compute it". What it did establish is that those guesses are dead ends, so they are mined
too (``extract_dead_ends``: sentences with an impossibility marker, de-duplicated the same way) and
the note lists them as tried and found impossible (after the conclusions, when there are any).
When the dead ends say that something the question needs is not given (a missing premise:
"without knowing", "not given", "missing" ...), the note steers the next attempt to say so and
name what is missing instead of guessing again::

    [fleet note] A previous attempt (loop watcher: ...) tried these and found them impossible:
    - ...
    If the question lacks information needed to answer it, say so plainly, name what is missing,
    and stop; do not guess again.

The note goes into the leading system message (inserted if the job has none): the job's own
user turns stay exactly as they were and last, and templates that accept a system message only in
first place still render it. The next attempt also gets a new seed
and a slightly higher temperature (fleet/infer/attempts.py).

Attempt history: ``{p}attempts:{<ref>}`` is a Redis list of attempt JSON (code, cause, carried
conclusions ...), RPUSHed after every attempt with the events TTL, so a redelivered job (its worker
died, the lease expired) starts from what earlier attempts concluded instead of from nothing.
"""

from __future__ import annotations

import json
import re
from typing import Any

import redis

from fleet.core.keys import Keys
from fleet.core.request import neutralise

MAX_NOTE_CHARS = 1500
MAX_SENTENCE_CHARS = 300
NEAR_DUPLICATE = 0.7

# Japanese sentences end at 。！？ with no space after them.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])\s*|\n+")
_MARKERS = re.compile(
    r"\b(so|therefore|thus|hence|the answer is|answer:|final answer|in conclusion|we get|"
    r"which gives|that gives|this gives|result(?:s)? (?:is|in)|conclude|it follows|"
    r"must be|equals?|is equal to|total(?:ly)? (?:is|of))\b"
    r"|=\s*-?\$?\d|\\boxed",
    re.IGNORECASE,
)
# "can't compute it", "cannot be determined", "impossible", and the Japanese forms the deployment
# also serves ("できない", "分からない", "求められない").
_DEAD_END = re.compile(
    r"\b(can(?:no|')t|could(?:n't| not)|unable to|impossible|no way to|not possible|"
    r"isn't possible|doesn't work|does not work)\b|できない|分からない|わからない|求められない|不可能",
    re.IGNORECASE,
)
_MISSING = re.compile(
    r"\bwithout (?:knowing|the|any|more|additional|specific)\b|\bnot (?:given|provided|specified|stated)\b|"
    r"\bmissing\b|\bno (?:information|data|values?)\b|\bnot enough information\b|"
    r"\binsufficient\b|与えられていない|分からない|わからない|不足|欠けて|ない(?:ので|から)",
    re.IGNORECASE,
)
MAX_DEAD_ENDS = 6
_HEDGE = re.compile(r"^\s*(wait|hmm|but wait|let me|maybe|perhaps|or maybe)\b", re.IGNORECASE)
_WORDS = re.compile(r"\w+")


def _normal(sentence: str) -> str:
    return " ".join(_WORDS.findall(sentence.lower()))


def _similar(a: set[str], b: set[str]) -> bool:
    if not a or not b:
        return False
    return len(a & b) / len(a | b) >= NEAR_DUPLICATE


def _candidates(reasoning: str) -> list[str]:
    return [s for s in _sentences(reasoning) if not _HEDGE.match(s) and _MARKERS.search(s)]


def extract_conclusions(reasoning: str, max_chars: int = MAX_NOTE_CHARS) -> list[str]:
    """Distinct conclusions of a reasoning text, in order, at most ``max_chars`` in total.

    Scans from the end (the latest conclusions are the most informative) and keeps a sentence
    unless an already kept one is the same or nearly the same.
    """
    kept: list[tuple[str, set[str]]] = []
    seen: set[str] = set()
    total = 0
    for sentence in reversed(_candidates(reasoning)):
        key = _normal(sentence)
        words = set(key.split())
        if key in seen or any(_similar(words, other) for _, other in kept):
            continue
        if total + len(sentence) + 3 > max_chars:
            break
        seen.add(key)
        kept.append((sentence, words))
        total += len(sentence) + 3
    return [sentence for sentence, _ in reversed(kept)]


def extract_dead_ends(reasoning: str, max_items: int = MAX_DEAD_ENDS) -> list[str]:
    """Distinct things the reasoning tried and found impossible, latest first kept, in order.

    A template loop writes the same dead end dozens of times with a word swapped; the near-duplicate
    test keeps one of each, and ``max_items`` bounds the note."""
    sentences = [s for s in _sentences(reasoning) if _DEAD_END.search(s)]
    kept: list[tuple[str, set[str]]] = []
    for sentence in reversed(sentences):
        words = set(_normal(sentence).split())
        if any(_similar(words, other) for _, other in kept):
            continue
        kept.append((sentence, words))
        if len(kept) >= max_items:
            break
    return [sentence for sentence, _ in reversed(kept)]


def _sentences(reasoning: str) -> list[str]:
    out = []
    for raw in _SENTENCE_END.split(reasoning):
        sentence = " ".join(raw.split())
        if len(sentence) < 12:
            continue
        if len(sentence) > MAX_SENTENCE_CHARS:
            sentence = sentence[: MAX_SENTENCE_CHARS - 1].rstrip() + "…"
        out.append(sentence)
    return out


def merge_conclusions(old: list[str], new: list[str], max_chars: int = MAX_NOTE_CHARS) -> list[str]:
    """Conclusions of several attempts, de-duplicated, newest kept when over the bound."""
    return extract_conclusions("\n".join(old + new), max_chars)


def retry_note(conclusions: list[str], cause: str, dead_ends: list[str] | None = None) -> str:
    """The note for the next attempt: what earlier attempts concluded, what they tried and found
    impossible, and - when those dead ends say something is not given - the missing-premise steer."""
    parts = []
    if conclusions:
        parts.append("concluded:\n" + "\n".join(f"- {c}" for c in conclusions))
    if dead_ends:
        parts.append("tried these and found them impossible:\n" + "\n".join(f"- {d}" for d in dead_ends))
    if not parts:
        return (
            f"[fleet note] A previous attempt was stopped ({cause}) before it concluded. "
            "Reason briefly, do not go over the same ground twice, and conclude with the answer."
        )
    if dead_ends and any(_MISSING.search(d) for d in dead_ends):
        steer = ("If the question lacks information needed to answer it, say so plainly, name what "
                 "is missing, and stop; do not guess again.")
    elif conclusions:
        steer = "Do not redo that work; build on it and conclude with the answer."
    else:
        steer = "Do not try those again; take a different approach and conclude with the answer."
    return f"[fleet note] A previous attempt ({cause}) " + "\nIt ".join(parts) + f"\n{steer}"


def with_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """A copy of ``messages`` with ``note`` appended to the leading system message (one is
    inserted when there is none). The note is neutralised: it quotes model output, which may
    echo chat-template tags from untrusted material, and it lands in the system turn."""
    note = neutralise(note)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{note}"
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


# -- attempt history in Redis -------------------------------------------------------------------


def record_attempt(
    pipe: redis.client.Pipeline, keys: Keys, ref: str, attempt: dict[str, Any], ttl_s: int
) -> None:
    """Queue the attempt's entry on ``pipe`` (the caller executes it, with its other records)."""
    key = keys.attempts(ref)
    pipe.rpush(key, json.dumps(attempt, default=str))
    pipe.expire(key, ttl_s)


def load_attempts(client: redis.Redis, keys: Keys, ref: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(keys.attempts(ref), 0, -1)]
