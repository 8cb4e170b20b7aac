"""Loop watcher: decides, while the reasoning streams, that the model is circling.

Five detectors, each cheap enough for a worker streaming 32 requests at once (the benchmark
``fleet bench loops`` measures the CPU cost per 1,000 streamed tokens):

1. Exact periodic repetition at the tail. Every ``check_every_chars`` new characters, the last
   ``key_chars`` characters are searched backwards (``str.rfind``, C speed) in a bounded tail
   window; each earlier occurrence at distance ``p`` (``min_period_chars <= p <=
   max_period_chars``) is a candidate period. The tail has period ``p`` over a span ``S`` iff
   ``tail[-S:-p] == tail[-S+p:]`` (one slice comparison). It fires when
   ``S = max(min_repeats * p, min_repeat_span_chars)`` is periodic, i.e. at least ``min_repeats``
   repeats that together cover at least ``min_repeat_span_chars``. The span floor is what keeps
   short legitimate repetition (a row of digits, "= 0 = 0") from firing.
2. Near-duplicate paragraphs. A paragraph ends at a blank line; one with at least
   ``min_paragraph_words`` words (two or more letters: formulas and short asides like "Wait." or
   "Hmm, let me check again." are skipped, normal reasoning repeats those) becomes a set of hashed
   word trigrams and is compared with the last ``paragraph_window`` paragraphs; when it and at
   least ``similar_paragraphs - 1`` of them have a Jaccard similarity ``>= paragraph_jaccard``
   the reasoning is going round in paraphrases (the loop an exact detector, and vLLM's own
   repetition detection, never sees). With ``drop_numbers`` the trigrams are over words only, so
   "check step 7 ... check step 8" counts as the same paragraph.
   Tuning on the 1,188 real traces (docs/inference.md, "Loop watcher"): zero alarms at 0.75 and
   0.7, the first at 0.65; the simulator's near-duplicate loop scores about 0.79.
3. Template loops: the model cycles through paragraphs built on one template with a few words
   swapped ("perhaps it is a problem about X ... but without knowing Y, I can't compute it"), the
   period drifts, and no paragraph pair is a near-duplicate. What stays is that almost every short
   span of the recent text has been written before. Every ``share_chunk_chars`` the new text is
   cut into words (a run of kana, katakana or kanji counts as one, so Japanese reasoning is cut
   the same way) and into hashed k-grams of ``share_gram_words`` words; the *repeated share* is the
   fraction of the k-grams of the last ``share_window_chunks`` updates that occurred earlier. It
   fires at ``repeat_share``. The earlier text is remembered as two generations of hash sets of at
   most ``share_history_grams`` each (the older one dropped when the newer fills), so the state per
   stream is bounded whatever the length of the reasoning. On the 1,188 real traces the share
   peaks at 0.76 (re-checked computations, restated conditions); real template loops climb to
   0.9 - 1.0 within a few thousand characters and stay there.
4. Short cycles: a passage that keeps coming back, verbatim or with small edits (numbers that
   change, a "Wait," restart, a new sentence between two repetitions), counted in repetitions
   rather than in tokens since the start, so a 4,096-token answer is judged like a 40,000-token
   one. The words of the share's batches (numbers dropped: numbers that change are the commonest
   edit) are cut into hashed shingles of ``cycle_gram_words`` words. Each shingle remembers where
   it was last seen and its *repetition*: 1 when new, one more each time it comes back at least
   ``cycle_min_gap_words`` and at most ``cycle_max_gap_words`` words after the last time (closer:
   the same passage still, no new repetition - a short period is detector 1's; farther: a new
   count begins, the passage did not come back in a row). It fires when at least ``cycle_match``
   of the last ``cycle_passage_words`` shingles have reached repetition ``cycle_repeats``: a
   passage of that length has been written that many times in a row (its first time included),
   give or take a few edited words.
   One dict lookup per word; the dict forgets shingles older than ``cycle_max_gap_words`` (they
   would start a new count anyway), so the state per stream is bounded. On the 1,188 real traces
   the most repetitive passage is written 3 times (a restated problem, a re-checked table);
   generated Japanese reasoning reaches 4; the default threshold is 5.
5. Stall: no new non-blank reasoning or content for ``stall_s`` while the stream is alive
   (``check_stall``). Armed only after the first text: the wait for the first token belongs to
   the client's first-token timeout.

A watcher is per attempt and single-threaded. Verdicts are values; what to do with them (close the
stream, retry with a carry-over note) is fleet/infer/attempts.py's business.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass
from itertools import filterfalse

from fleet.core.config import WatcherSettings

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_TOKEN = re.compile(r"\w+")
# Words of two or more letters: a formula (single letters, digits) is not a paragraph of prose.
_WORD = re.compile(r"[^\W\d_]{2,}")
# Words for the repeated share: Latin-script words and numbers, and runs of one Japanese script
# (hiragana, katakana, kanji): Japanese has no spaces, and a script change is the nearest cheap
# stand-in for a word boundary that lands at the same place every time the text repeats.
_CJK = "\u3040-\u309f\u30a0-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_SHARE_WORD = re.compile(
    f"[\u3040-\u309f]+|[\u30a0-\u30ff]+|[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+|[^\\W{_CJK}]+"
)
_OPEN_WORD = re.compile(r"\w")


@dataclass(frozen=True)
class Verdict:
    kind: str  # "repeat" | "paragraphs" | "template" | "cycle" | "stall"
    detail: str
    at_chars: int
    period_chars: int = 0
    repeats: float = 0.0


class LoopWatcher:
    def __init__(self, settings: WatcherSettings) -> None:
        self.s = settings
        self.verdict: Verdict | None = None
        self.chars = 0
        self._tail = ""
        self._pending: list[str] = []
        self._pending_chars = 0
        self._keep_chars = (
            max(settings.min_repeats * settings.max_period_chars, settings.min_repeat_span_chars)
            + settings.key_chars
        )
        self._paragraph: list[str] = []
        self._recent: deque[frozenset[int]] = deque(maxlen=settings.paragraph_window)
        self._last_progress: float | None = None
        self._words = _WordBatches(settings.share_chunk_chars)
        self._share = _RepeatedShare(settings)
        self._cycle = _CycleRepeats(settings) if settings.cycle_repeats else None

    # -- input ----------------------------------------------------------------------------------
    def feed(self, text_piece: str, now: float) -> Verdict | None:
        """Take the next piece of reasoning; a verdict the first time a loop is seen."""
        if self.verdict is not None or not text_piece:
            return self.verdict
        self.chars += len(text_piece)
        if not text_piece.isspace():
            self._last_progress = now
        verdict = self._feed_paragraph(text_piece) or self._feed_tail(text_piece)
        if verdict is not None:
            self.verdict = verdict
        return verdict

    def read_before(self, text: str) -> Verdict | None:
        """Reasoning that came before this stream (a continued reasoning, fleet/infer/resume.py):
        read in the pieces a stream brings, so every detector sees it as it would have, without
        starting the stall clock (that starts with this stream's first text)."""
        step = max(1, self.s.check_every_chars)
        for start in range(0, len(text), step):
            if self.feed(text[start:start + step], 0.0) is not None:
                break
        self._last_progress = None
        return self.verdict

    def touch(self, now: float) -> None:
        """Progress outside the reasoning (answer content): keeps the stall detector quiet."""
        self._last_progress = now

    def check_stall(self, now: float) -> Verdict | None:
        if self.verdict is None and self._last_progress is not None:
            silent_s = now - self._last_progress
            if silent_s >= self.s.stall_s:
                self.verdict = Verdict("stall", f"no new text for {silent_s:.0f} s", self.chars)
        return self.verdict

    # -- exact periodic repetition --------------------------------------------------------------
    def _feed_tail(self, piece: str) -> Verdict | None:
        self._pending.append(piece)
        self._pending_chars += len(piece)
        if self._pending_chars < self.s.check_every_chars:
            return None
        new_text = "".join(self._pending)
        self._tail = (self._tail + new_text)[-self._keep_chars:]
        self._pending.clear()
        self._pending_chars = 0
        # The word detectors take the text in the same batches: one call per check, not per piece.
        return self._periodic_tail() or self._feed_words(new_text)

    def _periodic_tail(self) -> Verdict | None:
        tail, s = self._tail, self.s
        n = len(tail)
        key_len = s.key_chars
        if n < s.min_repeat_span_chars or n <= key_len:
            return None
        key = tail[-key_len:]
        end = n - 1  # matches must start before the key itself
        for _ in range(s.max_period_candidates):
            pos = tail.rfind(key, 0, end)
            if pos < 0:
                return None
            period = n - key_len - pos
            if period > s.max_period_chars:
                return None
            end = pos + key_len - 1
            if period < s.min_period_chars:
                continue
            span = max(s.min_repeats * period, s.min_repeat_span_chars)
            if span <= n and tail[n - span : n - period] == tail[n - span + period :]:
                return Verdict(
                    "repeat",
                    f"the last {span} chars repeat with a period of {period} chars",
                    self.chars, period_chars=period, repeats=span / period,
                )
        return None

    # -- word detectors: template loops (the repeated share) and short cycles --------------------
    def _feed_words(self, piece: str) -> Verdict | None:
        words = self._words.feed(piece)
        if words is None:
            return None
        share = self._share.update(words)
        if share is not None and share >= self.s.repeat_share:
            return Verdict(
                "template",
                f"{share:.0%} of the recent {self.s.share_gram_words}-word spans repeat earlier text",
                self.chars, repeats=share,
            )
        if self._cycle is not None and self._cycle.update(words):
            s = self.s
            return Verdict(
                "cycle",
                f"a passage of {s.cycle_passage_words}+ words written {s.cycle_repeats} times "
                f"in a row (period about {self._cycle.period_words} words)",
                self.chars, repeats=float(s.cycle_repeats),
            )
        return None

    # -- near-duplicate paragraphs --------------------------------------------------------------
    def _feed_paragraph(self, piece: str) -> Verdict | None:
        if "\n" not in piece:
            self._paragraph.append(piece)
            return None
        parts = _PARAGRAPH_BREAK.split("".join(self._paragraph) + piece)
        self._paragraph = [parts[-1]]
        for paragraph in parts[:-1]:
            verdict = self._paragraph_done(paragraph)
            if verdict is not None:
                return verdict
        return None

    def _paragraph_done(self, paragraph: str) -> Verdict | None:
        lowered = paragraph.lower()
        words = _WORD.findall(lowered)
        if len(words) < self.s.min_paragraph_words:
            return None
        if not self.s.drop_numbers:
            words = _TOKEN.findall(lowered)
        grams = frozenset(map(hash, zip(words, words[1:], words[2:], strict=False)))
        threshold = self.s.paragraph_jaccard
        similar = sum(1 for old in self._recent if _jaccard(grams, old) >= threshold)
        self._recent.append(grams)
        if similar + 1 >= self.s.similar_paragraphs:
            return Verdict(
                "paragraphs",
                f"{similar + 1} near-duplicate paragraphs among the last {len(self._recent)}",
                self.chars, repeats=float(similar + 1),
            )
        return None


def _jaccard(a: frozenset[int], b: frozenset[int]) -> float:
    if not a or not b:
        return 0.0
    # Cheap bound first: Jaccard <= min/max size, which rules out most pairs without a set op.
    small, large = sorted((len(a), len(b)))
    if small < 0.5 * large:
        return small / large
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


def words_of(text: str) -> list[str]:
    """The words the word detectors see: lower-cased Latin-script words and numbers, and runs of
    one Japanese script."""
    return _SHARE_WORD.findall(text.lower())


class _WordBatches:
    """Cuts the streamed text into words, ``chunk_chars`` at a time (detectors 3 and 4)."""

    def __init__(self, chunk_chars: int) -> None:
        self._chunk = chunk_chars
        self._pending: list[str] = []
        self._pending_chars = 0

    def feed(self, piece: str) -> list[str] | None:
        """The words of the text fed since the last batch, once it holds ``chunk_chars``."""
        self._pending.append(piece)
        self._pending_chars += len(piece)
        if self._pending_chars < self._chunk:
            return None
        text = "".join(self._pending).lower()
        words = _SHARE_WORD.findall(text)
        self._pending = []
        # A batch that ends inside a word keeps the word for the next one (a word split in two
        # differently on two passes over the same text would hide the repeat).
        if words and _OPEN_WORD.match(text[-1]) and len(text) < 4 * self._chunk:
            self._pending = [text[-len(words[-1]):]]
            words.pop()
        self._pending_chars = len(self._pending[0]) if self._pending else 0
        return words


class _RepeatedShare:
    """The share of recent k-grams seen earlier (detector 3); ``update`` returns it after each
    batch once the window holds ``share_min_grams`` k-grams, else None."""

    def __init__(self, settings: WatcherSettings) -> None:
        self.s = settings
        self._carry: list[str] = []  # the last k-1 words of the previous update
        self._old: set[int] = set()
        self._new: set[int] = set()
        self._window: deque[tuple[int, int]] = deque(maxlen=settings.share_window_chunks)
        self._grams = 0
        self._repeated = 0

    def update(self, new_words: list[str]) -> float | None:
        k = self.s.share_gram_words
        words = self._carry + new_words
        self._carry = words[-(k - 1):]
        # Distinct k-grams per update: set operations run at C speed, a loop per k-gram would not.
        grams = set(map(hash, zip(*(words[i:] for i in range(k)), strict=False)))
        repeated = len(grams & self._new) + len((grams - self._new) & self._old)
        self._new |= grams
        if len(self._new) >= self.s.share_history_grams:
            self._old, self._new = self._new, set()
        if len(self._window) == self._window.maxlen:
            gone_grams, gone_repeated = self._window[0]
            self._grams -= gone_grams
            self._repeated -= gone_repeated
        self._window.append((len(grams), repeated))
        self._grams += len(grams)
        self._repeated += repeated
        if self._grams < self.s.share_min_grams:
            return None
        return self._repeated / self._grams


_REP_BITS = 8  # a shingle's entry: (word index << _REP_BITS) | repetition (capped)
_REP_MAX = (1 << _REP_BITS) - 1


class _CycleRepeats:
    """Detector 4: how many times in a row the recent passage has been written. ``update`` takes
    a batch of words and says whether the passage of the last ``cycle_passage_words`` shingles has
    been written ``cycle_repeats`` times. With ``record`` every shingle's repetition is appended to
    it (``repetition_peak`` reads them; the bench and the tests measure the margin so)."""

    def __init__(self, settings: WatcherSettings, record: list[int] | None = None) -> None:
        s = settings
        self._k = s.cycle_gram_words
        self._repeats = s.cycle_repeats
        self._min_gap = s.cycle_min_gap_words
        self._max_gap = s.cycle_max_gap_words
        self._need = math.ceil(s.cycle_match * s.cycle_passage_words)
        self._carry: list[str] = []
        self._seen: dict[int, int] = {}  # shingle hash -> (word index << 8) | repetition
        self._n = 0  # shingles so far
        self._width = s.cycle_passage_words
        self._hits: deque[int] = deque()  # indexes of recent shingles at cycle_repeats or more
        self._prune_at = 2 * s.cycle_max_gap_words
        self._record = record
        self.period_words = 0  # the gap of the shingle that decided

    def update(self, new_words: list[str]) -> bool:
        k = self._k
        # Numbers dropped: a passage whose numbers change each time is still the same passage.
        words = self._carry + list(filterfalse(str.isdigit, new_words))
        self._carry = words[-(k - 1):] if k > 1 else []
        seen, hits, record = self._seen, self._hits, self._record
        min_gap, max_gap, repeats, need = self._min_gap, self._max_gap, self._repeats, self._need
        width = self._width
        i = self._n
        fired = False
        for h in map(hash, zip(*(words[j:] for j in range(k)), strict=False)):
            i += 1
            entry = seen.get(h)
            if entry is None:
                rep = 1
            else:
                gap = i - (entry >> _REP_BITS)
                rep = entry & _REP_MAX
                if gap > max_gap:
                    rep = 1
                elif gap >= min_gap and rep < _REP_MAX:
                    rep += 1
                    self.period_words = gap
            seen[h] = (i << _REP_BITS) | rep
            if record is not None:
                record.append(rep)
            if rep >= repeats:  # rare in normal text: only then is the window looked at
                hits.append(i)
                while hits[0] <= i - width:
                    hits.popleft()
                if len(hits) >= need:
                    fired = True
                    break
        self._n = i
        if i >= self._prune_at:  # forget what could only start a new count
            oldest = (i - max_gap) << _REP_BITS
            self._seen = {h: e for h, e in seen.items() if e >= oldest}
            self._prune_at = i + max_gap
        return fired


def repetition_peak(text: str, settings: WatcherSettings) -> int:
    """The most repetitions detector 4 sees in ``text``: the largest R for which at least
    ``cycle_match`` of some ``cycle_passage_words`` consecutive shingles reach repetition R
    (the detector fires when this reaches ``cycle_repeats``). The margin of the threshold."""
    record: list[int] = []
    quiet = settings.model_copy(update={"cycle_repeats": _REP_MAX + 1})
    _CycleRepeats(quiet, record).update(words_of(text))
    width = settings.cycle_passage_words
    need = math.ceil(settings.cycle_match * width)
    peak = 0
    while True:  # few rounds: repetitions of normal text stay small
        level = peak + 1
        count = 0
        found = False
        for i, rep in enumerate(record):
            count += rep >= level
            if i >= width:
                count -= record[i - width] >= level
            if count >= need:
                found = True
                break
        if not found:
            return peak
        peak = level
