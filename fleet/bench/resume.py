"""``fleet bench resume``: what continuing a cut reasoning saves (docs/backends.md section 7).

One run per mode of ``routing.continue_cut_turns`` (``restart``, then ``continue``), each on its own
Redis and a REAL fleet (two dispatchers, two inference workers, a prep worker) with two replica
simulators of one model: a backlog of reasoning jobs (``think`` tokens each) is submitted, and once
the second simulator has generated half of what its running jobs will think, it is killed
(SIGKILL) and stays down until every job has ended. The turns it cut go back through admission to
the survivor: with ``restart`` they think again from the start (with a carry-over note), with
``continue`` they send the reasoning so far and think only the rest.

Figures per mode, from the envelopes (the simulators' own usage chunks):
  jobs OK, envelopes per job (exactly one each: nothing lost or doubled), the cut turns,
  reasoning tokens generated in all (every attempt's), of them beyond the thought each answer came
  from (generated and thrown away: the cut attempts' reasoning when restarted, 0 when continued),
  tokens continued (the last attempt's ``continued_tokens``: its thought's part an earlier attempt
  generated), seconds from the kill to the last envelope.
The ratio ``continue / restart`` of the reasoning generated and of the seconds is measured in the
same run, on the same machine.

``--gateway`` (``gateway_bench``): the same kill under gateway requests instead of queue jobs, one
fleet per mode and per kind of request, with ``fleet gateway`` and ``requests`` clients at once
(as many as both simulators' seats, so about half run on the one killed), each one chat request
of ``think`` reasoning tokens as project ``reports`` (its thinking budget holds them):
  not streamed  nothing reached the client when the cut came: ``restart`` runs the turn again on
                the survivor, ``continue`` sends the reasoning so far and thinks the rest
  streamed      the client has the reasoning so far: ``continue`` goes on in the same stream,
                ``restart`` ends the stream with the backend's error (a restart would send the
                reasoning twice)
Figures per run, from the gateway's envelopes (the answer's usage counts every attempt's output,
the continued part once): requests, their codes, requests moved by a failover, reasoning tokens
generated in all, of them beyond one thought per request answered OK (thrown away: a restart's
cut attempt, or a stream that ended in the error), seconds from the kill to the last answer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from fleet.bench.chaos import Broker, ChaosFleet
from fleet.bench.chaosgateway import stream_once
from fleet.bench.fleet.workload import PROJECTS, Spec
from fleet.core.codes import Code
from fleet.core.models import Envelope

log = logging.getLogger(__name__)
MODES = ("restart", "continue")
CUT_CODES = {Code.E_STREAM_DROPPED, Code.E_UPSTREAM_UNAVAILABLE, Code.E_UPSTREAM_ERROR,
             Code.E_CONNECT_TIMEOUT}


@dataclass
class ResumeRun:
    mode: str
    jobs: int = 0
    ok: int = 0
    envelopes: dict[str, int] = field(default_factory=dict)  # job id -> envelopes seen
    cut: int = 0  # attempts a backend cut after some reasoning
    reasoning: int = 0  # reasoning tokens generated, every attempt
    again: int = 0  # of them, beyond the thought each answer came from (thrown away)
    continued: int = 0  # reasoning tokens of the final thoughts an earlier attempt generated
    seconds_after_kill: float | None = None
    error: str = ""

    @property
    def exact(self) -> bool:
        return len(self.envelopes) == self.jobs and set(self.envelopes.values()) == {1}


def _stats(url: str) -> dict[str, Any]:
    with contextlib.suppress(httpx.HTTPError):
        return dict(httpx.get(f"{url}/sim/stats", timeout=2).json())
    return {}


def _account(run: ResumeRun, envelopes: list[Envelope]) -> None:
    for envelope in envelopes:
        run.ok += envelope.code == Code.OK
        attempts = envelope.attempts
        generated = sum(a.usage.reasoning_tokens for a in attempts)
        run.reasoning += generated
        run.cut += sum(1 for a in attempts if a.code in CUT_CODES and a.usage.reasoning_tokens)
        if attempts:  # the thought the answer came from: the last attempt's and what it continued
            final = attempts[-1]
            run.continued += final.continued_tokens
            run.again += max(0, generated - final.usage.reasoning_tokens - final.continued_tokens)


def one_run(mode: str, jobs: int, think: int, answer: int, cap: int, speed: float) -> ResumeRun:
    run = ResumeRun(mode, jobs)
    broker = Broker(node_args=[]).start()
    sections: dict[str, dict[str, Any]] = {"routing": {"continue_cut_turns": mode},
                                           "retry": {"max_outage_returns": 30}}
    cf = ChaosFleet(broker, jobs, cap, speed, ["--answer-min-tokens", str(answer),
                                               "--answer-max-tokens", str(answer)],
                    lease_ttl_s=10.0, backends=2, sections=sections)
    try:
        cf.start()
        victim = cf.settings.backends[1].name
        specs = [Spec(PROJECTS[i % len(PROJECTS)], think, answer, tag=f"{mode}-{i}")
                 for i in range(jobs)]
        ids, _failed = cf.submit(specs)
        url = cf.urls[victim]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # half-way through what its running jobs think
            seen = _stats(url)
            if seen.get("generation_tokens", 0) >= seen.get("running", 0) * think // 2 > 0:
                break
            time.sleep(0.1)
        cf.kill(f"sim-{victim}")
        killed_at = time.time()
        deadline = time.monotonic() + 600
        while cf.open_jobs(ids) and time.monotonic() < deadline:
            time.sleep(0.5)
        run.seconds_after_kill = cf.last_final(ids, killed_at)
        cf.start_again(f"sim-{victim}")
        time.sleep(1.0)  # a late duplicate would show here
        counts = cf.envelope_counts()
        run.envelopes = {job_id: counts.get(job_id, 0) for job_id in ids}
        envelopes = [cf.client.result(job_id, timeout=10) for job_id in ids]
        _account(run, [e for e in envelopes if e is not None])
    except Exception as exc:  # a run that cannot finish is reported, never the end of the bench
        log.exception("resume run %s", mode)
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        cf.close()
        broker.close()
    return run


GATEWAY_PROJECT = "reports"  # its thinking budget (10,000) holds the bench's 4,000-token thoughts


@dataclass
class GatewayRun:
    mode: str
    stream: bool
    requests: int = 0
    codes: Counter[str] = field(default_factory=Counter)  # as the clients got them
    envelopes: int = 0  # the gateway's, one per request
    moved: int = 0  # requests a failover moved to the other backend
    reasoning: int = 0  # reasoning tokens generated, every attempt
    again: int = 0  # of them beyond one thought per request answered OK
    seconds_after_kill: float | None = None
    error: str = ""

    @property
    def kind(self) -> str:
        return "streamed" if self.stream else "not streamed"


def _kill_half_way(cf: ChaosFleet, victim: str, think: int) -> float:
    """Once ``victim``'s running requests have generated half of what they think, kill -9 of its
    simulator; the instant of the kill."""
    url = cf.urls[victim]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        seen = _stats(url)
        if seen.get("generation_tokens", 0) >= seen.get("running", 0) * think // 2 > 0:
            break
        time.sleep(0.1)
    cf.kill(f"sim-{victim}")
    return time.time()


def _ask(http: httpx.Client, url: str, key: str, text: str) -> str:
    """One chat request not streamed: the answer's fleet code, or the error's."""
    body = {"model": "local", "messages": [{"role": "user", "content": text}]}
    response = http.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
    if response.status_code != 200:
        return response.headers.get("x-fleet-code") or f"HTTP {response.status_code}"
    return str((response.json().get("fleet") or {}).get("code", "no code"))


def _gateway_envelopes(cf: ChaosFleet, wanted: int, wait_s: float = 15.0) -> list[Envelope]:
    """The gateway's envelopes of the run, once there are ``wanted`` (the gateway publishes one
    after its answer went out) or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        entries: Any = cf.reader.xrange(cf.client.keys.gateway_results(GATEWAY_PROJECT))
        if len(entries) >= wanted or time.monotonic() > deadline:
            return [Envelope.model_validate_json(fields[b"envelope"]) for _id, fields in entries]
        time.sleep(0.2)


