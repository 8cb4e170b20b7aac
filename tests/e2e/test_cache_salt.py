"""The cache-timing probe, as a project holding only its own gateway key would run it: beta sends a
document through the fleet, alpha sends the right guess. vLLM's prefix cache (``fleet sim``
models it, salt included) must not tell alpha that beta sent it: every request the fleet sends
carries its project's ``cache_salt``. Projects naming one ``cache_group`` share their cache.
Real processes: ``fleet sim``, a dispatcher, a worker and ``fleet gateway`` on the test Redis,
driven through the official ``openai`` SDK; the queue path through ``fleet.Client``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from fleet.core.codes import Code
from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import config_with_keys

pytestmark = pytest.mark.slow

SIM_ARGS = ["--think-min-tokens", "5", "--think-max-tokens", "10",
            "--answer-min-tokens", "3", "--answer-max-tokens", "6"]
BETA, ALPHA = "reports", "assistant"  # each with its own salt
SHARING = ("translate", "triage")  # cache_group "glossary"
DOCUMENT = " ".join(f"Clause {n} of beta's confidential supply contract." for n in range(500))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(tmp_path_factory.mktemp("cache-salt"), projects={
        name: {"cache_group": "glossary"} for name in SHARING},
        admission={"backend_gate": False}, gateway={"max_queue_wait_s": 60})
    with Harness(config, sim_speed=200, sim_args=SIM_ARGS, gateway=True) as harness:
        yield harness, keys


def cached(fleet: tuple[Harness, dict[str, str]], project: str, text: str) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of one chat of ``project`` through the gateway."""
    harness, keys = fleet
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{harness.settings.gateway.port}/v1",
                        api_key=keys[project], max_retries=0)
    with sdk:
        answer = sdk.chat.completions.create(model="local", messages=[{"role": "user", "content": text}])
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.usage.prompt_tokens_details.cached_tokens or 0


def test_alpha_cannot_confirm_what_beta_sent(fleet: tuple[Harness, dict[str, str]]) -> None:
    """Before, the right guess came back with the document's whole blocks cached."""
    assert cached(fleet, BETA, DOCUMENT) == 0
    beta_again = cached(fleet, BETA, DOCUMENT)
    assert beta_again >= 2 * fleet[0].settings.backend.block_tokens  # beta's own cache works
    assert cached(fleet, ALPHA, DOCUMENT) == 0


def test_the_queue_path_sends_the_same_salt(fleet: tuple[Harness, dict[str, str]]) -> None:
    """A job of alpha's through the queue finds none of beta's blocks: the simulator's hit count
    does not move; beta's own job through the queue hits what beta sent through the gateway."""
    harness, _ = fleet
    probe = FleetProbe(harness)
    text = DOCUMENT.replace("supply", "delivery")
    assert cached(fleet, BETA, text) == 0
    before = probe.sim_stats()["prefix_cache_hits"]
    assert _queued(harness, ALPHA, text) == Code.OK
    assert probe.sim_stats()["prefix_cache_hits"] == before
    assert _queued(harness, BETA, text) == Code.OK
    assert probe.sim_stats()["prefix_cache_hits"] > before
    salts = {b["cache_salt"] for b in probe.sim_requests()[-4:]}
    assert len(salts) == 2  # one per project, on both paths


def test_projects_of_one_cache_group_share_their_cache(fleet: tuple[Harness, dict[str, str]]) -> None:
    text = DOCUMENT.replace("beta's", "the team's shared")
    assert cached(fleet, SHARING[0], text) == 0
    assert cached(fleet, SHARING[1], text) >= 2 * fleet[0].settings.backend.block_tokens
    assert cached(fleet, BETA, text) == 0


def _queued(harness: Harness, project: str, text: str) -> Any:
    job_id = harness.client.submit({"project": project, "messages": [{"role": "user", "content": text}]})
    envelope = harness.client.result(job_id, project=project, timeout=60)
    assert envelope is not None
    return envelope.code
