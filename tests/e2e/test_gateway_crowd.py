"""200 concurrent streaming clients through ``fleet gateway`` at cap 32, with the official async
``openai`` SDK: every stream ends well and the backend (``fleet sim``, which would run up to 128)
never runs more than the cap, nor keeps any request waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import config_with_keys
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CAP = 32
CLIENTS = 200


@pytest.fixture(scope="module")
def crowd_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("gateway-crowd"),
        backend={"max_num_seqs": CAP},
        admission={"backend_gate": False, "worker_gate": False},  # a gateway-only fleet
        gateway={"max_queue_wait_s": 600, "keepalive_s": 5},
    )
    with Harness(config, sim_speed=50, workers=0, gateway=True,
                 sim_args=["--max-num-seqs", str(4 * CAP)]) as harness:
        yield harness, keys


def test_two_hundred_streams_at_cap_32_never_put_more_than_32_on_the_backend(
    crowd_fleet: tuple[Harness, dict[str, str]],
) -> None:
    harness, keys = crowd_fleet
    probe = FleetProbe(harness)
    probe.sim_reset()

    async def crowd() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{harness.settings.gateway.port}/v1",
                                    api_key=keys["assistant"], max_retries=0, timeout=600)

        async def one(n: int) -> str:
            stream = await client.chat.completions.create(
                model="local", stream=True,
                messages=[{"role": "user", "content": f"crowd {n} [sim:think=30] [sim:answer=10]"}])
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(n) for n in range(CLIENTS)))
        finally:
            await client.close()

    answers = asyncio.run(crowd())
    assert len(answers) == CLIENTS and all(answers)
    stats = probe.sim_stats()
    assert stats["total_requests"] == CLIENTS
    assert stats["max_running_seen"] <= CAP
    assert stats["max_waiting_seen"] == 0
    wait_until(lambda: probe.snapshot().in_flight == 0, 30, "every lease to be released")
