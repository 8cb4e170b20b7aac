"""Output checks: JSON Schema and the project's text rules."""

from __future__ import annotations

from fleet.core.config import ProjectSettings
from fleet.core.models import Job, Message
from fleet.infer.validate import check_answer, reask_message, response_format

SCHEMA = {"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}
PROJECT = ProjectSettings(secret="s" * 8)


def job(**fields: object) -> Job:
    return Job(project="p", messages=[Message(role="user", content="x")], **fields)


def test_schema_is_sent_and_checked() -> None:
    j = job(response_schema=SCHEMA)
    assert response_format(j, PROJECT)["json_schema"]["schema"] == SCHEMA  # type: ignore[index]
    assert response_format(job(), PROJECT) is None
    ok = check_answer('{"total": 3}', j, PROJECT)
    assert ok.ok and ok.parsed == {"total": 3}
    assert check_answer('```json\n{"total": 3}\n```', j, PROJECT).parsed == {"total": 3}
    bad = check_answer('{"total": "three"}', j, PROJECT)
    assert not bad.ok and "$.total" in bad.error and "number" in bad.error
    assert "not valid JSON" in check_answer("{total", j, PROJECT).error
    assert "required schema" in reask_message(bad.error, True)


def test_project_schema_and_text_rules() -> None:
    project = ProjectSettings(secret="s" * 8, response_schema=SCHEMA)
    assert not check_answer("{}", job(), project).ok
    rules = ProjectSettings(secret="s" * 8, min_answer_chars=5, max_answer_chars=20,
                            answer_pattern=r"^ANSWER:")
    assert "at least 5" in check_answer("  ab  ", job(), rules).error
    assert "at most 20" in check_answer("ANSWER: " + "x" * 30, job(), rules).error
    assert "pattern" in check_answer("the answer is 4", job(), rules).error
    assert check_answer("ANSWER: 4", job(), rules).ok
