"""What a fleet task shows when it ends (fleet/worker/outcome.py): its line, the failure of a job that
ended with a code, and the closing event Flower reads. The browser test drives the same through a
real fleet and Flower (tests/e2e/test_flower_browser.py)."""

from __future__ import annotations

import pytest
from celery.utils.saferepr import saferepr

from fleet.core.codes import Code
from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.models import Attempt, Envelope, Usage
from fleet.worker.outcome import (
    CONTINUED_EVENT,
    JobEnded,
    backend_label,
    continued_detail,
    ended_detail,
    ended_event,
    task_outcome,
)


def test_an_ok_turn_names_its_code_turn_attempts_tokens_and_backend() -> None:
    envelope = Envelope(job_id="j1", project="triage", code=Code.OK, content="the answer text",
                        usage=Usage(prompt_tokens=120, completion_tokens=812),
                        attempts=[Attempt(number=1, code=Code.E_THINK_LOOP), Attempt(number=2, code=Code.OK)])
    line = task_outcome("OK", "j1", ended_detail(envelope, 1, "local@10.0.0.5:8100"))
    assert line == "OK job=j1 turn=1 attempts=2 tokens=120+812 backend=local@10.0.0.5:8100"
    assert "answer text" not in line


def test_a_job_ended_with_a_code_fails_with_the_code_and_its_meaning_never_the_message() -> None:
    with pytest.raises(JobEnded) as raised:
        task_outcome("E_OUTPUT_INVALID", "j2", "turn=0")
    text = str(raised.value)
    assert text == f"E_OUTPUT_INVALID job=j2: {Code.E_OUTPUT_INVALID.info.meaning} turn=0"
    # what Celery's task-failed event carries as the exception: the line, not JobEnded('...')
    assert saferepr(raised.value) == repr(raised.value) == text


def test_the_backend_is_shown_without_credentials_or_path() -> None:
    settings = load_settings(EXAMPLE_CONFIG, env={"FLEET_BACKEND_URL": "http://ops:s3cret@gpu-1:8100/x"})
    assert backend_label(settings) == f"{settings.backend.model}@gpu-1:8100"


def test_a_handed_on_turn_closes_with_a_continued_event() -> None:
    result = saferepr(task_outcome("continued", "j3", continued_detail(0, "carry", Code.E_THINK_LOOP)))
    assert result == "'continued job=j3 turn=0 next=carry cause=E_THINK_LOOP'"
    kind, fields = ended_event("task-succeeded", {"result": result, "runtime": 0.2}, None)
    assert kind == CONTINUED_EVENT and fields == {"result": result, "runtime": 0.2}
    ok = saferepr("OK job=j3 turn=1")
    assert ended_event("task-succeeded", {"result": ok}, None) == ("task-succeeded", {"result": ok})


def test_a_failed_job_closes_with_its_line_as_exception_traceback_and_result() -> None:
    line = "E_THINK_LOOP job=j4: The reasoning looped"
    kind, fields = ended_event("task-failed", {"exception": line, "traceback": "Traceback (most recent...)"},
                               line)
    assert kind == "task-failed" and fields == {"exception": line, "traceback": line, "result": line}
    # any other failure (a bug) keeps Celery's own exception and traceback
    other = {"exception": "KeyError('x')", "traceback": "Traceback (most recent call last): ..."}
    assert ended_event("task-failed", other, None) == ("task-failed", other)


def test_a_model_turn_closes_naming_which_turn_it_was() -> None:
    result = saferepr("OK job=j5 turn=2 attempts=3 tokens=1+2 backend=local@h:1")
    assert ended_event("task-succeeded", {"result": result}, None, "turn")[1]["args"] == "turn 2"
    line = "E_THINK_LOOP job=j5: The reasoning looped turn=1 attempts=2"
    assert ended_event("task-failed", {}, line, "turn")[1]["args"] == "turn 1"
    # a prep task keeps its kind; a turn dropped as stale names no number and keeps "turn"
    assert "args" not in ended_event("task-succeeded", {"result": "'pending job=j5'"}, None, "prep")[1]
    assert "args" not in ended_event("task-succeeded", {"result": "'stale job=j5'"}, None, "turn")[1]


def test_a_sender_s_job_id_stays_one_short_line() -> None:
    """A raw prep message's job id is the sender's: a newline in it must not start a forged log
    line (Celery logs the failure's repr), nor a megabyte of it fill the log and the events."""
    forged = "x\n2026-12-02 10:00:00,000 ERROR Task fleet.infer failed project=research" + "y" * 10_000
    with pytest.raises(JobEnded) as ended:
        task_outcome(Code.E_AUTH.value, forged)
    shown = repr(ended.value)
    assert "\n" not in shown and "\\n" in shown
    assert len(shown) < 400
    assert "\n" not in task_outcome("pending", forged) and len(task_outcome("pending", forged)) < 120
