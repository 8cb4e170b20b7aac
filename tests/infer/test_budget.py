"""Thinking-budget planning and its adaptive growth."""

from __future__ import annotations

from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.models import Job, Message
from fleet.infer.budget import grow_budget, grow_reserve, plan

CFG = load_settings(EXAMPLE_CONFIG, env={}, backend={"max_model_len": 40_000})
REPORTS = CFG.projects["reports"]  # budget 10000, reserve 2048


def job(**fields: object) -> Job:
    return Job(project="reports", messages=[Message(role="user", content="x")], **fields)


def test_project_defaults_and_job_overrides() -> None:
    p = plan(job(), REPORTS, CFG, 1000)
    assert (p.thinking_budget, p.content_reserve, p.max_tokens) == (10_000, 2048, 12_048)
    assert p.room_tokens == 40_000 - 12_048 and p.fits
    p = plan(job(thinking_budget=500, content_reserve=100), REPORTS, CFG, 1000)
    assert p.max_tokens == 600


def test_prompt_that_does_not_fit() -> None:
    p = plan(job(), REPORTS, CFG, 30_000)
    assert not p.fits and p.room_tokens == 27_952
    capped = REPORTS.model_copy(update={"prompt_budget_tokens": 5000})
    p = plan(job(), capped, CFG, 6000)
    assert p.room_tokens == 5000 and not p.fits


def test_unlimited_budget_uses_the_ceiling() -> None:
    p = plan(job(thinking_budget=-1), REPORTS, CFG, 1000)
    assert p.thinking_budget == -1
    assert p.max_tokens == CFG.retry.thinking_budget_ceiling + 2048
    assert grow_budget(p, 99_999) == p


def test_growth_is_bounded_by_ceiling_and_context() -> None:
    p = plan(job(thinking_budget=1000), REPORTS, CFG, 1000)
    g = grow_budget(p, 32_768)
    assert g.thinking_budget == 2024 and g.max_tokens == 2024 + 2048  # max(x2, +1024)
    g = grow_budget(plan(job(thinking_budget=20_000), REPORTS, CFG, 1000), 32_768)
    assert g.prompt_tokens + g.max_tokens <= 40_000 and g.thinking_budget > 20_000
    assert grow_budget(plan(job(thinking_budget=3000), REPORTS, CFG, 1000), 3000).thinking_budget \
        == 3000
    r = grow_reserve(p)
    assert r.content_reserve == 4096 and r.thinking_budget == 1000 and r.max_tokens == 5096
    big = plan(job(thinking_budget=30_000, content_reserve=8000), REPORTS, CFG, 1000)
    assert big.prompt_tokens + grow_reserve(big).max_tokens <= 40_000


def test_a_client_limit_lowers_the_thinking_so_the_reserve_fits() -> None:
    p = plan(job(max_tokens=5000), REPORTS, CFG, 1000)
    assert (p.thinking_budget, p.content_reserve, p.max_tokens, p.limit) == (5000 - 2048, 2048, 5000, 5000)
    assert p.room_tokens == 40_000 - 5000
    assert plan(job(max_tokens=20_000), REPORTS, CFG, 1000).max_tokens == 12_048  # only ever lowers
    unlimited = plan(job(max_tokens=3000, thinking_budget=-1), REPORTS, CFG, 1000)
    assert (unlimited.thinking_budget, unlimited.max_tokens) == (952, 3000)
    assert plan(job(max_tokens=2048), REPORTS, CFG, 1000).thinking_budget == 0


def test_a_limit_below_the_reserve_leaves_no_thinking_and_all_of_it_to_the_answer() -> None:
    p = plan(job(max_tokens=500), REPORTS, CFG, 1000)
    assert (p.thinking_budget, p.content_reserve, p.max_tokens, p.limit) == (0, 500, 500, 500)
    assert grow_reserve(p).max_tokens == 500  # an empty answer's retry stays within the limit


def test_growth_never_passes_the_client_limit() -> None:
    p = plan(job(max_tokens=6000, thinking_budget=2500), REPORTS, CFG, 1000)
    assert p.max_tokens == 4548
    assert grow_budget(p, 99_999).max_tokens == 6000  # 5,000 wanted, 3,952 left
    assert grow_reserve(grow_budget(p, 99_999)).max_tokens == 6000
