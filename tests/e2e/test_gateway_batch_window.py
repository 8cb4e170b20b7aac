"""A gateway batch past its completion window in a real fleet (``fleet sim``, a dispatcher, a
worker and ``fleet gateway`` as processes on the test Redis), driven through the ``openai`` SDK.
The jobs carry the window as deadline, so the fleet itself ends them ``E_DEADLINE`` (queued at
admission, running at the deadline) before any retrieve sees them waiting."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from fleet.core.keys import job_ref
from tests.support.fleet_harness import Harness
from tests.support.gateway_support import config_with_keys
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

WINDOW_S = 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("gateway-batch-window"), backend={"max_num_seqs": 2},
        admission={"backend_gate": False}, gateway={"batch_window_s": WINDOW_S})
    with Harness(config, sim_speed=50, gateway=True) as harness:
        yield harness, keys


def test_a_batch_the_fleet_ended_at_its_deadline_is_expired(
    fleet: tuple[Harness, dict[str, str]],
) -> None:
    """Before, such a batch ended ``completed``: by the time it was read every job had the
    fleet's E_DEADLINE result, nothing was waiting, and only waiting lines made it expire."""
    harness, keys = fleet
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{harness.settings.gateway.port}/v1",
                           api_key=keys["triage"], max_retries=0)
    lines = [{"custom_id": str(i), "thinking_budget": 30000,
              "messages": [{"role": "user", "content": f"Think long {i}. [sim:think=30000]"}]}
             for i in range(4)]
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("in.jsonl", text), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    redis, rkeys = harness.client.redis, harness.client.keys
    raw = redis.hget(rkeys.gateway_batch(job_ref("triage", batch.id)), "lines")
    jobs = [row["job"] for row in json.loads(raw)]
    results = [rkeys.result(job_ref("triage", job)) for job in jobs]
    wait_until(lambda: all(redis.mget(results)), 120, "the fleet to end every job")
    codes = [json.loads(raw)["code"] for raw in redis.mget(results)]
    assert set(codes) == {"E_DEADLINE"}
    done = client.batches.retrieve(batch.id)
    assert done.status == "expired" and done.expired_at and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 4)
    assert done.output_file_id is None and done.error_file_id
    errors = [json.loads(row) for row in client.files.content(done.error_file_id).text.splitlines()]
    assert [(row["custom_id"], row["code"]) for row in errors] == [
        (str(i), "E_DEADLINE") for i in range(4)]
