"""Generated text: reasoning prose, answers, reasoning loops, as streams of token pieces.

Every stream hands out *token pieces* (strings from ``tokenizer.split_pieces``), so the number of
tokens the engine counts is exactly the number of pieces the client receives, and re-tokenising the
text gives the same count back (up to joins at word boundaries).

- ``ProseStream``: sentences from ten patterns ("If the {N} is {A}, then the {N} {M} {V} {num}
  {Ns}.") filled from word lists (~170 nouns, ~70 adjectives, ~90 verbs), some opened by a
  connective ("Wait,", "Hmm,"); paragraphs of 3-6 sentences. Slots are filled independently, so
  runs of more than a few words essentially never repeat and a loop detector watching normal
  output sees no loop.
- ``LoopStream(exact=True)``: some normal prose, then one paragraph repeated verbatim forever
  (a model circling in its reasoning).
- ``LoopStream(exact=False)``: the same paragraph, but each repetition changes one word and bumps a
  number ("check 7 ... check 8"), the near-duplicate loop that exact matching misses.
- ``ShortLoopStream``: some normal prose, then a passage of 40 - 80 words that keeps coming back
  in one endless paragraph, each time with its numbers redrawn and now and then broken off and
  restarted with "Wait," (a small model's short cycle at a low answer cap): no two repetitions are
  equal and no paragraph ever ends, so only a detector that counts repetitions of the passage
  sees it early.
- ``FixedPieces``: a precomputed piece list (JSON answers, tool calls).
- ``UnicodeStream``: prose mixed with Japanese sentences and the characters U+2028, U+2029 and
  U+0085, which JSON encoders leave raw and naive line splitters (``str.splitlines``) break on.

All randomness comes from the ``random.Random`` passed in, seeded per request by the caller.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from fleet.sim.tokenizer import split_pieces


def _split(text: str) -> list[str]:
    return text.split()


_NOUNS = _split("""
request answer value result number list table record field column row file function module
service server queue worker task job step stage phase part section chapter paragraph sentence word
token budget limit ceiling threshold window interval deadline error failure retry attempt timeout
delay latency rate speed cost price total sum average median range minimum maximum count ratio
share weight priority order sequence pattern case example detail point issue problem reason cause
effect option choice plan idea approach method strategy rule constraint assumption condition
requirement goal target estimate customer supplier invoice contract shipment warehouse payment
account balance report summary draft version change update note comment review approval meeting
schedule calendar morning evening week month year discount margin revenue river mountain village
station bridge library garden market kitchen window letter story document paper question reply
schema parameter argument output input prompt context message header footer title label category
""")
_ADJS = _split("""
correct wrong large small long short early late new old same different similar simple complex
careful rough exact approximate important minor major obvious subtle likely unlikely possible
safe risky valid invalid empty full partial whole complete missing extra remaining previous
following current final initial main other original internal external clear vague strict loose
cheap expensive recent stable fragile useful
""")
_VERBS = _split("""
check verify confirm compare consider recall notice assume expect decide choose keep drop move
split merge sort filter count measure compute calculate derive reduce increase fit write read
parse format convert translate summarize explain describe mention include exclude return send
receive store load save open close start stop finish continue repeat skip find search scan map
track follow reach hold fill use build revise test adjust review list group rank estimate
""")
_PREPS = _split("""
about above across after against along among around before behind below beside between beyond
during from inside into near outside over past through toward under within without for with
""")
_SUBJECTS = ["I", "we", "the user", "the reader", "the team", "the client", "this step"]
_MODALS = ["should", "could", "might", "must", "can", "will", "need to", "want to", "have to"]
_ADVERBS = _split("""quickly carefully again first later slightly mostly probably clearly roughly
already still only simply exactly""")
_WORDS = _NOUNS + _ADJS + _VERBS
_CONNECTIVES = [
    "Wait,", "Hmm,", "Okay,", "So", "Now", "But", "Also,", "Alternatively,", "Let me see,",
    "Actually,", "First,", "Then", "On the other hand,", "In that case", "Right,", "Well,",
]
_PATTERNS = [
    "{S} {M} {V} the {A} {N} {P} the {N}.",
    "The {N} {Vs} the {N} {D}, so {s} {M} {V} the {N} first.",
    "If the {N} is {A}, then the {N} {M} {V} {num} {Ns}.",
    "That means the {N} of the {N} is {A}, not {A}.",
    "{S} {M} {V} whether the {N} {P} the {N} is still {A}.",
    "Why would the {N} {V} the {A} {N} {P} the {N}?",
    "There are {num} {Ns} in the {N}, which {M} {V} the {N}.",
    "So the {N} is about {num} {Ns}, which fits the {A} {N}.",
    "The {A} {N} {Vs} {num} {Ns}, and the {N} {Vs} the rest.",
    "{S} {M} {V} the {N} and then {V} the {A} {Ns} {P} it.",
]
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


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    return noun + "s"


def _fill(rng: random.Random, slot: str) -> str:
    choice = rng.choice
    if slot == "N":
        return choice(_NOUNS)
    if slot == "Ns":
        return _plural(choice(_NOUNS))
    if slot == "A":
        return choice(_ADJS)
    if slot == "V":
        return choice(_VERBS)
    if slot == "Vs":
        return _plural(choice(_VERBS))
    if slot == "P":
        return choice(_PREPS)
    if slot in ("S", "s"):
        return choice(_SUBJECTS)
    if slot == "M":
        return choice(_MODALS)
    if slot == "D":
        return choice(_ADVERBS)
    return str(rng.randint(2, 4000))


def sentence(rng: random.Random) -> str:
    """One sentence from a random pattern, leading space included."""
    pattern = rng.choice(_PATTERNS)
    words = [_fill(rng, w[1:-1]) if w.startswith("{") else w
             for w in pattern.replace("{", " {").replace("}", "} ").split()]
    text = " ".join(words).replace(" ,", ",").replace(" .", ".").replace(" ?", "?")
    if rng.random() < 0.25:
        text = rng.choice(_CONNECTIVES) + " " + text[0].lower() + text[1:]
    if not text.startswith("I "):
        text = text[0].upper() + text[1:]
    return " " + text


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
        self._buf.extend(self._lead + ["\n\n"])
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


_NUMBER = re.compile(r"\d+")
_RESTARTS = ("Wait, ", "Wait, let me redo this. ", "Hmm, wait. ")


class ShortLoopStream(PieceStream):
    """``lead_tokens`` of normal prose, then a passage of 40 - 80 words (with at least three
    numbers) repeated in one paragraph: each repetition redraws the numbers, and one in three
    breaks off part way and starts again with a "Wait," opener."""

    def __init__(self, rng: random.Random, lead_tokens: int = 200) -> None:
        super().__init__()
        self._rng = rng
        self._buf.extend(ProseStream(rng).take(lead_tokens) + ["\n\n"])
        passage = ""
        while len(passage.split()) < 40 or len(_NUMBER.findall(passage)) < 3:
            passage += sentence(rng)
            if len(passage.split()) > 80:
                passage = ""
        self._parts = _NUMBER.split(passage.strip() + " ")  # the text around the numbers
        self._restart = ""

    def _refill(self) -> bool:
        rng = self._rng
        numbers = [str(rng.randint(2, 4000)) for _ in self._parts[1:]]
        text = self._parts[0] + "".join(n + part for n, part in zip(numbers, self._parts[1:],
                                                                     strict=True))
        text = self._restart + (text[0].lower() + text[1:] if self._restart else text)
        self._restart = ""
        if rng.random() < 1 / 3:  # break off and start over
            words = text.split(" ")
            text = " ".join(words[: rng.randint(len(words) // 3, len(words) - 2)]) + " "
            self._restart = rng.choice(_RESTARTS)
        self._buf.extend(split_pieces(text))
        return True


_JAPANESE = [
    "まず、請求書の合計を確認します。",
    "次に、支払いの期限をもう一度見直す必要があります。",
    "東京の倉庫から出荷された荷物は三日後に届きます。",
    "この表の数値は、先月の報告書と一致しています。",
    "答えは次の通りです。",
]
# Line and paragraph separators and NEL: valid text, not SSE or JSONL line ends.
UNICODE_BREAKS = ("\u2028", "\u2029", "\u0085")


class UnicodeStream(PieceStream):
    """Paragraphs alternating Japanese and English sentences, separated by each of
    ``UNICODE_BREAKS`` in turn: the first few dozen tokens of a paragraph hold all three."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self._rng = rng

    def _refill(self) -> bool:
        rng = self._rng
        parts = [rng.choice(_JAPANESE), sentence(rng).lstrip(), rng.choice(_JAPANESE)]
        text = "".join(part + brk for part, brk in zip(parts, UNICODE_BREAKS, strict=True))
        self._buf.extend(split_pieces(text + sentence(rng) + "\n\n"))
        return True


def iter_words(rng: random.Random) -> Iterator[str]:
    while True:
        yield rng.choice(_WORDS)
