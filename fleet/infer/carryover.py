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

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_MARKERS = re.compile(
    r"\b(so|therefore|thus|hence|the answer is|answer:|final answer|in conclusion|we get|"
    r"which gives|that gives|this gives|result(?:s)? (?:is|in)|conclude|it follows|"
    r"must be|equals?|is equal to|total(?:ly)? (?:is|of))\b"
    r"|=\s*-?\$?\d|\\boxed",
    re.IGNORECASE,
)
_HEDGE = re.compile(r"^\s*(wait|hmm|but wait|let me|maybe|perhaps|or maybe)\b", re.IGNORECASE)
_WORDS = re.compile(r"\w+")


def _normal(sentence: str) -> str:
    return " ".join(_WORDS.findall(sentence.lower()))


def _similar(a: set[str], b: set[str]) -> bool:
    if not a or not b:
        return False
    return len(a & b) / len(a | b) >= NEAR_DUPLICATE


def _candidates(reasoning: str) -> list[str]:
    out = []
    for raw in _SENTENCE_END.split(reasoning):
        sentence = " ".join(raw.split())
        if len(sentence) < 12 or _HEDGE.match(sentence) or not _MARKERS.search(sentence):
            continue
        if len(sentence) > MAX_SENTENCE_CHARS:
            sentence = sentence[: MAX_SENTENCE_CHARS - 1].rstrip() + "…"
        out.append(sentence)
    return out


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


def merge_conclusions(old: list[str], new: list[str], max_chars: int = MAX_NOTE_CHARS) -> list[str]:
    """Conclusions of several attempts, de-duplicated, newest kept when over the bound."""
    return extract_conclusions("\n".join(old + new), max_chars)


def retry_note(conclusions: list[str], cause: str) -> str:
    if not conclusions:
        return (
            f"[fleet note] A previous attempt was stopped ({cause}) before it concluded. "
            "Reason briefly, do not go over the same ground twice, and conclude with the answer."
        )
    lines = "\n".join(f"- {c}" for c in conclusions)
    return (
        f"[fleet note] A previous attempt ({cause}) concluded:\n{lines}\n"
        "Do not redo that work; build on it and conclude with the answer."
    )


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
    client: redis.Redis, keys: Keys, ref: str, attempt: dict[str, Any], ttl_s: int
) -> None:
    key = keys.attempts(ref)
    pipe = client.pipeline(transaction=False)
    pipe.rpush(key, json.dumps(attempt, default=str))
    pipe.expire(key, ttl_s)
    pipe.execute()


def load_attempts(client: redis.Redis, keys: Keys, ref: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(keys.attempts(ref), 0, -1)]
