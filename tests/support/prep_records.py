"""Job records as the prep watchdog finds them (tests/prep/test_prepwatch.py, test_recover.py):
the example settings, a ResultStore under the test's key prefix, and a submitted triage job."""

from __future__ import annotations

import json

import redis

from fleet.core.config import EXAMPLE_CONFIG, Settings, load_settings
from fleet.core.keys import Keys
from fleet.core.results import ResultStore


def setup(redis_client: redis.Redis, key_prefix: str) -> tuple[Settings, Keys, ResultStore]:
    settings = load_settings(EXAMPLE_CONFIG, env={})
    keys = Keys(key_prefix)
    return settings, keys, ResultStore(redis_client, keys, settings)


def submitted(results: ResultStore, keys: Keys, job_id: str, state: str = "submitted",
              due: float = 0.0) -> None:
    signed = {"project": "triage", "job": {"id": job_id}, "nonce": "n", "ts": "1", "sig": "x"}
    results.record(f"triage/{job_id}", state=state, project="triage", signed=json.dumps(signed))
    results.client.zadd(keys.prepping("triage"), {f"triage/{job_id}": due})
