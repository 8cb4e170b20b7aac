"""Several backends behind one fleet (docs/backends.md): a REAL fleet with one ``fleet sim`` per
backend entry, each started with its entry's names and sizes.

- Routing by model and caps per backend: a big server (model ``local``, 4 sequences) and a small
  one (model ``small``, 2 sequences, 32K context). Jobs naming each model end on their model's
  server, a job too long for the small one's context ends E_PROMPT_TOO_LONG naming it, and neither
  simulator ever had a request waiting (the fleet never sent past a server's own cap: every
  simulator runs with its entry's ``max_num_seqs``).
- Failover: two replicas of one model under a backlog; one simulator is killed with SIGKILL. Every
  job still ends with exactly one envelope, the survivor runs the rest, and once the killed one
  is back it is used again.
"""

from __future__ import annotations

import os
import signal
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import tomli_w

from fleet.cli.queues import queues_table
from fleet.cli.top import read_frame, render
from fleet.core.codes import Code
from tests.support.fleet_harness import FleetProbe, Harness, make_config
from tests.support.gateway_support import config_with_keys
from tests.support.rendering import rendered
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

SIM_ARGS = ["--answer-min-tokens", "20", "--answer-max-tokens", "40"]


def backend(name: str, **sizes: Any) -> dict[str, Any]:
    return {"name": name, "url": "http://127.0.0.1:1", "max_num_batched_tokens": 2048,
            "block_tokens": 1072, "long_prompt_tokens": 32768, "max_long": 3, **sizes}


def ask(model: str | None, text: str, **extra: Any) -> dict[str, Any]:
    job: dict[str, Any] = {"project": "assistant", "messages": [{"role": "user", "content": text}],
                           "thinking_budget": 2000, **extra}
    if model:
        job["model"] = model
    return job


def stats(fleet: Harness, name: str) -> dict[str, Any]:
    return httpx.get(f"{fleet.sim_urls[name]}/sim/stats", timeout=10).json()


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def finals(fleet: Harness, ids: list[str], within_s: float = 180.0) -> dict[str, Any]:
    out = {}
    for job_id in ids:
        envelope = fleet.client.result(job_id, timeout=within_s)
        assert envelope is not None, job_id
        out[job_id] = envelope
    return out


def test_jobs_run_on_their_models_backend_and_no_backend_passes_its_cap(tmp_path) -> None:
    config = make_config(tmp_path, backends=[
        backend("big", served_model_names=["local"], max_num_seqs=4, max_model_len=262144,
                kv_pool_tokens=530000),
        backend("small", served_model_names=["small"], max_num_seqs=2, max_model_len=32768,
                kv_pool_tokens=64 * 1072),
    ])
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS) as fleet:
        big = [fleet.client.submit(ask(None, f"[sim:think=600] big {i}")) for i in range(10)]
        small = [fleet.client.submit(ask("small", f"[sim:think=600] small {i}")) for i in range(6)]
        too_long = fleet.client.submit(ask("small", "word " * 40_000, allow_trim=False))
        ended = finals(fleet, [*big, *small, too_long])
        for job_id in big:
            assert ended[job_id].code == Code.OK and ended[job_id].backend == "big"
        for job_id in small:
            assert ended[job_id].code == Code.OK and ended[job_id].backend == "small"
        refused = ended[too_long]
        assert refused.code == Code.E_PROMPT_TOO_LONG and "max_model_len 32768" in refused.message
        for name, cap in (("big", 4), ("small", 2)):
            seen = stats(fleet, name)
            assert seen["max_running_seen"] <= cap and seen["max_waiting_seen"] == 0, (name, seen)
        assert stats(fleet, "small")["max_running_seen"] == 2  # its cap was used, not the big one's
        assert FleetProbe(fleet).envelope_counts() == {job_id: 1 for job_id in [*big, *small, too_long]}
        shown = rendered(queues_table(fleet.settings, fleet.client.redis))
        shown += rendered(render(read_frame(fleet.settings, fleet.client.redis, time.time()), live=False))
        for line in ("backend big: in flight 0/4", "backend small: in flight 0/2"):
            assert shown.count(line) == 2, shown  # fleet queues and fleet top, a line each


