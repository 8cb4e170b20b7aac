"""KV cache arithmetic for one model over parallel layouts: what ``fleet plan`` prints. Pure: no I/O.

Per GPU of a layout ``tp`` x ``pp`` (docs/sizing.md walks through the deployment's numbers):

- pipeline stages split the layers as vLLM does (evenly; a remainder goes to the stages before the
  last); the planner takes the stage holding the most full-attention layers, the tightest GPU;
- KV heads per GPU are ``max(1, kv_heads // tp)``: past ``tp == kv_heads`` every GPU keeps one
  whole head, so the cache is replicated ``tp / kv_heads`` times;
- KV bytes per token = full-attention layers x 2 (K and V) x KV heads x head_dim x dtype bytes;
- hybrid models (Gated DeltaNet linear attention, as in Qwen3-Next) keep a fixed state per
  sequence and layer. vLLM raises the attention block until one layer's attention page holds at
  least one state page: ``block = 16 * ceil(state_page / (16 * attention bytes per token and
  layer))`` (16: the smallest block every attention kernel takes), then pads the state page to
  the attention page. The state page is derived from the config for Gated DeltaNet; for other
  state layers (Mamba, ...) it must be given (``state_page_bytes``);
- the pool is the memory left for KV (GPU memory x utilisation - this GPU's share of the weights
  - the runtime's own overhead, or the "Available KV cache memory" of a vLLM start log) in whole
  pages, a page being one block over all the attention layers of the GPU.

Failure cases: a config without the fields this needs, an unknown dtype or a malformed layout
raise ``InputInvalid`` (E_INPUT_INVALID) naming the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleet.core.errors import InputInvalid

GIB = 1 << 30
# vLLM rounds the hybrid attention block to a multiple of this (the FlashAttention/FlashInfer minimum).
KERNEL_BLOCK_ALIGN = 16
# The block size vLLM uses for models without state layers.
DEFAULT_BLOCK_TOKENS = 16
DTYPE_BYTES = {
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
    "float16": 2, "half": 2, "bfloat16": 2, "float32": 4, "float": 4,
}
_LAYOUT = re.compile(r"^(?:tp(\d+))?(?:pp(\d+))?$")


def dtype_bytes(name: str, model_dtype: str) -> int:
    """Bytes of one element of ``name``; "auto" means the model's own dtype, as in vLLM."""
    resolved = model_dtype if name == "auto" else name
    try:
        return DTYPE_BYTES[resolved]
    except KeyError:
        raise InputInvalid(f"unknown dtype {resolved!r}; known: auto, {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``tp4``, ``tp2pp2``, ``pp2``."""
        match = _LAYOUT.match(text.strip().lower())
        if not text.strip() or match is None:
            raise InputInvalid(f"layout {text!r}: write it as tp<N>, pp<N> or tp<N>pp<M>, e.g. tp2pp2")
        tp, pp = int(match.group(1) or 1), int(match.group(2) or 1)
        if tp < 1 or pp < 1:
            raise InputInvalid(f"layout {text!r}: tp and pp must be at least 1")
        return cls(tp, pp)

    def __str__(self) -> str:
        return f"tp{self.tp}pp{self.pp}" if self.pp > 1 else f"tp{self.tp}"


@dataclass(frozen=True)
class DeltaNet:
    """A Gated DeltaNet layer's shape (``linear_*`` keys of the config)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def state_elements(self, tp: int) -> int:
        """Elements of one layer's state on one GPU: the convolution window over Q, K and V plus
        the recurrent state, both split by tensor parallelism (vLLM's gated_delta_net_state_shape)."""
        conv_dim = self.key_head_dim * self.key_heads * 2 + self.value_head_dim * self.value_heads
        conv = (conv_dim // tp) * (self.conv_kernel - 1)
        recurrent = (self.value_heads // tp) * self.key_head_dim * self.value_head_dim
        return conv + recurrent


@dataclass(frozen=True)
class ModelShape:
    layers: int
    full_attention: tuple[int, ...]
    """Indices of the full-attention layers; the others keep a state instead."""
    kv_heads: int
    head_dim: int
    dtype: str
    max_position_embeddings: int | None
    delta_net: DeltaNet | None

    @property
    def hybrid(self) -> bool:
        return len(self.full_attention) < self.layers


def _need(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputInvalid(f"config.json: {key} must be a positive integer (got {value!r})")
    return value


def _full_attention_layers(cfg: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    types = cfg.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers:
            raise InputInvalid(f"config.json: layer_types has {len(types)} entries for {layers} layers")
        return tuple(i for i, kind in enumerate(types) if kind in ("full_attention", "attention"))
    if "full_attention_interval" in cfg:
        interval = _need(cfg, "full_attention_interval")
        # Qwen3-Next: every interval-th layer (counting from 1) is full attention
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    return tuple(range(layers))


def _delta_net(cfg: Mapping[str, Any]) -> DeltaNet | None:
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim")
    if not all(key in cfg for key in keys):
        return None
    return DeltaNet(*(_need(cfg, key) for key in keys))


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """The parts of a Hugging Face ``config.json`` the arithmetic needs."""
    cfg = config.get("text_config", config)
    if not isinstance(cfg, Mapping):
        raise InputInvalid("config.json: text_config must be an object")
    layers = _need(cfg, "num_hidden_layers")
    heads = _need(cfg, "num_attention_heads")
    kv_heads = _need(cfg, "num_key_value_heads") if "num_key_value_heads" in cfg else heads
    head_dim = _need(cfg, "head_dim") if cfg.get("head_dim") else _need(cfg, "hidden_size") // heads
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    max_pos = cfg.get("max_position_embeddings")
    return ModelShape(
        layers=layers,
        full_attention=_full_attention_layers(cfg, layers),
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        max_position_embeddings=max_pos if isinstance(max_pos, int) else None,
        delta_net=_delta_net(cfg),
    )


def stage_layers(layers: int, pp: int) -> list[range]:
    """The layer ranges of each pipeline stage (vLLM's get_pp_indices without overrides)."""
    sizes = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class PlanInputs:
    kv_cache_dtype: str = "auto"
    state_dtype: str = "auto"
    """vLLM's --mamba-cache-dtype: the state layers' dtype ("auto": the model's)."""
    gpu_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.92
    weights_bytes: int = 0
    """All the weights; each GPU holds 1 / (tp x pp) of them."""
    overhead_bytes: int = 0
    """Activations at the profiling peak, CUDA graphs and allocations outside torch, per GPU."""
    kv_memory_bytes: int | None = None
    """The start log's "Available KV cache memory" per GPU; replaces the estimate above."""
    state_page_bytes: int | None = None
    """One state layer's page per sequence and GPU, for state layers whose formula is not known."""
    max_model_len: int = 262_144
    max_num_seqs: int = 32


@dataclass(frozen=True)
class LayoutPlan:
    layout: Layout
    full_layers: int
    """Full-attention layers on the tightest GPU."""
    state_layers: int
    kv_heads: int
    """KV heads per GPU."""
    replication: float
    """How many GPUs hold a copy of each KV head (1 = none wasted)."""
    kv_bytes_per_token: int
    state_page_bytes: int | None
    """One state layer's page per sequence (before padding); None for models without state."""
    state_bytes_per_sequence: int
    block_tokens: int
    page_bytes: int
    """One block over every attention layer of the GPU."""
    kv_memory_bytes: int
    pool_blocks: int
    pool_tokens: int
    max_model_len: int

    @property
    def full_length_concurrency(self) -> float:
        return self.pool_tokens / self.max_model_len

    def blocks_for(self, tokens: int) -> int:
        """Whole blocks one running sequence of ``tokens`` holds: at least one."""
        return max(1, math.ceil(tokens / self.block_tokens))

    def take(self, requests: int, tokens: int) -> tuple[int, float]:
        """Tokens of pool that ``requests`` concurrent sequences of ``tokens`` hold, and the share."""
        held = requests * self.blocks_for(tokens) * self.block_tokens
        return held, held / self.pool_tokens if self.pool_tokens else math.inf


def _state_page(shape: ModelShape, layout: Layout, inputs: PlanInputs) -> int | None:
    if not shape.hybrid:
        return None
    if inputs.state_page_bytes is not None:
        return inputs.state_page_bytes
    if shape.delta_net is None:
        raise InputInvalid("config.json describes state layers the planner has no formula for; "
                           "give their page size per GPU (--state-page-bytes, from vLLM's start log)")
    return shape.delta_net.state_elements(layout.tp) * dtype_bytes(inputs.state_dtype, shape.dtype)


def _kv_memory(layout: Layout, inputs: PlanInputs) -> int:
    if inputs.kv_memory_bytes is not None:
        return inputs.kv_memory_bytes
    usable = inputs.gpu_memory_bytes * inputs.gpu_memory_utilization
    left = usable - inputs.weights_bytes / (layout.tp * layout.pp) - inputs.overhead_bytes
    return max(0, int(left))


def plan_layout(shape: ModelShape, layout: Layout, inputs: PlanInputs) -> LayoutPlan:
    if shape.kv_heads % layout.tp and layout.tp % shape.kv_heads:
        raise InputInvalid(f"{layout}: tp={layout.tp} neither divides nor is a multiple of "
                           f"{shape.kv_heads} KV heads (vLLM refuses such a layout)")
    stages = stage_layers(shape.layers, layout.pp)
    full = set(shape.full_attention)
    full_layers = max(sum(1 for i in stage if i in full) for stage in stages)
    state_layers = max(sum(1 for i in stage if i not in full) for stage in stages)
    kv_heads = max(1, shape.kv_heads // layout.tp)
    per_layer_token = 2 * kv_heads * shape.head_dim * dtype_bytes(inputs.kv_cache_dtype, shape.dtype)
    state_page = _state_page(shape, layout, inputs)
    block = DEFAULT_BLOCK_TOKENS
    if state_page is not None:
        align = KERNEL_BLOCK_ALIGN * per_layer_token
        block = KERNEL_BLOCK_ALIGN * math.ceil(state_page / align)
    kv_per_token = full_layers * per_layer_token
    page = block * kv_per_token
    memory = _kv_memory(layout, inputs)
    blocks = memory // page if page else 0
    return LayoutPlan(
        layout=layout,
        full_layers=full_layers,
        state_layers=state_layers if state_page is not None else 0,
        kv_heads=kv_heads,
        replication=max(1.0, layout.tp / shape.kv_heads),
        kv_bytes_per_token=kv_per_token,
        state_page_bytes=state_page,
        state_bytes_per_sequence=(state_page or 0) * state_layers,
        block_tokens=block,
        page_bytes=page,
        kv_memory_bytes=memory,
        pool_blocks=blocks,
        pool_tokens=blocks * block,
        max_model_len=inputs.max_model_len,
    )


def recommend(plan: LayoutPlan, max_num_seqs: int) -> dict[str, int]:
    """The ``[backend]`` settings this layout calls for (docs/sizing.md says why each)."""
    long_prompt = max(plan.block_tokens, plan.max_model_len // 8)
    return {
        # every running sequence holds at least one block
        "max_num_seqs": max(1, min(max_num_seqs, plan.pool_blocks)),
        "max_model_len": plan.max_model_len,
        "kv_pool_tokens": plan.pool_tokens,
        "block_tokens": plan.block_tokens,
        "long_prompt_tokens": long_prompt,
        # that many sequences can each grow to max_model_len without preempting one another
        "max_long": max(1, plan.pool_tokens // plan.max_model_len),
    }
