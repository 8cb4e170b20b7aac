"""``fleet plan``: the KV arithmetic of fleet/core/kvplan.py for one model over parallel layouts,
side by side, with the ``[backend]`` settings each calls for; ``--write`` puts them in fleet.toml and
``--server URL`` reads what a running vLLM says (schedulers/serverinfo.py) beside fleet.toml;
``--backends`` does that for every backend of the settings at its own url. Per backend: the entry
``--backend NAME`` names (of ``[[backends]]``, or ``[backend]``, named "default" unless it says
otherwise) is the one compared and written; the default is the entry with the server's url, else the
only one.

Failure cases: an unreadable or invalid config.json or safetensors index, a bad layout or dtype,
or a server that cannot be read print the message code and exit 2; a server that disagrees with
fleet.toml (its sizes, or the entry's model not among the server's names) exits 1. ``--write``
rewrites the ``[backend]`` table of the file, or its ``[[backends]]`` entry (keeping url, model,
api_key and the rest of the file as it is), and writes nothing if the result would not load.
"""

from __future__ import annotations

import json
import tempfile
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import httpx
import tomli_w
import typer
from rich.console import Console
from rich.table import Table

from fleet.core.config import BackendSettings, Settings, load_settings
from fleet.core.errors import FleetError, InputInvalid
from fleet.core.kvplan import GIB, Layout, LayoutPlan, PlanInputs, plan_layout, recommend, shape_from_config

