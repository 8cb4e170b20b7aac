"""Model routing on one backend, across real processes: a ``fleet sim`` serving two names
(``--served-model-name``, started by the harness from the config), the gateway listing and
refusing models, and queue jobs naming a model, their project's default, or one nobody serves."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from fleet.core.codes import Code
from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import config_with_keys

pytestmark = pytest.mark.slow

SIM_ARGS = ["--think-min-tokens", "20", "--think-max-tokens", "60",
            "--answer-min-tokens", "5", "--answer-max-tokens", "15"]
NAMES = ["qwen3-next", "default"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, dict[str, str]]]:
    config, keys = config_with_keys(
        tmp_path_factory.mktemp("models"),
        projects={"triage": {"model": "default"}},
        backend={"model": "qwen3-next", "served_model_names": NAMES},
        admission={"backend_gate": False},
    )
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as harness:
        yield harness, keys


def gateway(fleet: tuple[Harness, dict[str, str]], project: str) -> openai.OpenAI:
    harness, keys = fleet
    return openai.OpenAI(base_url=f"http://127.0.0.1:{harness.settings.gateway.port}/v1",
                         api_key=keys[project], max_retries=0)


def ask(project: str, **extra: object) -> dict:
    return {"project": project, "thinking_budget": 200,
            "messages": [{"role": "user", "content": "[sim:think=20] [sim:answer=5] hi"}], **extra}


def test_the_gateway_lists_and_serves_every_served_name(fleet: tuple[Harness, dict[str, str]]) -> None:
    sdk = gateway(fleet, "assistant")
    assert [(m.id, m.model_extra["root"]) for m in sdk.models.list().data] == [
        ("qwen3-next", "qwen3-next"), ("default", "qwen3-next")]
    answer = sdk.chat.completions.create(model="default", messages=[
        {"role": "user", "content": "[sim:think=20] [sim:answer=5] hi"}])
    assert answer.choices[0].message.content and answer.model == "qwen3-next"
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.chat.completions.create(model="local", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "E_NOT_FOUND" and "`local`" in caught.value.body["message"]


def test_the_simulator_serves_the_configured_names(fleet: tuple[Harness, dict[str, str]]) -> None:
    harness, _ = fleet
    cards = httpx.get(harness.backend_url + "/v1/models", timeout=10).json()["data"]
    assert [card["id"] for card in cards] == NAMES


def test_queue_jobs_run_on_a_served_model_and_refuse_another(fleet: tuple[Harness, dict[str, str]]
                                                             ) -> None:
    harness, _ = fleet
    client = harness.client
    named = client.submit(ask("reports", model="default"))
    defaulted = client.submit(ask("triage"))  # the project's default: "default"
    unknown = client.submit(ask("reports", model="gpt-4o"))
    for job_id in (named, defaulted):
        envelope = client.result(job_id, timeout=120)
        assert envelope is not None and envelope.code == Code.OK, envelope
    refused = client.result(unknown, timeout=120)
    assert refused is not None and refused.code == Code.E_INPUT_INVALID
    assert "'gpt-4o'" in refused.message and "qwen3-next, default" in refused.message
    probe = FleetProbe(harness)
    sent = probe.sim_requests(named) + probe.sim_requests(defaulted)
    assert sent and {body["model"] for body in sent} == {"qwen3-next"}  # the name requests carry
    assert probe.sim_requests(unknown) == []  # refused at prep, never sent
