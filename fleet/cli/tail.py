"""``fleet tail``: one line per job event; continuations, backoffs and tool rounds in words.

A job that needs another model turn leaves the worker and re-enters admission
(fleet/infer/attempts.py): ``retry`` says why and how, ``continuation`` that it is back in line
(and not before when: its backoff, or its tools' timeout), ``tool_round`` / ``tool_result`` /
``tool_results`` follow a tool round (fleet/infer/tools.py). Other events print as JSON.
"""

from __future__ import annotations

import json
from typing import Any

_HOW = {"carry": "loop cut, carry-over", "budget": "larger thinking budget",
        "reserve": "larger answer reserve", "reask": "re-ask with the error",
        "backoff": "backoff", "outage": "backend unavailable", "tool": "tools running"}


def describe(kind: str, data: Any) -> str:
    """The line ``fleet tail`` prints for one event (rich markup)."""
    d = data if isinstance(data, dict) else {}
    if kind == "retry":
        return (f"[bold]retry[/bold] after attempt {d.get('after')}: {d.get('cause')}, "
                f"{_HOW.get(d.get('how', ''), d.get('how'))}, backoff {d.get('delay_s')} s")
    if kind == "continuation":
        wait = f", not before +{d.get('delay_s')} s" if d.get("delay_s") else ""
        return (f"[bold]continuation[/bold]: slot given up, back in line "
                f"({_HOW.get(d.get('how', ''), d.get('how'))}{wait}, max_tokens {d.get('max_tokens')})")
    if kind == "tool_round":
        invalid = f", {d.get('invalid')} invalid" if d.get("invalid") else ""
        return (f"[bold]tool round {d.get('number')}[/bold]: {', '.join(d.get('calls') or [])}"
                f"{invalid}; timeout {d.get('timeout_s')} s")
    if kind == "tool_result":
        state = "ok" if d.get("ok") else "failed"
        return (f"[bold]tool result[/bold] round {d.get('number')} {d.get('name')}: {state} "
                f"in {d.get('duration_s')} s")
    if kind == "tool_results":
        return (f"[bold]tool round {d.get('number')} done[/bold]: {d.get('results')} results "
                f"after {d.get('duration_s')} s")
    return f"[bold]{kind}[/bold] {json.dumps(data)}"