console = Console()
err = Console(stderr=True)
MB = 1_000_000


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputInvalid(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise InputInvalid(f"{path}: expected a JSON object")
    return data


def weights_from_index(path: Path) -> int:
    """Bytes of all the weights: ``metadata.total_size`` of a ``model.safetensors.index.json``."""
    total = _read_json(path).get("metadata", {}).get("total_size")
    if not isinstance(total, int) or total <= 0:
        raise InputInvalid(f"{path}: no metadata.total_size (is it a model.safetensors.index.json?)")
    return total


def _kv_memory(values: list[float], layouts: list[Layout]) -> list[int | None]:
    if not values:
        return [None] * len(layouts)
    if len(values) == 1:
        return [int(values[0] * GIB)] * len(layouts)
    if len(values) != len(layouts):
        raise InputInvalid(f"--kv-memory-gib: give one value, or one per --layout ({len(layouts)})")
    return [int(v * GIB) for v in values]


def plan_table(plans: list[LayoutPlan], requests: int, request_tokens: int) -> Table:
    table = Table("", *(str(p.layout) for p in plans), title="KV cache per GPU (the tightest)")

    def row(name: str, fmt: Any) -> None:
        table.add_row(name, *(fmt(p) for p in plans))

    row("full-attention layers", lambda p: str(p.full_layers))
    row("KV heads (replication)", lambda p: f"{p.kv_heads} (x{p.replication:g})")
    row("KV bytes / token", lambda p: f"{p.kv_bytes_per_token:,}")
    if any(p.state_page_bytes for p in plans):
        row("state layers", lambda p: str(p.state_layers))
        row("state page / layer", lambda p: f"{p.state_page_bytes or 0:,} B")
        row("state / sequence", lambda p: f"{p.state_bytes_per_sequence / MB:.2f} MB")
    row("block (tokens)", lambda p: f"{p.block_tokens:,}")
    row("page (block x KV bytes)", lambda p: f"{p.page_bytes / MB:.2f} MB")
    row("memory for KV", lambda p: f"{p.kv_memory_bytes / GIB:.2f} GiB")
    row("pool (blocks)", lambda p: f"{p.pool_blocks:,}")
    row("pool (tokens)", lambda p: f"{p.pool_tokens:,}")
    row(f"full length ({plans[0].max_model_len:,})", lambda p: f"{p.full_length_concurrency:.2f}x")

    def take(p: LayoutPlan) -> str:
        held, share = p.take(requests, request_tokens)
        return f"{held:,} ({share:.0%})"

    row(f"{requests} x {request_tokens:,} tokens take", take)
    return table


def notes(plan: LayoutPlan) -> list[str]:
    out = []
    if plan.pool_tokens < plan.max_model_len:
        out.append(f"{plan.layout}: the pool ({plan.pool_tokens:,}) holds less than one max_model_len request; "
                   f"vLLM will not start with --max-model-len above {plan.pool_tokens:,}")
    return out


def settings_table(plans: list[LayoutPlan], max_num_seqs: int) -> Table:
    table = Table("[backend]", *(str(p.layout) for p in plans), title="recommended fleet settings")
    recs = [recommend(p, max_num_seqs) for p in plans]
    for key in recs[0]:
        table.add_row(key, *(str(r[key]) for r in recs))
    return table


def write_backend(path: Path, values: dict[str, int], name: str | None = None) -> None:
    """Put ``values`` in the ``[backend]`` table of ``path`` (created if missing), or in its
    ``[[backends]]`` entry named ``name`` (the only one when None). Only that table is rewritten
    (its comments go; the rest of the file stays as it is), and only if the result loads."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputInvalid(f"{path} is not valid TOML: {exc}") from exc
    if isinstance(data.get("backends"), list):
        index, entry = _entry_of(data["backends"], name, path)
        section = tomli_w.dumps({"backends": [{**entry, **values}]})
        headers = [i for i, line in enumerate(text.splitlines()) if line.strip() == "[[backends]]"]
        _write_checked(path, _replace_table(text, headers[index], section))
        return
    section = tomli_w.dumps({"backend": {**data.get("backend", {}), **values}})
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == "[backend]"), None)
    if start is None:
        text = text + ("\n" if text and not text.endswith("\n") else "") + section
    else:
        text = _replace_table(text, start, section)
    _write_checked(path, text)


def _entry_of(entries: list[Any], name: str | None, path: Path) -> tuple[int, dict[str, Any]]:
    if name is None and len(entries) == 1:
        return 0, entries[0]
    for index, entry in enumerate(entries):
        if isinstance(entry, dict) and entry.get("name", "default") == name:
            return index, entry
    raise InputInvalid(f"{path}: no [[backends]] entry named {name!r}: give --backend NAME")


def _replace_table(text: str, start: int, section: str) -> str:
    """``text`` with the table whose header is line ``start`` replaced by ``section``."""
    lines = text.splitlines(keepends=True)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    return "".join(lines[:start]) + section + ("\n" if end < len(lines) else "") + "".join(lines[end:])


def _write_checked(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", encoding="utf-8") as probe:
        probe.write(text)
        probe.flush()
        load_settings(probe.name, env={})
    path.write_text(text, encoding="utf-8")


def pick_backend(settings: Settings, name: str | None, url: str | None) -> BackendSettings:
    """The entry ``--backend NAME`` names; else the one at ``url``; else the only one."""
    entries = settings.backends
    if name is not None:
        named = [entry for entry in entries if entry.name == name]
        if not named:
            known = ", ".join(entry.name for entry in entries)
            raise InputInvalid(f"--backend: no backend named {name!r} (configured: {known})")
        return named[0]
    at_url = [entry for entry in entries if url is not None and entry.url.rstrip("/") == url.rstrip("/")]
    return (at_url or entries)[0]


def server_table(url: str, api_key: str, backend: BackendSettings) -> tuple[Table, list[str]]:
    from schedulers.serverinfo import PARTIAL_PREFILL_FLAGS, disagreements, model_disagreement, read_server

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=10.0) as http:
        info = read_server(http)
    title = f"{backend.name}: {url} ({info.model or 'unknown model'})"
    table = Table("", "server", "fleet.toml", title=title)
    table.add_row("served model names", ", ".join(info.served), ", ".join(backend.served_models))
    table.add_row("max_model_len", str(info.max_model_len), str(backend.max_model_len))
    table.add_row("block tokens", str(info.block_size), str(backend.block_tokens))
    table.add_row("GPU blocks", str(info.num_gpu_blocks), "")
    table.add_row("KV pool (tokens)", str(info.pool_tokens), str(backend.kv_pool_tokens))
    table.add_row("KV cache dtype", str(info.cache_dtype), "")
    table.add_row("prefix caching", str(info.prefix_caching), "")
    for name in PARTIAL_PREFILL_FLAGS:
        found = (info.partial_prefills or {}).get(name)
        table.add_row(name, "not exposed" if found is None else str(found), str(getattr(backend, name)))
    return table, model_disagreement(backend, info) + disagreements(backend, info)


def plan_command(
    config: Annotated[Path | None, typer.Argument(help="the model's config.json (Hugging Face)")] = None,
    layout: Annotated[list[str] | None, typer.Option(help="tp4, tp2pp2, ... (repeat to compare)")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help="vLLM's --kv-cache-dtype")] = "auto",
    state_dtype: Annotated[str, typer.Option(help="vLLM's --mamba-cache-dtype (hybrid models)")] = "auto",
    gpu_memory_gib: Annotated[float, typer.Option(help="memory of one GPU")] = 0.0,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's --gpu-memory-utilization")] = 0.92,
    weights_gib: Annotated[float, typer.Option(help="size of all the weights")] = 0.0,
    weights_index: Annotated[Path | None, typer.Option(help="model.safetensors.index.json to sum")] = None,
    overhead_gib: Annotated[float, typer.Option(help="per GPU: activations, CUDA graphs, non-torch")] = 0.0,
    kv_memory_gib: Annotated[list[float] | None, typer.Option(
        help="per GPU, from vLLM's start log ('Available KV cache memory'): one, or one per layout; "
             "replaces the estimate from GPU memory")] = None,
    state_page_bytes: Annotated[int | None, typer.Option(
        help="state page per layer and GPU, for state layers without a known formula")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="default: max_position_embeddings")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="vLLM's --max-num-seqs")] = 32,
    requests: Annotated[int, typer.Option(help="concurrent requests for the 'take' row")] = 4,
    request_tokens: Annotated[int, typer.Option(help="tokens of each of those requests")] = 30_000,
    write: Annotated[Path | None, typer.Option(help="write [backend] of this fleet.toml (one layout)")] = None,
    server: Annotated[str | None, typer.Option(help="a running vLLM's base URL to compare with fleet.toml")] = None,
    api_key: Annotated[str, typer.Option(help="bearer token for --server")] = "",
    backend: Annotated[str | None, typer.Option(
        help="the backend entry (its name) --server compares with and --write writes; default: "
             "the one at the server's url, else the only one")] = None,
    backends: Annotated[bool, typer.Option(
        "--backends", help="check every configured backend at its own url and api_key")] = False,
) -> None:
    """Size a deployment: KV bytes, blocks, pool and fleet settings per parallel layout."""
    try:
        code = _run(config, layout or [], PlanInputs(
            kv_cache_dtype=kv_cache_dtype, state_dtype=state_dtype,
            gpu_memory_bytes=int(gpu_memory_gib * GIB), gpu_memory_utilization=gpu_memory_utilization,
            weights_bytes=weights_from_index(weights_index) if weights_index else int(weights_gib * GIB),
            overhead_bytes=int(overhead_gib * GIB), state_page_bytes=state_page_bytes,
            max_num_seqs=max_num_seqs,
        ), kv_memory_gib or [], max_model_len, (requests, request_tokens), write,
            _Check(server, api_key, backend, backends))
    except FleetError as exc:
        err.print(f"[red]{exc.code.value}[/red] {exc.message}")
        raise typer.Exit(2) from exc
    raise typer.Exit(code)


@dataclass(frozen=True)
class _Check:
    """Which servers to read and which backend entry each is compared with (or written)."""

    server: str | None
    api_key: str
    backend: str | None
    every: bool

    def targets(self, settings: Settings) -> list[tuple[str, str, BackendSettings]]:
        if self.every:
            return [(entry.url, entry.api_key, entry) for entry in settings.backends]
        if self.server is None:
            return []
        return [(self.server, self.api_key, pick_backend(settings, self.backend, self.server))]


def _run(
    config: Path | None, layouts: list[str], inputs: PlanInputs, kv_memory: list[float],
    max_model_len: int | None, take: tuple[int, int], write: Path | None, check: _Check,
) -> int:
    if config is None and check.server is None and not check.every:
        raise InputInvalid("give a config.json to plan, --server URL or --backends to check, or both")
    if check.server is not None and check.every:
        raise InputInvalid("give --server URL or --backends, not both")
    if config is not None:
        _plan(config, layouts, inputs, kv_memory, max_model_len, take, write, check.backend)
    if check.server is None and not check.every:
        return 0
    status = 0
    for url, api_key, entry in check.targets(load_settings()):
        table, found = server_table(url, api_key, entry)
        console.print(table)
        for line in found:
            err.print(f"[red]disagrees[/red] {entry.name}: {line}")
        status = max(status, 1 if found else 0)
    return status


def _plan(
    config: Path, layouts: list[str], inputs: PlanInputs, kv_memory: list[float],
    max_model_len: int | None, take: tuple[int, int], write: Path | None, backend: str | None,
) -> None:
    if not layouts:
        raise InputInvalid("give at least one --layout (tp4, tp2pp2, ...)")
    if write is not None and len(layouts) != 1:
        raise InputInvalid("--write needs exactly one --layout")
    shape = shape_from_config(_read_json(config))
    length = max_model_len or shape.max_position_embeddings
    if not length:
        raise InputInvalid("config.json has no max_position_embeddings: give --max-model-len")
    parsed = [Layout.parse(text) for text in layouts]
    plans = [
        plan_layout(shape, lay, replace(inputs, kv_memory_bytes=mem, max_model_len=length))
        for lay, mem in zip(parsed, _kv_memory(kv_memory, parsed), strict=True)
    ]
    console.print(plan_table(plans, *take))
    if shape.hybrid and inputs.state_page_bytes is not None:
        console.print(f"state page: {inputs.state_page_bytes:,} B as given (--state-page-bytes)")
    for line in (line for p in plans for line in notes(p)):
        err.print(f"[yellow]note[/yellow] {line}")
    console.print(settings_table(plans, inputs.max_num_seqs))
    if write is not None:
        write_backend(write, recommend(plans[0], inputs.max_num_seqs), backend)
        console.print(f"wrote the backend of {write}")


