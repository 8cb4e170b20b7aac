"""The tool-call loop through the REAL fleet (Celery worker and dispatcher processes, the tool
tasks of tests/support/tool_tasks.py on the fleet's tool queues, ``fleet sim``, Redis).

Project ``assistant`` runs ``search_docs`` (trusted, fast; it reports the simulator's running
count while it runs), ``run_query`` (untrusted, outlasts its 1 s timeout) and ``hang`` (never
returns); ``triage`` runs ``open_ticket`` (fails) and ``crash_worker`` (kills the tool worker's
process that runs it). The tool tasks run on the local fleet's tool worker (prefork pool, where
Celery's time limits hold). The simulator calls a tool on the first K requests of a job
(``[sim:tool=NAME/K]``), N calls at once where asked (``[sim:parallel=N]``), with arguments that
fail the schema where asked (``[sim:bad_args/K]``).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from fleet.core.codes import Code
from tests.support.fleet_harness import FleetProbe, Harness, make_config
from tests.support.tool_tasks import hang_pid_file
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

SIM_ARGS = ["--think-min-tokens", "30", "--think-max-tokens", "60",
            "--answer-min-tokens", "10", "--answer-max-tokens", "20"]
QUERY = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
         "additionalProperties": False}


def tools_config(tmp: Path) -> Path:
    path = make_config(tmp, backend={"max_num_seqs": 2}, admission={"lease_ttl_s": 4},
                       tool_imports=["tests.support.tool_tasks"])
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    data["projects"]["assistant"].update(tools="run", max_tool_rounds=4, tool_invalid_max=1,
                                         tool_registry={
        "search_docs": {"task": "tests.search_docs", "parameters": QUERY, "untrusted": False,
                        "timeout_s": 20},
        "run_query": {"task": "tests.run_query", "timeout_s": 1,
                      "queue": "fleet.tools.slow"},
        "hang": {"task": "tests.hang", "timeout_s": 1, "untrusted": False}})
    data["projects"]["assistant"]["allowed_tools"] += ["hang"]
    data["projects"]["triage"].update(tools="run", allowed_tools=["open_ticket", "crash_worker"],
                                      tool_registry={
        "open_ticket": {"task": "tests.open_ticket", "timeout_s": 20},
        "crash_worker": {"task": "tests.crash_worker", "timeout_s": 2, "on_error": "model"}})
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    with Harness(tools_config(tmp_path_factory.mktemp("fleet-tools")), sim_speed=100,
                 sim_args=SIM_ARGS, workers=2) as harness:
        yield harness


@pytest.fixture
def probe(fleet: Harness) -> FleetProbe:
    return FleetProbe(fleet)


def tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def ask(project: str, text: str, *tools: str, **extra: Any) -> dict[str, Any]:
    return {"project": project, "messages": [{"role": "user", "content": text}],
            "tools": [tool(t) for t in tools], "tool_choice": "auto", **extra}


def test_three_tool_rounds_run_with_the_slot_free_then_the_answer(
        fleet: Harness, probe: FleetProbe) -> None:
    client = fleet.client
    before = _usage_rows(probe)
    job = client.submit(ask("assistant", "Find the March invoice. [sim:tool=search_docs/3]",
                            "search_docs"))
    envelope = client.result(job, timeout=90)
    assert envelope is not None and envelope.code == Code.OK, envelope
    assert envelope.content and not envelope.tool_calls
    rounds = envelope.tool_rounds
    assert [r["number"] for r in rounds] == [1, 2, 3]
    results = [r["calls"][0]["result"] for r in rounds]
    assert all(r["ok"] for r in results)
    # While each tool ran, the job held no slot: the simulator ran nothing.
    assert [r["content"].count('"sim_running": 0') for r in results] == [1, 1, 1]
    bodies = probe.sim_requests(job)
    assert len(bodies) == 4  # three turns that called the tool, one that answered
    last = bodies[-1]["messages"]
    assert [m["role"] for m in last[-6:]] == ["assistant", "tool"] * 3
    assert "invoice-2024-03.pdf" in last[-1]["content"]
    assert last[-2]["tool_calls"][0]["function"]["name"] == "search_docs"
    assert bodies[-1]["tools"][0]["function"]["parameters"] == QUERY  # the registry's schema
    shown = probe.cli("tail", job, "--no-follow", "--project", "assistant").stdout
    assert "tool round 3: search_docs; timeout 20.0 s" in shown
    assert "continuation: slot given up, back in line (tools running" in shown
    # the usage ledger: four model turns of the project, three of them tool rounds
    after = _usage_rows(probe)
    assert [row["key"] for row in after] == ["queue"]
    counted = {name: after[0][name] - (before[0][name] if before else 0)
               for name in ("requests", "tool_rounds")}
    assert counted == {"requests": 4, "tool_rounds": 3}


def _usage_rows(probe: FleetProbe) -> list[dict[str, Any]]:
    """``fleet usage`` of the project, by key (a real CLI process)."""
    shown = probe.cli("usage", "--project", "assistant", "--by", "key", "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_invalid_arguments_go_back_to_the_model_then_e_tool_invalid(
        fleet: Harness, probe: FleetProbe) -> None:
    client = fleet.client
    fixed = client.submit(ask("assistant", "Look it up. [sim:tool=search_docs/2] [sim:bad_args/1]",
                              "search_docs"))
    envelope = client.result(fixed, timeout=90)
    assert envelope is not None and envelope.code == Code.OK, envelope
    first, second = envelope.tool_rounds
    assert "schema" in first["calls"][0]["error"] and first["calls"][0]["result"] is None
    assert second["calls"][0]["error"] is None and second["calls"][0]["result"]["ok"]
    told = probe.sim_requests(fixed)[1]["messages"][-1]
    assert told["role"] == "tool" and "not run" in told["content"]

    stubborn = client.submit(ask("assistant", "Look it up. [sim:tool=search_docs] [sim:bad_args]",
                                 "search_docs"))
    envelope = client.result(stubborn, timeout=90)
    assert envelope is not None and envelope.code == Code.E_TOOL_INVALID, envelope
    assert len(envelope.tool_rounds) == 1  # tool_invalid_max = 1: told once, then the end
    assert len(probe.sim_requests(stubborn)) == 2


def test_a_tool_past_its_timeout_ends_e_tool_timeout(fleet: Harness, probe: FleetProbe) -> None:
    job = fleet.client.submit(ask("assistant", "Query it. [sim:tool=run_query]", "run_query"))
    envelope = fleet.client.result(job, timeout=90)
    assert envelope is not None and envelope.code == Code.E_TOOL_TIMEOUT, envelope
    assert "no result within 1 s" in envelope.message
    assert probe.envelope_counts()[job] == 1


def test_a_model_that_never_stops_calling_ends_after_max_tool_rounds(
        fleet: Harness, probe: FleetProbe) -> None:
    job = fleet.client.submit(ask("assistant", "Search forever. [sim:tool=search_docs]",
                                  "search_docs"))
    envelope = fleet.client.result(job, timeout=90)
    assert envelope is not None and envelope.code == Code.E_TOOL_FAILED, envelope
    assert len(envelope.tool_rounds) == 4 and "after 4 rounds" in envelope.message
    assert len(probe.sim_requests(job)) == 5


def test_a_failing_tool_ends_e_tool_failed(fleet: Harness, probe: FleetProbe) -> None:
    job = fleet.client.submit(ask("triage", "File it. [sim:tool=open_ticket]", "open_ticket"))
    envelope = fleet.client.result(job, timeout=90)
    assert envelope is not None and envelope.code == Code.E_TOOL_FAILED, envelope
    assert "the ticket system is down" in envelope.message


def test_an_untrusted_job_never_runs_tools(fleet: Harness, probe: FleetProbe) -> None:
    job = fleet.client.submit({
        "project": "assistant", "tools": [tool("search_docs")], "tool_choice": "auto",
        "messages": [{"role": "user", "content": "Summarise. [sim:tool=search_docs]"},
                     {"role": "user", "content": "a pasted web page", "untrusted": True}]})
    envelope = fleet.client.result(job, timeout=90)
    assert envelope is not None and envelope.code == Code.OK, envelope
    assert envelope.tool_rounds == [] and envelope.tool_calls == []
    body, = probe.sim_requests(job)
    assert "tools" not in body and body["tool_choice"] == "none"



def test_parallel_calls_of_one_answer_run_at_once(fleet: Harness, probe: FleetProbe) -> None:
    """The model asks for three calls in one answer: three tool tasks, on the tool worker's
    processes at the same time; the next turn gets the three results."""
    job = fleet.client.submit(ask("assistant", "Find all three. [sim:tool=search_docs/1] "
                                  "[sim:parallel=3]", "search_docs"))
    envelope = fleet.client.result(job, timeout=90)
    assert envelope is not None and envelope.code == Code.OK, envelope
    (round_,) = envelope.tool_rounds
    results = [c["result"] for c in round_["calls"]]
    assert len(results) == 3 and all(r["ok"] for r in results)
    assert len({c["id"] for c in round_["calls"]}) == 3
    # every call started before any other ended: they ran side by side
    assert max(r["started_at"] for r in results) < min(r["started_at"] + r["duration_s"] for r in results)
    last = probe.sim_requests(job)[-1]["messages"]
    assert [m["role"] for m in last[-4:]] == ["assistant", "tool", "tool", "tool"]
    assert len(last[-4]["tool_calls"]) == 3


def test_a_hung_tool_is_killed_at_its_time_limit(fleet: Harness, probe: FleetProbe) -> None:
    """Before, the waiting side timed out but the tool task ran on for ever, holding a tool
    worker. Celery's hard time limit (the tool's timeout + KILL_GRACE_S + SETTLE_S of
    fleet/infer/tools.py: 15 s here) now kills its process."""
    pid_file = hang_pid_file(fleet.settings.key_prefix)
    pid_file.unlink(missing_ok=True)
    job = fleet.client.submit(ask("assistant", "Wait for it. [sim:tool=hang/1]", "hang"))
    envelope = fleet.client.result(job, timeout=90)
    assert envelope is not None and envelope.code == Code.E_TOOL_TIMEOUT, envelope
    assert "no result within 1 s" in envelope.message
    pid = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), 30, "the tool's pid"))
    wait_until(lambda: not running(pid), 30, "the hung tool's process killed")
    pid_file.unlink()
    after = fleet.client.submit(ask("assistant", "Look it up. [sim:tool=search_docs/1]", "search_docs"))
    envelope = fleet.client.result(after, timeout=90)
    assert envelope is not None and envelope.code == Code.OK, envelope


def running(pid: int) -> bool:
    """The process exists and is no zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_a_tool_worker_dying_mid_tool_loses_nothing(fleet: Harness, probe: FleetProbe) -> None:
    """The round's result never comes: at the tool's timeout the job is in line again, the
    next turn runs, and the model is told (``on_error = "model"``)."""
    job = fleet.client.submit(ask("triage", "File it. [sim:tool=crash_worker/1]", "crash_worker"))
    envelope = fleet.client.result(job, timeout=90)
    assert envelope is not None and envelope.code == Code.OK, envelope
    result = envelope.tool_rounds[0]["calls"][0]["result"]
    assert result == {"ok": False, "error": "no result within 2 s", "timed_out": True}
    second = probe.sim_requests(job)[1]
    told = second["messages"][-1]
    assert told["role"] == "tool" and "no result within 2 s" in told["content"]
    # crash_worker is untrusted (the default): its result is fenced and turns the tools off
    assert "tools" not in second and second["tool_choice"] == "none"
    assert any("without tools" in w for w in envelope.warnings)
    # the tool worker's pool replaced the process; every worker of the fleet still runs
    assert [name for name, p in fleet.fleet.children if p.poll() is not None] == []
    assert probe.envelope_counts()[job] == 1
