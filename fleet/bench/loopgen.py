"""Seeded generators of looping reasoning for the loop watcher's tests and ``fleet bench loops``.

Template loops, in English and Japanese (``generate_loops``): a normal lead (a prefix of a real
trace when one is given, else generated prose) followed by a template loop: each cycle writes 1 - 5
paragraphs drawn from the loop's own 2 - 4 templates, each with its slots filled at random (the
swapped nouns), sometimes with a filler sentence, so consecutive paragraphs are never exact repeats
and the period drifts between a few hundred and a few thousand characters - the shape of the real
loops the watcher missed.

Short capped loops (``generate_short_loops``, issue 28): a small thinking model whose answers are
capped at a few thousand tokens falls into a cycle a few hundred tokens in and writes one passage of
40 - 250 words again and again until the cap. The lead is a real trace's first 200 - 1,000 words,
the passage the same trace's next 40 - 250 words, repeated until 4,096 tokens verbatim or with one
kind of small edit (``SHORT_EDITS``: numbers that change, "Wait," restarts, a new sentence between
repetitions), with its paragraph breaks or run on in one paragraph.

``onset_chars`` is where the loop begins: a verdict before it is a false alarm.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_EN_TEMPLATES = (
    "Wait, perhaps it's a problem involving {noun}. If that's the case, I would need the {thing} "
    "to go any further. But without the {thing}, I can't {verb}.",
    "Alternatively, maybe {sym} stands for the {thing} in a {noun} setting, but without knowing "
    "the {thing2} or the {thing3}, I can't {verb}.",
    "Hmm, another angle: in some contexts {sym} is the result of a {noun} problem. Still, the "
    "question gives no {thing}, so there is no way to {verb}.",
    "Let me think again. Could {sym} be related to {noun}? Then I would use the {thing} and the "
    "{thing2}, but neither is given, so I can't {verb} that way either.",
    "Maybe the problem assumes a standard {noun} where the {thing} is known. Even then, the "
    "{thing2} is missing, and without it I can't {verb}.",
    "Wait, is it possible that the {thing} was meant to be given earlier? If it were, I could "
    "{verb} using {noun}, but as it stands I don't have it.",
)
_EN_SLOTS = {
    "noun": ("geometry", "probability", "kinematics", "interest rates", "thermodynamics", "circuits",
             "combinatorics", "number theory", "optics", "queueing", "population growth", "fluids",
             "graph coloring", "statistics", "chemistry", "orbital mechanics", "game theory",
             "linear programming", "signal processing", "cryptography", "acoustics", "economics"),
    "thing": ("radius", "initial velocity", "total count", "base price", "time interval", "voltage",
              "sample size", "mass", "temperature", "interest rate", "side length", "load factor",
              "angle", "density", "starting amount", "capacity", "frequency", "distance"),
    "verb": ("compute it", "find the value", "solve for it", "determine the answer",
             "get a number", "finish the calculation", "pin it down", "work it out"),
    "sym": ("V", "x", "T", "the quantity", "the unknown", "N", "k", "the expression"),
}
_EN_FILLER = (
    "I keep coming back to the same issue.",
    "This is getting complicated.",
    "Let me try to recall similar problems.",
    "I'm not sure that helps.",
    "Hmm.",
)

_JA_TEMPLATES = (
    "待てよ、もしかすると{noun}に関する問題かもしれない。そうだとすれば{thing}が必要だ。"
    "しかし{thing}が分からないので、{verb}ことができない。",
    "あるいは、{sym}は{noun}の文脈での{thing}を表しているのかもしれない。でも{thing2}も"
    "{thing3}も与えられていないので、{verb}ことはできない。",
    "別の見方をすると、{sym}は{noun}の問題の結果かもしれない。それでも問題文には{thing}が"
    "ないので、{verb}方法がない。",
    "もう一度考えてみよう。{sym}は{noun}と関係があるのだろうか。それなら{thing}と{thing2}を"
    "使うはずだが、どちらも与えられていないので、やはり{verb}ことができない。",
    "問題は{thing}が既知の標準的な{noun}を前提にしているのかもしれない。それでも{thing2}が"
    "欠けているので、{verb}ことはできない。",
)
_JA_SLOTS = {
    "noun": ("幾何学", "確率", "運動学", "金利", "熱力学", "電気回路", "組合せ論", "整数論", "光学",
             "待ち行列", "人口増加", "流体", "統計", "化学", "軌道力学", "ゲーム理論", "経済学"),
    "thing": ("半径", "初速度", "総数", "基本価格", "時間間隔", "電圧", "標本の大きさ", "質量", "温度",
              "利率", "辺の長さ", "角度", "密度", "初期量", "容量", "周波数", "距離"),
    "verb": ("計算する", "値を求める", "解く", "答えを決める", "数値を出す", "計算を終える"),
    "sym": ("V", "x", "T", "その量", "未知数", "N", "k", "その式"),
}
_JA_FILLER = (
    "同じところに戻ってきてしまう。",
    "だんだん複雑になってきた。",
    "似た問題を思い出してみよう。",
    "うーん。",
)
_JA_LEAD = (
    "まず問題文を整理する。{noun}の問題で、{thing}と{thing2}の関係を使うはずだ。",
    "{thing}を{n}とおくと、{thing2}は{m}になる。これを式に代入して{verb}。",
    "ここで{n}と{m}を足すと{s}になるので、{thing}は{s}だと考えられる。",
    "念のため検算する。{n}に{m}を掛けると{p}になり、{thing2}の条件と合う。",
    "次に{noun}の公式を思い出す。{thing}は{thing2}に比例するので、比を使えばよい。",
    "条件を一つずつ確かめる。{thing}が{n}のとき、{thing2}は{m}以下でなければならない。",
)
_EN_LEAD_WORDS = ("the", "value", "of", "each", "step", "follows", "from", "previous", "so", "we",
                  "check", "whether", "total", "count", "limit", "result", "holds", "because",
                  "case", "term", "sum", "equation", "gives", "then", "factor", "side", "both")


@dataclass(frozen=True)
class GeneratedLoop:
    text: str
    onset_chars: int  # where the loop begins; a verdict before it is a false alarm
    language: str  # "en" | "ja"
    templates: int  # templates the loop cycles through


def _fill(rng: random.Random, template: str, slots: dict[str, tuple[str, ...]]) -> str:
    things = rng.sample(slots["thing"], 3)
    return template.format(noun=rng.choice(slots["noun"]), thing=things[0], thing2=things[1],
                           thing3=things[2], verb=rng.choice(slots["verb"]),
                           sym=rng.choice(slots["sym"]))


def _loop(rng: random.Random, language: str, min_chars: int) -> tuple[str, int]:
    templates, slots, filler = ((_EN_TEMPLATES, _EN_SLOTS, _EN_FILLER) if language == "en"
                                else (_JA_TEMPLATES, _JA_SLOTS, _JA_FILLER))
    chosen = rng.sample(templates, rng.randint(2, 4))
    paragraphs: list[str] = []
    size = 0
    while size < min_chars:
        for _ in range(rng.randint(1, 5)):  # one cycle: the drifting period
            paragraph = _fill(rng, rng.choice(chosen), slots)
            if rng.random() < 0.3:
                paragraph = f"{paragraph} {rng.choice(filler)}"
            paragraphs.append(paragraph)
            size += len(paragraph) + 2
    return "\n\n".join(paragraphs), len(chosen)


def _lead_en(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        sentences = [" ".join(rng.choice(_EN_LEAD_WORDS) for _ in range(rng.randint(8, 20)))
                     + f" {rng.randint(0, 999)}." for _ in range(rng.randint(3, 6))]
        out.append(" ".join(sentences).capitalize())
        size += len(out[-1]) + 2
    return "\n\n".join(out)


def _lead_ja(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        n, m = rng.randint(2, 999), rng.randint(2, 999)
        sentence = rng.choice(_JA_LEAD).format(
            noun=rng.choice(_JA_SLOTS["noun"]), thing=rng.choice(_JA_SLOTS["thing"]),
            thing2=rng.choice(_JA_SLOTS["thing"]), verb=rng.choice(("求める", "確かめる", "整理する")),
            n=n, m=m, s=n + m, p=n * m)
        out.append(sentence if rng.random() < 0.8 else sentence + "\n\n")
        size += len(sentence)
    return "".join(out)


def generated_lead(rng: random.Random, language: str, chars: int) -> str:
    """Normal-looking generated reasoning of about ``chars`` characters ("en" or "ja"): the leads
    used when there is no corpus (and always in Japanese)."""
    return _lead_en(rng, chars) if language == "en" else _lead_ja(rng, chars)


def generate_loops(seed: int, count: int, leads: list[str] | None = None,
                   loop_chars: int = 30_000) -> list[GeneratedLoop]:
    """``count`` traces, alternately English and Japanese. English leads are prefixes (2,000 -
    30,000 characters, cut at a paragraph break) of ``leads`` when given, so loops start late in
    real long traces; otherwise, and in Japanese, the lead is generated."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        language = "en" if i % 2 == 0 else "ja"
        lead_chars = rng.randint(2_000, 30_000)
        if language == "en" and leads:
            source = rng.choice(leads)
            cut = source.rfind("\n\n", 0, lead_chars)
            lead = source[: cut if cut > 0 else lead_chars]
        elif language == "en":
            lead = _lead_en(rng, lead_chars)
        else:
            lead = _lead_ja(rng, lead_chars)
        lead = lead.rstrip() + "\n\n"
        loop, templates = _loop(rng, language, loop_chars)
        out.append(GeneratedLoop(lead + loop, len(lead), language, templates))
    return out


