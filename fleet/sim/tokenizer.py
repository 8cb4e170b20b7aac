"""A deterministic, reversible stand-in for the model's BPE tokenizer.

The simulator needs token counts that behave like the real ones (the deployment's 3.94 characters
per token on average, docs/deployment.md) without shipping a 150K-entry vocabulary. The scheme:

1. Split the text into pieces with one regular expression, in this order of preference:
   special tokens (``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``</think>``, ``<tool_call>``,
   ...), a Latin word with its optional leading space, a run of up to 3 digits, a run of CJK
   characters (kanji, kana, the iteration mark), a run of punctuation with its optional leading
   space, a run of whitespace, any other single character.
2. Cut a piece longer than its class's size into ``ceil(len / size)`` nearly equal tokens: Latin
   words 6 characters (the leading space counts, so " the" and " model" are one token and
   " simulator" two), CJK runs 5.75, punctuation runs 3, whitespace runs 4. Special tokens, digit
   runs and other characters are one token each.

Measured on the prose samples in ``tests/support/sim_samples.py``: English 4.02 characters per token,
Japanese 3.95, a JSON tool schema 3.44 (BPE merges JSON punctuation less well than prose, as here).

Token ids: a piece's id is a 31-bit BLAKE2 digest of its text, so the same piece has the same id in
every process. The tokenizer keeps an id -> piece table so that ``decode`` inverts ``encode``; on the
rare digest collision the next free id is taken. The table holds the ``max_pieces`` most recently
used pieces (least recently used first out), because generated prose and client prompts bring new
pieces for the whole life of a long-running simulator; an id whose piece has left the table decodes
to U+FFFD, as an id this process never produced does. Special tokens have fixed ids (151643 + n, as
in the Qwen vocabulary) and never leave the table.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Iterable

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
SPECIAL_BASE_ID = 151_643
LATIN_CHUNK = 6.0
CJK_CHUNK = 5.75
SPACE_CHUNK = 4.0
PUNCT_CHUNK = 3.0
MAX_PIECES = 200_000  # about 30 MB of table; more distinct pieces than a long prompt mix brings

_CJK = "\u3005\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
_PIECE_RE = re.compile(
    "(?P<special>" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")"
    r"|(?P<latin> ?[A-Za-z\u00c0-\u024f]+)"
    r"|(?P<digit>[0-9]{1,3})"
    f"|(?P<cjk>[{_CJK}]+)"
    r"|(?P<punct> ?[^\w\s]+)"
    r"|(?P<space>\s+)"
    r"|(?P<other>.)",
    re.DOTALL,
)
_CHUNK = {"latin": LATIN_CHUNK, "cjk": CJK_CHUNK, "space": SPACE_CHUNK, "punct": PUNCT_CHUNK}


def split_pieces(text: str) -> list[str]:
    """Text -> token pieces (strings whose concatenation is ``text``)."""
    out: list[str] = []
    append = out.append
    for m in _PIECE_RE.finditer(text):
        piece = m.group()
        size = _CHUNK.get(m.lastgroup or "")
        if size is None or len(piece) <= size:
            append(piece)
        else:
            out.extend(_cut(piece, math.ceil(len(piece) / size)))
    return out


def _cut(piece: str, parts: int) -> list[str]:
    """Cut ``piece`` into ``parts`` nearly equal slices (longer ones first)."""
    base, extra = divmod(len(piece), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(piece[start:end])
        start = end
    return out


class Tokenizer:
    """Reversible piece <-> id mapping over ``split_pieces``. Not thread-safe (one event loop)."""

    def __init__(self, max_pieces: int = MAX_PIECES) -> None:
        if max_pieces < 1:
            raise ValueError("max_pieces must be at least 1")
        self.max_pieces = max_pieces
        self._ids: OrderedDict[str, int] = OrderedDict()
        self._pieces: dict[int, str] = {}
        self._special = {tok: SPECIAL_BASE_ID + n for n, tok in enumerate(SPECIAL_TOKENS)}
        for tok, token_id in self._special.items():
            self._pieces[token_id] = tok

    def __len__(self) -> int:
        """Pieces in the table, special tokens included."""
        return len(self._ids) + len(self._special)

    def piece_id(self, piece: str) -> int:
        token_id = self._special.get(piece)
        if token_id is not None:
            return token_id
        token_id = self._ids.get(piece)
        if token_id is not None:
            self._ids.move_to_end(piece)
            return token_id
        digest = hashlib.blake2b(piece.encode(), digest_size=4).digest()
        token_id = int.from_bytes(digest, "big") & 0x7FFFFFFF
        while token_id in self._pieces or SPECIAL_BASE_ID <= token_id < SPECIAL_BASE_ID + 64:
            token_id = (token_id + 1) & 0x7FFFFFFF
        if len(self._ids) >= self.max_pieces:
            _, old_id = self._ids.popitem(last=False)
            del self._pieces[old_id]
        self._ids[piece] = token_id
        self._pieces[token_id] = piece
        return token_id

    def encode(self, text: str) -> list[int]:
        piece_id = self.piece_id
        return [piece_id(p) for p in split_pieces(text)]

    def decode(self, ids: Iterable[int]) -> str:
        """Unknown ids (never produced by this process) decode to U+FFFD."""
        get = self._pieces.get
        return "".join(get(i, "\ufffd") for i in ids)

    @staticmethod
    def count(text: str) -> int:
        return len(split_pieces(text))
