"""``fleet bench resume --gateway`` (fleet/bench/resume.py ``one_gateway_run``) on a tiny run:
real gateway, dispatchers, workers and two ``fleet sim`` processes, one killed half-way through
its streams. With ``continue`` every stream the kill cut goes on in the client's one stream: all
answered OK, exactly one gateway envelope each, and the reasoning generated is one thought per
request (nothing thought twice). No timing is asserted."""

from __future__ import annotations

import pytest

from fleet.bench.resume import gateway_markdown, one_gateway_run

pytestmark = pytest.mark.slow


def test_streams_cut_by_a_killed_backend_continue_and_think_nothing_twice() -> None:
    run = one_gateway_run("continue", stream=True, requests=4, think=600, answer=10, cap=2, speed=20.0)
    assert run.error == ""
    assert run.codes == {"OK": 4} and run.envelopes == 4, run
    assert run.moved >= 1, run  # the kill came while the victim had streams thinking
    assert (run.reasoning, run.again) == (4 * 600, 0), run
    assert "| streamed (4) | continue | OK 4 | 4 |" in gateway_markdown([run])