def test_a_killed_backend_loses_nothing_and_is_used_again_once_back(tmp_path) -> None:
    replica = {"served_model_names": ["local"], "max_num_seqs": 3, "max_model_len": 262144,
               "kv_pool_tokens": 530000}
    config = make_config(tmp_path, backends=[backend("a", **replica), backend("b", **replica)],
                         retry={"max_outage_returns": 10})
    with Harness(config, sim_speed=20, sim_args=SIM_ARGS) as fleet:
        first = [fleet.client.submit(ask(None, f"[sim:think=1500] job {i}")) for i in range(24)]
        wait_until(lambda: stats(fleet, "b")["running"] >= 2, 60, "backend b busy")
        sim_b = next(process for name, process in fleet.fleet.children if name == "sim-b")
        os.killpg(sim_b.pid, signal.SIGKILL)
        killed_at = time.time()
        ended = finals(fleet, first)
        assert all(envelope.code == Code.OK for envelope in ended.values()), \
            {j: (e.code, e.message) for j, e in ended.items() if e.code != Code.OK}
        after = [e for e in ended.values() if e.finished_at > killed_at + 10]
        assert after and all(e.backend == "a" for e in after)  # the survivor carried the rest
        fleet.fleet.restart("sim-b")  # same port: the fleet finds it at its url again
        wait_until(lambda: answers(f"{fleet.sim_urls['b']}/health"), 30, "backend b back")
        second = [fleet.client.submit(ask(None, f"[sim:think=1500] again {i}")) for i in range(12)]
        again = finals(fleet, second)
        assert {e.backend for e in again.values()} == {"a", "b"}  # b takes work again
        assert FleetProbe(fleet).envelope_counts() == {job_id: 1 for job_id in [*first, *second]}


def test_jobs_sharing_a_cached_prefix_go_to_the_backend_that_holds_it(tmp_path) -> None:
    """Two replicas. Two warm-up jobs with different long system prompts run side by side, one on
    each (least loaded, nothing cached yet). Then eight jobs, four per system prompt, arrive at
    once: each goes where its prefix was sent (the hint), not where least-loaded would spread
    them, and each simulator serves its four from its prefix cache."""
    replica = {"served_model_names": ["local"], "max_num_seqs": 8, "max_model_len": 262144,
               "kv_pool_tokens": 530000}
    config = make_config(tmp_path, backends=[backend("a", **replica), backend("b", **replica)],
                         routing={"balance_abs_seqs": 8})
    systems = {"one": "rules one " * 3000, "two": "rules two " * 3000}  # about 6,000 tokens each

    def sharing(name: str, question: str, think: int = 200) -> dict[str, Any]:
        return ask(None, f"[sim:think={think}] {question}",
                   messages=[{"role": "system", "content": systems[name]},
                             {"role": "user", "content": f"[sim:think={think}] {question}"}])

    with Harness(config, sim_speed=50, sim_args=SIM_ARGS) as fleet:
        # long enough (about a second) that the first is still in flight when the second is admitted,
        # however late prep hands the second one over: least-loaded then puts one on each
        warm = {name: fleet.client.submit(sharing(name, f"warm {name}", think=3000)) for name in systems}
        warmed = finals(fleet, list(warm.values()))
        home = {name: warmed[job_id].backend for name, job_id in warm.items()}
        assert sorted(home.values()) == ["a", "b"], home
        before = {name: stats(fleet, name)["prefix_cache_hits"] for name in ("a", "b")}
        later = {fleet.client.submit(sharing(name, f"question {i} on {name}")): name
                 for i in range(4) for name in systems}
        ended = finals(fleet, list(later))
        assert all(e.code == Code.OK for e in ended.values())
        assert {job_id: e.backend for job_id, e in ended.items()} == {j: home[n] for j, n in later.items()}
        for name in ("a", "b"):  # four prompts of about 5 cached blocks each
            assert stats(fleet, name)["prefix_cache_hits"] - before[name] >= 4 * 5 * 1072, name