# -- short capped loops (see the module's docstring) ---------------------------------------------

SHORT_EDITS = ("verbatim", "numbers", "restarts", "sentence")
"""verbatim: the passage again and again; numbers: each repetition redraws about half of its
numbers; restarts: a repetition may break off and start again with "Wait," (or another opener);
sentence: one new sentence of the trace's own continuation between two repetitions."""
_WORD_SPAN = re.compile(r"\S+")
_NUMBER = re.compile(r"\d+")
_OPENERS = ("Wait, ", "Hmm, ", "So ", "Wait, let me re-check. ", "Let me verify again. ",
            "Okay, ", "Wait, no. ")


@dataclass(frozen=True)
class ShortLoop:
    text: str  # ends at the cap
    onset_chars: int  # where the first repetition begins; a verdict before it is a false alarm
    cycle_words: int  # words per repetition, whitespace-separated (the new sentence included)
    edit: str  # one of SHORT_EDITS
    run_on: bool  # the loop's line breaks flattened: one endless paragraph
    repetitions: int  # times the passage begins before the cap


def _redraw_numbers(rng: random.Random, passage: str) -> str:
    def redraw(m: re.Match[str]) -> str:
        if rng.random() < 0.5 or len(m.group()) > 6:
            return m.group()
        return str(max(0, int(m.group()) + rng.choice((-3, -2, -1, 1, 2, 3, 5, 10))))

    return _NUMBER.sub(redraw, passage)


