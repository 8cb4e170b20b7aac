"""``GET /v1/organization/usage/completions``: a project reads its own usage ledger with its own
API key, in the shape of OpenAI's organization usage API (a page of time buckets, each with its
results). The caller's project is the only one it ever reads: its key names it; no parameter
can name another (``project_ids`` without the caller's own gives empty buckets).

Query (OpenAI's names): ``start_time`` (unix s, required), ``end_time`` (default now),
``bucket_width`` ``1h`` | ``1d`` (default ``1d``; the ledger is hourly, so no ``1m``),
``group_by`` ``api_key_id`` | ``model`` | ``project_id`` (repeatable, or ``group_by[]``),
``api_key_ids`` / ``models`` filters, ``project_ids``, ``limit`` (buckets per page; 1h: default
24, at most 168; 1d: default 7, at most 31) and ``page`` (the cursor ``next_page`` gave).
Anything else OpenAI has (``user_ids``, ``batch``) is 400 ``E_INPUT_INVALID``: the fleet has no
users and counts batch lines under their key like any other request of it.

Each result: ``input_tokens`` (prompt), ``input_cached_tokens``, ``output_tokens`` (reasoning +
answer), ``num_model_requests`` (model turns), the audio fields at 0, the group fields, and
``fleet``: reasoning and answer tokens, cut turns, loop cuts and their tokens, tool rounds, the
turns by message code (docs/usage.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fleet.core.errors import InputInvalid
from fleet.core.usage import HourCounts
from fleet.core.usagereport import BUCKET_WIDTHS_S, Group, buckets

if TYPE_CHECKING:
    from fleet.gateway.app import Gateway
    from fleet.gateway.auth import Caller

LIMITS = {"1h": (24, 168), "1d": (7, 31)}  # (default, most) buckets per page, as OpenAI's
GROUP_FIELDS = {"api_key_id": "key", "model": "model", "project_id": "project"}
UNSUPPORTED = ("user_ids", "user_ids[]", "batch")


def _list(request: Request, name: str) -> list[str]:
    query = request.query_params
    return [*query.getlist(name), *query.getlist(f"{name}[]")]


def _int(request: Request, name: str, default: int | None = None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        if default is None:
            raise InputInvalid(f"{name} is required (unix seconds)", param=name)
        return default
    try:
        return int(raw)
    except ValueError:
        raise InputInvalid(f"{name}: an integer, not {raw[:40]!r}", param=name) from None


class UsageQuery:
    """The parameters of one request, checked (every failure a 400 ``E_INPUT_INVALID``)."""

    def __init__(self, request: Request) -> None:
        for name in UNSUPPORTED:
            if name in request.query_params:
                raise InputInvalid(f"{name} is not supported: the fleet counts by project, API key "
                                   "and model (docs/gateway.md)", param=name.rstrip("[]"))
        self.width = request.query_params.get("bucket_width", "1d")
        if self.width not in BUCKET_WIDTHS_S:
            raise InputInvalid(f"bucket_width: 1h or 1d (the ledger is hourly), not {self.width[:20]!r}",
                               param="bucket_width")
        self.start = _int(request, "start_time")
        self.end = _int(request, "end_time", int(time.time()))
        if self.start < 0 or self.end <= self.start:
            raise InputInvalid("start_time must be before end_time", param="start_time")
        default, most = LIMITS[self.width]
        self.limit = _int(request, "limit", default)
        if not 1 <= self.limit <= most:
            raise InputInvalid(f"limit: 1 to {most} buckets of {self.width}", param="limit")
        self.page = _int(request, "page", self.start)
        self.group_by = _list(request, "group_by")
        unknown = sorted(set(self.group_by) - set(GROUP_FIELDS))
        if unknown:
            raise InputInvalid(f"group_by: {', '.join(GROUP_FIELDS)}; not {', '.join(unknown)[:60]}",
                               param="group_by")
        self.keys, self.models = set(_list(request, "api_key_ids")), set(_list(request, "models"))
        self.projects = set(_list(request, "project_ids"))

    def wants(self, cell: HourCounts) -> bool:
        return ((not self.keys or cell.key in self.keys)
                and (not self.models or cell.model in self.models))


def _result(project: str, group: Group, query: UsageQuery) -> dict[str, Any]:
    m = group.metric
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": m("prompt_tokens"), "input_cached_tokens": m("cached_tokens"),
        "output_tokens": m("reasoning_tokens") + m("answer_tokens"),
        "input_audio_tokens": 0, "output_audio_tokens": 0, "num_model_requests": m("requests"),
        "project_id": project if "project_id" in query.group_by else None,
        "user_id": None, "api_key_id": group.key, "model": group.model, "batch": None,
        "fleet": {"reasoning_tokens": m("reasoning_tokens"), "answer_tokens": m("answer_tokens"),
                  "cut_turns": m("cut_turns"), "loop_cuts": m("loop_cuts"),
                  "loop_cut_tokens": m("loop_cut_tokens"), "tool_rounds": m("tool_rounds"),
                  "codes": group.codes},
    }


def page_range(query: UsageQuery) -> tuple[int, int]:
    """The span of the page's buckets: from ``page`` (or ``start_time``), at most ``limit`` of them."""
    width_s = BUCKET_WIDTHS_S[query.width]
    first = max(query.start, query.page)
    first -= first % width_s
    return first, min(query.end, first + query.limit * width_s)


def usage_page(project: str, cells: list[HourCounts], query: UsageQuery) -> dict[str, Any]:
    """The page of buckets from ``query.page`` on (at most ``query.limit``): only the page's
    buckets are ever made, whatever span the query names."""
    width_s = BUCKET_WIDTHS_S[query.width]
    first, last = page_range(query)
    grouped = [GROUP_FIELDS[g] for g in query.group_by if g != "project_id"]
    wanted = [c for c in cells if query.wants(c)] if project in query.projects or not query.projects else []
    shown = buckets(wanted, max(first, query.start), last, width_s, grouped) if first < last else []
    more = last < query.end
    data = [{"object": "bucket", "start_time": b.start, "end_time": b.end,
             "results": [_result(project, g, query) for g in b.groups]} for b in shown]
    return {"object": "page", "data": data, "has_more": more,
            "next_page": str(last) if more else None}


class UsageRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def completions(self, request: Request, caller: Caller) -> Response:
        query = UsageQuery(request)
        first, last = page_range(query)
        cells = await self.gw.run(self.gw.runtime.ledger.read, caller.project, first, last)
        return JSONResponse(usage_page(caller.project, cells, query))
