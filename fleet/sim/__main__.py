"""``python -m fleet.sim``: the simulator without the ``fleet`` CLI (argparse, same options)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from fleet.sim.server import SimOptions, serve

_HELP = {
    "host": "interface to listen on",
    "port": "TCP port",
    "profile": "deployment profile (qwen3-next-tp2pp2, tiny)",
    "max_num_seqs": "running sequences at most",
    "max_model_len": "context length, tokens",
    "kv_pool_tokens": "KV pool size, tokens",
    "block_tokens": "KV block size, tokens",
    "max_num_batched_tokens": "tokens per engine step (prefill chunk)",
    "max_num_partial_prefills": "prompts part-way through prefill at once (vLLM default 1)",
    "max_long_partial_prefills": "of those, long ones at most (vLLM default 1)",
    "long_prefill_token_threshold": "prefill tokens per request and step at most (vLLM default 0)",
    "speed": "simulated seconds per real second",
    "seed": "seed for texts, lengths and faults",
    "fault_rate": "share of requests given a random fault",
    "long_threshold": "prompt tokens above which a request counts as long",
    "log_level": "debug, info, warning, error",
    "served_model_name": "model names requests may give (vLLM's flag; the first is the one "
                         "responses carry)",
    "chat_template": "qwen3 (the generation prompt opens <think>) or plain (the assistant header "
                     "only)",
}


def parse_args(argv: list[str] | None = None) -> SimOptions:
    parser = argparse.ArgumentParser(prog="python -m fleet.sim", description=__doc__)
    defaults = SimOptions()
    for f in fields(SimOptions):
        default = getattr(defaults, f.name)
        if isinstance(default, tuple):  # --served-model-name a b, as vLLM takes it
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, nargs="+",
                                default=default, help=_HELP.get(f.name, f.name))
            continue
        kind = int if default is None else type(default)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind,
                            default=default, help=_HELP.get(f.name, f.name.replace("_", " ")))
    values: dict[str, Any] = vars(parser.parse_args(argv))
    given: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return SimOptions(**given)


def main(argv: list[str] | None = None) -> None:
    serve(parse_args(argv))


if __name__ == "__main__":
    main()