def one_gateway_run(mode: str, stream: bool, requests: int, think: int, answer: int, cap: int,
                    speed: float) -> GatewayRun:
    run = GatewayRun(mode, stream, requests)
    broker = Broker(node_args=[]).start()
    cf = ChaosFleet(broker, 0, cap, speed, ["--answer-min-tokens", str(answer), "--answer-max-tokens", str(answer)],
                    lease_ttl_s=10.0, backends=2, sections={"routing": {"continue_cut_turns": mode}},
                    gateway=True, gateway_project=GATEWAY_PROJECT)
    try:
        cf.start()
        assert cf.fleet.gateway_port is not None
        url = f"http://127.0.0.1:{cf.fleet.gateway_port}/v1/chat/completions"
        codes: list[str] = []
        finished: list[float] = []

        def client(n: int) -> None:
            text = f"[sim:think={think}] [sim:answer={answer}] {mode} request {n}"
            with httpx.Client(timeout=httpx.Timeout(10.0, read=600.0)) as http:
                code = (stream_once(http, url, cf.gateway_key, text).code if stream
                        else _ask(http, url, cf.gateway_key, text))
            codes.append(code)
            finished.append(time.time())

        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(requests)]
        for thread in threads:
            thread.start()
        killed_at = _kill_half_way(cf, cf.settings.backends[1].name, think)
        for thread in threads:
            thread.join(timeout=600)
        run.codes = Counter(codes)
        run.seconds_after_kill = max(finished) - killed_at if len(finished) == requests else None
        envelopes = _gateway_envelopes(cf, requests)
        run.envelopes = len(envelopes)
        run.moved = sum(1 for e in envelopes if int(e.metadata.get("failovers") or 0) > 0)
        run.reasoning = sum(e.usage.reasoning_tokens for e in envelopes)
        run.again = max(0, run.reasoning - think * run.codes.get("OK", 0))
    except Exception as exc:  # a run that cannot finish is reported, never the end of the bench
        log.exception("gateway resume run %s", mode)
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        cf.close()
        broker.close()
    return run


