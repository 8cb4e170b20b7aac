"""The KV block pool and the block-granular prefix cache.

Pool: ``kv_pool_tokens // block_tokens`` whole blocks (530,000 / 1,072 -> 494). A running sequence
holds ``ceil(computed_tokens / block_tokens)`` blocks, at least one; blocks are taken as prefill
chunks and decode steps need them and all come back when the sequence finishes, is aborted or is
preempted. Blocks shared through the prefix cache are counted once per sequence (vLLM would share
them); with the 32-sequence ceiling binding long before the pool, this only matters for
simulated long-prompt pile-ups, where it errs on the side of preempting a little early.

Prefix cache: a prompt's token ids are hashed per whole block, each hash chained on the previous
one, so a block hash names the block *and* everything before it. A request's ``cache_salt`` is
mixed into the first block's hash only (vLLM's extra keys of the block at token 0), so the whole
chain differs from the unsalted one and from every other salt's: a prompt cached under one salt
never hits under another, and requests without a salt share the unsalted chain. A lookup counts the leading
blocks whose hashes are cached, limited to ``(prompt_len - 1) // block_tokens`` blocks (vLLM never
serves the last prompt token from cache, and with 1,072-token blocks a prefix shorter than one
block never hits). Hashes enter the cache when a prompt's prefill completes and are evicted least
recently used beyond the pool's block count. ``queries`` and ``hits`` count tokens, like vLLM's
``prefix_cache_queries``/``prefix_cache_hits`` counters.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Reversible, Sequence
from typing import Any


def block_hashes(token_ids: Sequence[int], block_tokens: int, salt: str | None = None) -> list[int]:
    """Chained hash of every whole block of ``token_ids``; ``salt`` (a request's ``cache_salt``)
    is mixed into the first block's only, as vLLM adds it to that block's extra keys. A digest
    (BLAKE2b, 8 bytes), not Python's ``hash``: the same prompt hashes the same in every simulator
    process, so the blocks a request log names can be compared across servers (the routing
    benchmark's oracle, fleet/bench/routing.py)."""
    out: list[int] = []
    prev = b""
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(prev, digest_size=8)
        h.update(array("q", token_ids[start : start + block_tokens]).tobytes())
        if start == 0 and salt:
            h.update(b"\x00salt\x00" + salt.encode())
        prev = h.digest()
        out.append(int.from_bytes(prev, "big", signed=True))
    return out


def note_prompt(requests: Reversible[dict[str, Any]], rid: str, prompt_len: int, hashes: list[int]) -> None:
    """Add the prompt's length and block hashes to request ``rid``'s log entry (the newest few
    entries are searched: it was logged just before)."""
    for entry in itertools.islice(reversed(requests), 64):
        if entry["id"] == rid:
            entry["prompt_tokens"], entry["blocks"] = prompt_len, hashes
            return


class BlockPool:
    def __init__(self, pool_tokens: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.total = max(1, pool_tokens // block_tokens)
        self.used = 0

    @property
    def free(self) -> int:
        return self.total - self.used

    def blocks_for(self, tokens: int) -> int:
        return max(1, -(-tokens // self.block_tokens))

    def usage(self) -> float:
        return self.used / self.total


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def lookup(self, hashes: list[int], prompt_len: int) -> int:
        """Tokens served from cache for this prompt; updates the counters."""
        limit = min(len(hashes), (prompt_len - 1) // self.block_tokens)
        n = 0
        while n < limit and hashes[n] in self._lru:
            self._lru.move_to_end(hashes[n])
            n += 1
        hit = n * self.block_tokens
        self.queries += prompt_len
        self.hits += hit
        return hit

    def peek(self, hashes: list[int], prompt_len: int) -> int:
        """The tokens ``lookup`` would serve from cache, without counting or touching the LRU."""
        limit = min(len(hashes), (prompt_len - 1) // self.block_tokens)
        n = 0
        while n < limit and hashes[n] in self._lru:
            n += 1
        return n * self.block_tokens

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear_counters(self) -> None:
        self.queries = 0
        self.hits = 0
