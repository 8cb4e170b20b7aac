"""Output checks: JSON Schema and the project's text rules."""

from __future__ import annotations

import subprocess
import sys

import pytest
from jsonschema import Draft7Validator, Draft202012Validator
from pydantic import ValidationError

from fleet.core.config import ProjectSettings
from fleet.core.models import Job, Message, describe_invalid
from fleet.core.schema import SchemaInvalid, check_schema
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


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "objekt"}, "$.type"),
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "([a-z"}}}, "pattern"),
    ({"type": "object", "patternProperties": {"(unclosed": {"type": "string"}}}, "(unclosed"),
    ({"type": "object", "required": "total"}, "$.required"),
    ({"$schema": "https://example.invalid/draft-99", "type": "object"}, "draft-99"),
])
def test_unusable_schemas_are_refused_with_the_problem_named(schema: dict, named: str) -> None:
    with pytest.raises(SchemaInvalid) as info:
        check_schema(schema)
    assert named in str(info.value)
    with pytest.raises(ValidationError) as invalid:
        job(response_schema=schema)
    assert "response_schema" in describe_invalid(invalid.value) and named in describe_invalid(invalid.value)
    with pytest.raises(ValidationError):
        ProjectSettings(secret="s" * 8, response_schema=schema)


def test_the_schema_draft_follows_dollar_schema() -> None:
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
              "items": [{"type": "number"}], "additionalItems": False}
    # the draft's own class with the RE2 pattern keywords (fleet/core/schema.py)
    assert check_schema(draft7).META_SCHEMA == Draft7Validator.META_SCHEMA
    assert check_schema(SCHEMA).META_SCHEMA == Draft202012Validator.META_SCHEMA
    j = job(response_schema=draft7)
    assert check_answer("[1]", j, PROJECT).ok
    assert "$" in check_answer("[1, 2]", j, PROJECT).error  # draft-07 tuple items, not 2020-12


def test_project_answer_pattern_must_compile() -> None:
    with pytest.raises(ValidationError) as info:
        ProjectSettings(secret="s" * 8, answer_pattern="(unclosed")
    assert "not a valid regular expression" in str(info.value)


def test_a_pathological_fenced_answer_is_checked_in_linear_time() -> None:
    """An opening fence, 20,000 newlines and no closing fence: the fence regex this replaced backtracked
    cubically (7 s at 2,000 newlines, 52 s at 4,000), holding the GIL and every lease of its
    worker. Run in a child process so that the old behaviour fails on the safety net instead of
    hanging the suite; the bound is hours away from what the linear scan takes."""
    code = (
        "from fleet.core.config import ProjectSettings\n"
        "from fleet.core.models import Job, Message\n"
        "from fleet.infer.validate import check_answer\n"
        f"job = Job(project='p', messages=[Message(role='user', content='x')], response_schema={SCHEMA!r})\n"
        "answer = '```json\\n' + '\\n' * 20000 + 'x'\n"
        "print(check_answer(answer, job, ProjectSettings(secret='s' * 8)).error)\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("checking a 20 KB fenced answer did not finish: a backtracking scan")
    assert done.returncode == 0, done.stderr
    assert "not valid JSON" in done.stdout