def _short_source(rng: random.Random, leads: list[str], edit: str) -> tuple[str, list[int], int, int]:
    """A source text with its word starts, an onset word and a cycle length that fit it."""
    for _ in range(1000):
        onset, cycle = rng.randint(200, 1000), rng.randint(40, 250)
        text = rng.choice(leads) if leads else _lead_en(rng, 12_000)
        starts = [m.start() for m in _WORD_SPAN.finditer(text)]
        if len(starts) < onset + cycle + 200:  # room for the new sentences of "sentence"
            continue
        passage = text[starts[onset]:starts[onset + cycle]]
        if edit == "numbers" and len(_NUMBER.findall(passage)) < 2:
            continue
        return text, starts, onset, cycle
    raise ValueError("no source text long enough for a short loop")


def short_loop(rng: random.Random, leads: list[str], edit: str, run_on: bool,
               cap_chars: int) -> ShortLoop:
    text, starts, onset, cycle = _short_source(rng, leads, edit)
    lead = text[:starts[onset]]
    fresh = onset + cycle  # the trace's own continuation: where new sentences come from
    if edit == "sentence":  # a new sentence and a shorter passage make one cycle
        bridge = rng.randint(8, max(8, min(30, cycle // 3)))
        passage = text[starts[onset]:starts[onset + cycle - bridge]]
    else:
        bridge = 0
        passage = text[starts[onset]:starts[onset + cycle]]
    flat = (lambda t: re.sub(r"\s*\n\s*", " ", t)) if run_on else (lambda t: t)
    parts = [lead, flat(passage)]
    size = len(lead) + len(parts[-1])
    repetitions = 1
    while size < cap_chars:
        again = passage
        if edit == "numbers":
            again = _redraw_numbers(rng, passage)
        elif edit == "restarts":
            if rng.random() < 0.4:  # the previous repetition breaks off part way
                previous = parts[-1]
                words = [m.start() for m in _WORD_SPAN.finditer(previous)]
                cut = words[rng.randint(len(words) // 3, max(len(words) // 3, len(words) * 9 // 10))]
                size -= len(previous) - cut
                parts[-1] = previous[:cut].rstrip() + " "
            if rng.random() < 0.7:
                again = rng.choice(_OPENERS) + again[0].lower() + again[1:]
        elif edit == "sentence":
            n = rng.randint(max(4, bridge // 2), bridge * 3 // 2)
            if fresh + n >= len(starts):
                fresh = onset + cycle
            sentence = text[starts[fresh]:starts[fresh + n]]
            fresh += n
            parts.append(flat(sentence))
            size += len(parts[-1])
        parts.append(flat(again))
        size += len(parts[-1])
        repetitions += 1
    whole = "".join(parts)[:cap_chars]
    begun = repetitions - (1 if size - len(parts[-1]) >= cap_chars else 0)
    return ShortLoop(whole, len(lead), cycle, edit, run_on, begun)


def generate_short_loops(seed: int, count: int, leads: list[str] | None = None,
                         cap_tokens: int = 4096, chars_per_token: int = 4) -> list[ShortLoop]:
    """``count`` short loops capped at ``cap_tokens`` (``chars_per_token`` characters each), the
    edits of SHORT_EDITS in turn, every other four run on. Leads and passages come from ``leads``
    (the real normal traces); without them from generated prose."""
    rng = random.Random(seed)
    return [short_loop(rng, leads or [], SHORT_EDITS[i % len(SHORT_EDITS)], i // 4 % 2 == 1,
                       cap_tokens * chars_per_token) for i in range(count)]
