"""Deployment profiles for the simulator, and the decode-throughput curve they carry.

A profile is the set of numbers that make the simulator behave like one vLLM deployment. The
default, ``qwen3-next-tp2pp2``, is the server of docs/deployment.md: Qwen3-Next-80B-A3B-Thinking
over TP=2 x PP=2, ``--max-num-seqs 32``, ``--max-model-len 262144``,
``--max-num-batched-tokens 2048``, a KV pool of about 530,000 tokens in 1,072-token blocks,
``--kv-cache-dtype fp8``, ``--enable-prefix-caching``, ``--gpu-memory-utilization 0.92`` (the last
three only show in ``vllm:cache_config_info``).

Decode throughput
-----------------
The deployment's aggregate output rate (sum over all running requests), measured by concurrency:
1: 81, 4: 216, 8: 334, 16: 464, 24: 544 tok/s. ``DecodeCurve.aggregate(n)`` interpolates these
points piecewise linearly, goes through (0, 0) below the first point, and extrapolates past the
last point with the slope of the last segment (10 tok/s per extra sequence: 32 running give 624).
The measured curve is still rising linearly between 16 and 24, so the last slope is the most
honest guess for 24..32; a saturating fit would only lower 32 by a few percent.

In one engine step every decoding sequence emits one token, so a decode-only step with ``n``
sequences lasts ``n / aggregate(n)`` seconds and each sequence sees ``aggregate(n) / n`` tok/s.

Prefill
-------
A step also carries up to ``max_num_batched_tokens`` prompt tokens (chunked prefill); each costs
``1 / prefill_tokens_per_s`` seconds on top of the decode part. With 8,000 tok/s a 2,048-token chunk
adds 0.256 s to the step, so a 60K-token prompt takes about 7.5 s to prefill and, while it does,
every sequence decoding beside it drops from ~19 tok/s (32 running) to ~3.5 tok/s.

The ``tiny`` profile keeps the same curve with a small context and pool, for fast tests of
preemption and prompt-length errors.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

DEPLOYMENT_DECODE_POINTS: tuple[tuple[int, float], ...] = (
    (1, 81.0),
    (4, 216.0),
    (8, 334.0),
    (16, 464.0),
    (24, 544.0),
)


@dataclass(frozen=True)
class DecodeCurve:
    """Aggregate decode tok/s as a function of the number of decoding sequences."""

    points: tuple[tuple[int, float], ...] = DEPLOYMENT_DECODE_POINTS

    def aggregate(self, n: int) -> float:
        if n <= 0:
            return 0.0
        xs = [p[0] for p in self.points]
        if n <= xs[0]:
            return self.points[0][1] * n / xs[0]
        if n >= xs[-1]:
            (x0, y0), (x1, y1) = self.points[-2], self.points[-1]
            return y1 + (y1 - y0) / (x1 - x0) * (n - x1)
        i = bisect.bisect_right(xs, n)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def per_sequence(self, n: int) -> float:
        return self.aggregate(n) / n if n > 0 else 0.0

    def step_s(self, n: int) -> float:
        """Duration of one decode step (one token for each of ``n`` sequences)."""
        return n / self.aggregate(n) if n > 0 else 0.0


@dataclass(frozen=True)
class SimProfile:
    name: str
    served_model_names: tuple[str, ...] = ("local",)
    """vLLM's --served-model-name: the names requests may give; the first is the one responses and
    /metrics' model_name label carry."""
    max_num_seqs: int = 32
    max_model_len: int = 262_144
    kv_pool_tokens: int = 530_000
    block_tokens: int = 1_072
    max_num_batched_tokens: int = 2_048
    # vLLM's chunked-prefill limits, with vLLM's defaults (engine.py, step 2)
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    prefill_tokens_per_s: float = 8_000.0
    decode: DecodeCurve = field(default_factory=DecodeCurve)
    cache_dtype: str = "fp8"
    """--kv-cache-dtype, as /metrics publishes it in vllm:cache_config_info."""
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.92

    def long_prefill_threshold(self) -> int:
        """vLLM's ``--long-prefill-token-threshold``: when it is 0 and several partial prefills
        are allowed, vLLM takes 4% of ``max_model_len``; 0 means no threshold."""
        if self.long_prefill_token_threshold or self.max_num_partial_prefills <= 1:
            return self.long_prefill_token_threshold
        return int(0.04 * self.max_model_len)

    def with_overrides(self, **overrides: object) -> SimProfile:
        clean = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **clean)  # type: ignore[arg-type]


PROFILES: dict[str, SimProfile] = {
    "qwen3-next-tp2pp2": SimProfile(name="qwen3-next-tp2pp2"),
    "tiny": SimProfile(
        name="tiny",
        max_model_len=32_768,
        kv_pool_tokens=64 * 1_072,
    ),
}
DEFAULT_PROFILE = "qwen3-next-tp2pp2"


def get_profile(name: str) -> SimProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown sim profile {name!r}; known: {', '.join(PROFILES)}") from None