def test_a_gateway_conversation_stays_on_the_backend_that_holds_it(tmp_path) -> None:
    """Two chat conversations through the gateway (the official SDK), started together, land one
    on each replica; every next turn of each (the conversation so far plus a question) is routed
    to the backend that computed the turns before it, and finds them in its prefix cache."""
    replica = {"served_model_names": ["local"], "max_num_seqs": 8, "max_model_len": 262144,
               "kv_pool_tokens": 530000}
    config, keys = config_with_keys(tmp_path, backends=[backend("a", **replica), backend("b", **replica)],
                                    routing={"balance_abs_seqs": 8}, gateway={"max_queue_wait_s": 60})
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS, gateway=True) as fleet:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{fleet.settings.gateway.port}/v1",
                            api_key=keys["assistant"], max_retries=0)

        def turn(history: list[dict[str, str]]) -> tuple[str, str, int]:
            raw = sdk.chat.completions.with_raw_response.create(model="local", messages=history)
            answer = raw.parse()
            details = answer.usage.prompt_tokens_details if answer.usage else None
            return (raw.headers["x-fleet-backend"], answer.choices[0].message.content or "",
                    (details.cached_tokens or 0) if details else 0)

        chats = {name: [{"role": "system", "content": f"conversation {name} " * 3000},
                        {"role": "user", "content": f"[sim:think=400] first question of {name}"}]
                 for name in ("one", "two")}
        with sdk, ThreadPoolExecutor(2) as pool:
            first = dict(zip(chats, pool.map(turn, chats.values()), strict=True))
            home = {name: found[0] for name, found in first.items()}
            assert sorted(home.values()) == ["a", "b"], home
            for round_ in range(3):
                for name, history in chats.items():
                    history += [{"role": "assistant", "content": first[name][1]},
                                {"role": "user", "content": f"[sim:think=50] question {round_} of {name}"}]
                later = dict(zip(chats, pool.map(turn, chats.values()), strict=True))
                for name, (served_by, text, cached) in later.items():
                    assert served_by == home[name], (round_, name, served_by)
                    assert cached >= 5 * 1072, (round_, name, cached)  # the system prompt, at least
                    first[name] = (served_by, text, cached)


def test_a_turn_grown_past_its_backend_runs_on_the_one_that_holds_it(tmp_path) -> None:
    """Two backends of one model: "short" (6K context) takes what it holds, "long" (the
    long-context tier) only what no other holds. A job fits "short"; its tool returns about 5K
    tokens (a result's cap: 20,000 characters), so its next turn (prompt + output limit) no
    longer fits there: that turn is readmitted with its new mask and runs on "long"."""
    config = make_config(tmp_path, backends=[
        backend("short", served_model_names=["local"], max_num_seqs=4, max_model_len=6144,
                kv_pool_tokens=530000),
        backend("long", served_model_names=["local"], max_num_seqs=2, max_model_len=262144,
                kv_pool_tokens=530000, only_unfit_elsewhere=True),
    ], tool_imports=["tests.support.tool_tasks"])
    data = tomllib.loads(config.read_text(encoding="utf-8"))
    data["projects"]["assistant"].update(
        tools="run", allowed_tools=["big_result"], max_tool_rounds=2,
        tool_registry={"big_result": {"task": "tests.big_result", "untrusted": False, "timeout_s": 20}})
    config.write_text(tomli_w.dumps(data), encoding="utf-8")
    with Harness(config, sim_speed=50, sim_args=SIM_ARGS) as fleet:
        job_id = fleet.client.submit(ask(None, "[sim:think=100] [sim:tool=big_result/1] look it up",
                                         tools=[{"type": "function", "function": {
                                             "name": "big_result", "parameters": {"type": "object"}}}],
                                         tool_choice="auto", thinking_budget=1000, content_reserve=1000))
        envelope = finals(fleet, [job_id])[job_id]
        assert envelope.code == Code.OK, (envelope.code, envelope.message)
        served = [a.backend for a in envelope.attempts]
        assert served[0] == "short" and served[-1] == "long", served
        assert envelope.backend == "long"
