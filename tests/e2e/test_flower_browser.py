"""Flower's Tasks page as an operator sees it, in a real headless Chromium (tests/support/browser.py)
against a real fleet (simulator, dispatcher, worker, Flower started by ``fleet flower``) that ran
jobs of two projects: one answered, one that looped on every attempt, one cancelled while it ran.

The list must say what each task is and for whom (kind, project, job), the code a job ended with,
the turns that handed a job on as CONTINUED, and Flower's search box must find the failed job by
its code, with the code's meaning, not a Python traceback, as the failure. Job texts never show.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fleet.core.codes import Code
from fleet.local.embedded import free_port
from fleet.local.processes import wait_http
from tests.support.browser import chromium
from tests.support.fleet_harness import Harness, make_config
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first run may install Chromium

SECRET = f"confidential-{uuid.uuid4().hex}"


def ask(project: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"project": project, "messages": [{"role": "user", "content": f"{text} {SECRET}"}],
            "thinking_budget": 2000, **extra}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:  # first: skips before any fleet starts where no browser can run
        yield driver


@pytest.fixture(scope="module")
def flower_fleet(tmp_path_factory: pytest.TempPathFactory, browser: Any) -> Iterator[tuple[str, dict[str, str]]]:
    """The fleet and its Flower, after the three jobs ended: (Flower's address, {what: job id})."""
    harness = Harness(make_config(tmp_path_factory.mktemp("flower")), sim_speed=100)
    with harness:
        port = free_port()
        harness.fleet.spawn("flower", ["flower", "--port", str(port)])
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthcheck", 120)
        # Flower keeps only the events it saw: wait until it hears the worker before any job
        wait_until(lambda: httpx.get(f"{base}/workers?json=1", timeout=10).json()["data"], 60,
                   "Flower to hear the worker")
        client = harness.client
        jobs = {"good": client.submit(ask("triage", "[sim:think=50] [sim:answer=10] fine")),
                "loop": client.submit(ask("reports", "[sim:loop] think forever")),
                "cancelled": client.submit(ask("reports", "[sim:stall=100000] wait"))}
        wait_until(lambda: client.status(jobs["cancelled"]).get("state") == "running", 60,
                   "the stalled job to run")
        client.cancel(jobs["cancelled"])
        codes = {what: client.result(job, timeout=120).code for what, job in jobs.items()}
        assert codes == {"good": Code.OK, "loop": Code.E_THINK_LOOP, "cancelled": Code.E_CANCELLED}
        yield base, jobs


ROWS = """return Array.from(document.querySelectorAll('#tasks-table tbody tr'))
    .filter(row => !row.querySelector('td.dt-empty')).map(row => row.innerText)"""
FAILED_TASK_LINK = """const link = document.querySelector("#tasks-table tbody tr a[href*='/task/']");
    return link ? link.href : null"""


def open_tasks(driver: Any, base: str) -> None:
    """Flower's Tasks page with 100 rows a page (its own page-length menu)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(f"{base}/tasks")
    menu = wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "select[aria-label='Tasks per page']"),
                      30, "the Tasks page's page-length menu")
    Select(menu[0]).select_by_value("100")


def rows(driver: Any) -> list[str]:
    """The text of each row the Tasks table shows now (read in one go: the table redraws)."""
    return list(driver.execute_script(ROWS))


def test_the_tasks_list_names_project_job_kind_and_code(browser: Any, flower_fleet: tuple[str, dict[str, str]]) -> None:
    base, jobs = flower_fleet
    open_tasks(browser, base)
    # the loop job's turns: its prep, two turns handed on, the last one failed (retry.max_attempts 3)
    wait_until(lambda: sum(jobs["loop"] in row for row in rows(browser)) >= 4
               and any("E_CANCELLED" in row for row in rows(browser)), 60,
               "Flower's list to show every turn of the loop job and the cancelled one")
    shown = rows(browser)
    good = [row for row in shown if jobs["good"] in row]
    assert any("fleet.infer\tturn 0\t" in row and f"project=triage job={jobs['good']}" in row
               and "SUCCESS" in row and f"OK job={jobs['good']} turn=0 attempts=1" in row
               and "backend=" in row and "tokens=" in row for row in good), "\n".join(good)
    assert any("fleet.prep" in row and "\tprep\t" in row and "SUCCESS" in row for row in good), "\n".join(shown)
    loop = [row for row in shown if jobs["loop"] in row]
    continued = [row for row in loop if "CONTINUED" in row]
    assert len(continued) == 2 and all(f"continued job={jobs['loop']}" in row and "next=carry" in row
                                       and "cause=E_THINK_LOOP" in row for row in continued), loop
    assert not any("SUCCESS" in row for row in loop if "fleet.infer" in row), loop  # no bare green turn
    # each turn of the loop job names which turn it was: 0 and 1 handed on, 2 failed
    assert sorted(row.split("\t")[1] for row in loop if row.startswith("fleet.infer")) == [
        "turn 0", "turn 1", "turn 2"], loop
    cancelled = [row for row in shown if jobs["cancelled"] in row]
    assert any("FAILURE" in row and f"E_CANCELLED job={jobs['cancelled']}" in row for row in cancelled)
    assert any("fleet.cancel" in row and "cancel" in row for row in cancelled), cancelled
    assert SECRET not in browser.page_source and "sim:" not in browser.page_source


def test_the_search_box_finds_the_failed_job_by_its_code(browser: Any,
                                                         flower_fleet: tuple[str, dict[str, str]]) -> None:
    from selenium.webdriver.common.by import By

    base, jobs = flower_fleet
    open_tasks(browser, base)
    wait_until(lambda: len(rows(browser)) >= 8, 60, "Flower's list")
    box = browser.find_element(By.CSS_SELECTOR, "#tasks-table_filter input, input[type=search]")
    box.clear()
    box.send_keys("E_THINK_LOOP state:FAILURE")
    found = wait_until(lambda: (lambda r: r if r and all(jobs["loop"] in row for row in r) else None)(
        rows(browser)), 30, "the search to leave only the failed loop job")
    [row] = found
    assert "FAILURE" in row and f"project=reports job={jobs['loop']}" in row
    assert Code.E_THINK_LOOP.info.meaning[:40] in row and "turn=2 attempts=3" in row
    # the task's own page: the code and its meaning stand where a traceback would
    browser.get(browser.execute_script(FAILED_TASK_LINK))
    wait_until(lambda: "/task/" in browser.current_url and "E_THINK_LOOP" in browser.page_source, 30,
               "the failed task's page")
    page = browser.page_source
    assert "Traceback (most recent call last)" not in page and "JobEnded(" not in page
    assert SECRET not in page