def gateway_bench(requests: int = 16, think: int = 4000, answer: int = 60, cap: int = 8,
                  speed: float = 20.0) -> list[GatewayRun]:
    return [one_gateway_run(mode, stream, requests, think, answer, cap, speed)
            for stream in (False, True) for mode in MODES]


def gateway_markdown(runs: list[GatewayRun]) -> str:
    head = ("| requests | mode | codes the clients got | envelopes | moved by a failover | reasoning tokens "
            "generated | thrown away | s from the kill to the last answer |\n"
            "|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in runs:
        if r.error:
            rows.append(f"| {r.kind} | {r.mode} | error: {r.error} | | | | | |")
            continue
        codes = ", ".join(f"{code} {n}" for code, n in sorted(r.codes.items()))
        after = "never" if r.seconds_after_kill is None else f"{r.seconds_after_kill:.1f}"
        rows.append(f"| {r.kind} ({r.requests}) | {r.mode} | {codes} | {r.envelopes} | {r.moved} | "
                    f"{r.reasoning:,} | {r.again:,} | {after} |")
    out = head + "\n".join(rows)
    for stream in (False, True):
        by = {r.mode: r for r in runs if r.stream == stream and not r.error}
        if {"restart", "continue"} <= set(by) and by["restart"].reasoning:
            ratio = by["continue"].reasoning / by["restart"].reasoning
            kind = "streamed" if stream else "not streamed"
            out += f"\n\n{kind}: continue / restart, reasoning tokens generated {ratio:.2f}"
    return out


def resume_bench(jobs: int = 32, think: int = 4000, answer: int = 60, cap: int = 8,
                 speed: float = 20.0) -> list[ResumeRun]:
    return [one_run(mode, jobs, think, answer, cap, speed) for mode in MODES]


def markdown(runs: list[ResumeRun]) -> str:
    head = ("| mode | jobs OK | exactly one envelope each | cut turns | reasoning tokens generated "
            "| thrown away | continued | s from the kill to the last envelope |\n"
            "|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in runs:
        if r.error:
            rows.append(f"| {r.mode} | error: {r.error} | | | | | | |")
            continue
        after = "never" if r.seconds_after_kill is None else f"{r.seconds_after_kill:.1f}"
        rows.append(f"| {r.mode} | {r.ok} / {r.jobs} | {'yes' if r.exact else 'NO'} | {r.cut} | "
                    f"{r.reasoning:,} | {r.again:,} | {r.continued:,} | {after} |")
    out = head + "\n".join(rows)
    by = {r.mode: r for r in runs if not r.error}
    if {"restart", "continue"} <= set(by) and by["restart"].reasoning:
        restart, cont = by["restart"], by["continue"]
        out += (f"\n\ncontinue / restart: reasoning tokens generated {cont.reasoning / restart.reasoning:.2f}")
        if restart.seconds_after_kill and cont.seconds_after_kill is not None:
            ratio = cont.seconds_after_kill / restart.seconds_after_kill
            out += f", seconds from the kill to the last envelope {ratio:.2f}"
    return out
