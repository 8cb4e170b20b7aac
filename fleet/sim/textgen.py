"""Generated text: reasoning prose, answers, reasoning loops, as streams of token pieces.

Every stream hands out *token pieces* (strings from ``tokenizer.split_pieces``), so the number of
tokens the engine counts is exactly the number of pieces the client receives, and re-tokenising the
text gives the same count back (up to joins at word boundaries).

- ``ProseStream``: sentences of 7-22 words drawn from a word list, with connectives, numbers and
  questions mixed in; paragraphs of 3-6 sentences. With ~400 words and random structure, word
  8-grams essentially never repeat, so a loop detector watching normal output sees no loop.
- ``LoopStream(exact=True)``: some normal prose, then one paragraph repeated verbatim forever
  (a model circling in its reasoning).
- ``LoopStream(exact=False)``: the same paragraph, but each repetition changes one word and bumps a
  number ("check 7 ... check 8"), the near-duplicate loop that exact matching misses.
- ``FixedPieces``: a precomputed piece list (JSON answers, tool calls).

All randomness comes from the ``random.Random`` passed in, seeded per request by the caller.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from fleet.sim.tokenizer import split_pieces

_WORDS = """
the a this that each every some any which what when where because although while since so then
thus therefore however still also perhaps maybe probably clearly actually really simply only just
first second next finally again instead otherwise meanwhile anyway indeed
I we it they user request question answer value result number list table record field column row
file function module service server queue worker task job step stage phase part piece section
chapter paragraph sentence word token budget limit ceiling threshold window interval deadline
error failure retry attempt timeout delay latency throughput rate speed cost price total sum
average median range minimum maximum count ratio share weight priority order sequence pattern
case example detail point issue problem reason cause effect consequence option choice plan idea
approach method strategy rule constraint assumption condition requirement goal target estimate
should would could might must can will may need want try check verify confirm compare consider
recall remember notice assume suppose expect imagine guess decide choose prefer keep drop move
split merge sort filter count measure compute calculate derive reduce increase grow shrink fit
write read parse format convert translate summarize explain describe mention include exclude
return send receive store load save open close start stop begin finish continue repeat skip
look see find search scan list map track follow lead leave reach hold fill free use build
correct wrong right left large small long short early late new old same different similar
simple complex careful rough exact approximate important minor major obvious subtle likely
unlikely possible impossible safe risky valid invalid empty full partial whole complete missing
extra remaining previous following current final initial main other original internal external
about above across after against along among around before behind below beside between beyond
during except from inside into near outside over past through toward under until upon within
without customer supplier invoice contract shipment warehouse order payment account balance
report summary draft version change update note comment review approval meeting schedule
calendar morning evening week month year today tomorrow price discount margin revenue budget
river mountain village station bridge library garden market kitchen window letter story
""".split()
_CONNECTIVES = [
    "Wait,", "Hmm,", "Okay,", "So", "Now", "But", "Also,", "Alternatively,", "Let me see,",
    "Actually,", "First,", "Then", "On the other hand,", "In that case", "Right,", "Well,",
]
_CAPS: dict[str, str] = {}


def _cap(word: str) -> str:
    out = _CAPS.get(word)
    if out is None:
        out = _CAPS[word] = word[:1].upper() + word[1:]
    return out


class PieceStream:
    """A source of token pieces; ``take(n)`` returns the next ``n`` (may be fewer if finite)."""

    def __init__(self) -> None:
        self._buf: list[str] = []
        self._pos = 0

    def _refill(self) -> bool:
        return False

    def take(self, n: int) -> list[str]:
        while len(self._buf) - self._pos < n:
            if self._pos > 4096:
                del self._buf[: self._pos]
                self._pos = 0
            if not self._refill():
                break
        out = self._buf[self._pos : self._pos + n]
        self._pos += len(out)
        return out


class FixedPieces(PieceStream):
    def __init__(self, pieces: list[str]) -> None:
        super().__init__()
        self._buf = list(pieces)


def sentence(rng: random.Random) -> str:
    """One sentence, leading space included."""
    words: list[str] = []
    if rng.random() < 0.3:
        words.append(rng.choice(_CONNECTIVES))
    for _ in range(rng.randint(7, 22)):
        r = rng.random()
        if r < 0.04:
            words.append(str(rng.randint(2, 4000)))
        elif r < 0.08 and words:
            words[-1] += ","
        words.append(rng.choice(_WORDS))
    words[0] = _cap(words[0].rstrip(","))
    end = "?" if rng.random() < 0.12 else "."
    return " " + " ".join(words).rstrip(",") + end


def paragraph(rng: random.Random) -> str:
    text = "".join(sentence(rng) for _ in range(rng.randint(3, 6)))
    return text.lstrip() + "\n\n"


class ProseStream(PieceStream):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self._rng = rng

    def _refill(self) -> bool:
        self._buf.extend(split_pieces(paragraph(self._rng)))
        return True


class LoopStream(PieceStream):
    """``lead_tokens`` of normal prose, then a paragraph repeated (exactly or near-exactly)."""

    def __init__(self, rng: random.Random, exact: bool, lead_tokens: int = 200) -> None:
        super().__init__()
        self._rng = rng
        self._exact = exact
        self._lead = ProseStream(rng).take(lead_tokens)
        self._buf.extend(self._lead)
        self._words = paragraph(rng).split(" ")
        self._round = rng.randint(2, 9)
        self._fixed = split_pieces(" ".join(self._words))

    def _refill(self) -> bool:
        if self._exact:
            self._buf.extend(self._fixed)
            return True
        words = list(self._words)
        i = self._rng.randrange(1, len(words) - 1)
        words[i] = self._rng.choice(_WORDS)
        self._round += 1
        text = f"Let me check step {self._round} once more. " + " ".join(words)
        self._buf.extend(split_pieces(text))
        return True


def iter_words(rng: random.Random) -> Iterator[str]:
    while True:
        yield rng.choice(_WORDS)
