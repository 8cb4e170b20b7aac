"""A worker or gateway whose [[backends]] are in another order than the dispatchers' store does
not start (``fleet worker``, ``fleet gateway`` as real processes on the test broker): a job's
eligibility bits and a grant's backend are positions in the store's order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from fleet.core.config import load_settings
from fleet.core.keys import Keys
from schedulers.store.redis_store import order_conflict
from tests.support.fleet_harness import make_config
from tests.support.testenv import delete_prefix

pytestmark = pytest.mark.slow


def entry(name: str) -> dict[str, object]:
    return {"name": name, "url": "http://127.0.0.1:1", "served_model_names": ["local"],
            "max_num_seqs": 4, "max_model_len": 32768, "kv_pool_tokens": 64 * 1072, "block_tokens": 1072}


def test_only_orders_that_agree_position_by_position_pass() -> None:
    assert order_conflict(["a", "b"], None) is None
    assert order_conflict(["a", "b"], ["a", "b", "c"]) is None  # the dispatchers appended one
    assert order_conflict(["a", "b", "c"], ["a", "b"]) is None  # this one appended one
    why = order_conflict(["b", "a"], ["a", "b"])
    assert why is not None and "a, b in this order" in why and "b, a" in why


@pytest.mark.parametrize("command", [["worker", "--concurrency", "1", "--role", "prep"], ["gateway"]])
def test_a_process_with_the_backends_in_another_order_does_not_start(tmp_path: Path,
                                                                     command: list[str]) -> None:
    config = make_config(tmp_path, backends=[entry("b"), entry("a")])
    settings = load_settings(config, env={})
    client = redis.Redis.from_url(settings.broker_url)
    try:
        client.set(Keys(settings.key_prefix).dispatch + "backends", json.dumps(["a", "b"]))
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")} | {
            "FLEET_CONFIG": str(config), "COLUMNS": "200"}
        done = subprocess.run([sys.executable, "-m", "fleet", *command], env=env, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert done.returncode == 2, done.stderr
        [line] = [text for text in done.stderr.splitlines() if text.startswith("E_")]
        assert line.startswith(f"E_INPUT_INVALID {command[0]}: the dispatcher store's backends are a, b")
    finally:
        delete_prefix(client, settings.key_prefix)
        client.close()
