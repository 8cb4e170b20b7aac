"""Thinking-budget planning: how many tokens a job may think, answer and send.

    thinking_budget  job.thinking_budget, else the project's (-1: unlimited); lowered to
                     ``limit - content_reserve`` when the job's limit leaves less
    content_reserve  job.content_reserve, else the project's: tokens kept for the answer
    max_tokens       thinking_budget + content_reserve; with an unlimited budget, the retry
                     ceiling (``retry.thinking_budget_ceiling``) + reserve, so a runaway thought
                     still ends and the prompt limit stays computable
    limit            job.max_tokens: the completion limit a client set (OpenAI's ``max_tokens``
                     or ``max_completion_tokens``, on the gateway's chat and on a batch line);
                     max_tokens never passes it, adaptive growth included
    room_tokens      max_model_len - max_tokens, and at most project.prompt_budget_tokens:
                     the prompt limit the trimmer (fleet/prep/trim.py) must meet
    fits             prompt_tokens <= room_tokens

vLLM forces ``</think>`` when the budget is spent, but the answer still needs its own tokens: with
``max_tokens`` below budget + reserve the answer comes back empty (docs/deployment.md). A prompt
that does not fit even after trimming ends ``E_PROMPT_TOO_LONG`` with these numbers, before reaching vLLM.

Adaptive retries change a plan without touching the prompt: ``grow_budget`` (a forced end of
thinking gave an empty or invalid answer) doubles the budget up to a ceiling; ``grow_reserve`` (an
empty answer) doubles the reserve. Both keep ``prompt_tokens + max_tokens <= max_model_len``
(and ``max_tokens <= limit``).

A client's limit only ever lowers the plan, and it is the thinking that gives way: the content
reserve is what keeps the answer from coming back empty. A limit below the reserve leaves no room
to think: the thinking budget is 0 (the model closes its reasoning at once) and the whole limit
goes to the answer, so a client asking for a short answer gets one, never an empty answer after a
cut reasoning (and never a refusal its SDK cannot act on). This is the one planner: prep
(fleet/worker/jobs/prep.py) and the gateway's chat (fleet/gateway/app.py ``build_body``) both
call ``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fleet.core.config import ProjectSettings, Settings
from fleet.core.models import Job

UNLIMITED = -1
MIN_GROWTH_TOKENS = 1024


@dataclass(frozen=True)
class Plan:
    thinking_budget: int
    content_reserve: int
    max_tokens: int
    prompt_tokens: int
    fits: bool
    room_tokens: int
    max_model_len: int
    prompt_budget_tokens: int | None = None
    # of prompt_tokens, the stable prefix (fleet/core/promptcache.py records it when sent)
    prefix_tokens: int = 0
    limit: int | None = None  # the client's completion limit (job.max_tokens)


def plan(job: Job, project: ProjectSettings, settings: Settings, prompt_tokens: int,
         prefix_tokens: int = 0) -> Plan:
    """The plan of ``job``, within its completion limit when it has one."""
    budget = job.thinking_budget if job.thinking_budget is not None else project.thinking_budget
    reserve = job.content_reserve if job.content_reserve is not None else project.content_reserve
    ceiling = settings.retry.thinking_budget_ceiling
    limit = job.max_tokens
    if limit is not None:
        budget, reserve = _within(budget, reserve, limit, ceiling)
    built = _build(
        budget, reserve, prompt_tokens, settings.backend.max_model_len,
        project.prompt_budget_tokens, ceiling,
    )
    return replace(built, prefix_tokens=prefix_tokens, limit=limit)


def _within(budget: int, reserve: int, limit: int, ceiling: int) -> tuple[int, int]:
    """(thinking budget, content reserve) lowered so that they fit ``limit``: the thinking first;
    below the reserve, no thinking and the whole limit for the answer."""
    if limit < reserve:
        return 0, limit
    thinking = ceiling if budget == UNLIMITED else budget
    return (limit - reserve if thinking + reserve > limit else budget), reserve


def _build(
    budget: int, reserve: int, prompt_tokens: int, max_model_len: int,
    prompt_budget: int | None, ceiling: int,
) -> Plan:
    thinking = ceiling if budget == UNLIMITED else budget
    max_tokens = thinking + reserve
    room = max_model_len - max_tokens
    if prompt_budget is not None:
        room = min(room, prompt_budget)
    return Plan(
        thinking_budget=budget,
        content_reserve=reserve,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        fits=0 <= prompt_tokens <= room,
        room_tokens=room,
        max_model_len=max_model_len,
        prompt_budget_tokens=prompt_budget,
    )


def _headroom(p: Plan) -> int:
    """Tokens max_tokens may still grow by without the prompt overflowing max_model_len, nor
    max_tokens passing the client's limit."""
    room = p.max_model_len - p.prompt_tokens - p.max_tokens
    if p.limit is not None:
        room = min(room, p.limit - p.max_tokens)
    return max(0, room)


def _grown(value: int) -> int:
    return max(value * 2, value + MIN_GROWTH_TOKENS)


def grow_budget(p: Plan, ceiling: int) -> Plan:
    """A larger thinking budget (doubled, at most ``ceiling``); unchanged when unlimited/at top."""
    if p.thinking_budget == UNLIMITED:
        return p
    target = min(_grown(p.thinking_budget), max(ceiling, p.thinking_budget))
    budget = min(target, p.thinking_budget + _headroom(p))
    return _replan(p, budget, p.content_reserve)


def grow_reserve(p: Plan) -> Plan:
    """A larger content reserve (doubled), within what max_model_len leaves."""
    reserve = min(_grown(p.content_reserve), p.content_reserve + _headroom(p))
    return _replan(p, p.thinking_budget, reserve)


def _replan(p: Plan, budget: int, reserve: int) -> Plan:
    thinking = p.max_tokens - p.content_reserve if p.thinking_budget == UNLIMITED else budget
    max_tokens = thinking + reserve
    room = p.max_model_len - max_tokens
    if p.prompt_budget_tokens is not None:
        room = min(room, p.prompt_budget_tokens)
    return replace(
        p, thinking_budget=budget, content_reserve=reserve, max_tokens=max_tokens,
        room_tokens=room,
    )
