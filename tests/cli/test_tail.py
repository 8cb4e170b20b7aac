"""``fleet tail``'s lines for continuations, backoffs and tool rounds (fleet/cli/tail.py)."""

from __future__ import annotations

from fleet.cli.tail import describe


def test_continuations_backoffs_and_tool_rounds_read_as_words() -> None:
    assert describe("retry", {"after": 1, "cause": "E_UPSTREAM_ERROR", "how": "backoff",
                              "delay_s": 1.5}) == (
        "[bold]retry[/bold] after attempt 1: E_UPSTREAM_ERROR, backoff, backoff 1.5 s")
    assert describe("continuation", {"how": "outage", "delay_s": 2.0, "max_tokens": 900}) == (
        "[bold]continuation[/bold]: slot given up, back in line (backend unavailable, "
        "not before +2.0 s, max_tokens 900)")
    assert describe("tool_round", {"number": 2, "calls": ["search_docs", "run_query"],
                                   "invalid": 1, "timeout_s": 30}) == (
        "[bold]tool round 2[/bold]: search_docs, run_query, 1 invalid; timeout 30 s")
    assert describe("tool_results", {"number": 2, "results": 1, "duration_s": 0.8}) == (
        "[bold]tool round 2 done[/bold]: 1 results after 0.8 s")
    assert describe("admitted", {"queued_s": 0.1}) == '[bold]admitted[/bold] {"queued_s": 0.1}'
