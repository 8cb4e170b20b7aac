"""Bounded work (fleet/core/limits.py, fleet/core/schema.py): every size cap refuses a job at
submit with E_INPUT_INVALID naming the setting and the value; patterns run on RE2, so a
backtracking-hostile pattern is checked in linear time and RE2-incompatible ones are refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from fleet.client import Client
from fleet.core.batchfile import parse_line
from fleet.core.config import LimitsSettings, ProjectSettings, load_settings
from fleet.core.errors import InputInvalid
from fleet.core.keys import job_ref
from fleet.core.limits import MAX_JSON_DEPTH, NestedTooDeep, loads, measure, too_deep
from fleet.core.models import Job
from fleet.core.schema import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, SchemaInvalid, check_schema
from fleet.core.signing import canonical
from fleet.infer.validate import check_answer

HOSTILE = "^(a|aa)*$"
# Python's re takes minutes on this (about 1.6x more per extra "a"); RE2 a few microseconds.
HOSTILE_TEXT = "a" * 60 + "b"
SMALL = LimitsSettings(max_message_bytes=4000, max_messages=2, max_metadata_bytes=100, max_sources=2,
                       max_source_text_bytes=50, max_tools=1)


@pytest.fixture
def client(redis_client: redis.Redis, key_prefix: str) -> Iterator[Client]:
    settings = load_settings(env={}, key_prefix=key_prefix, limits=SMALL.model_dump())
    with Client(settings, redis_client=redis_client) as made:
        yield made


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


TOOL = {"type": "function", "function": {"name": "search_docs"}}
OVER_CAPS: list[tuple[str, dict[str, Any], str]] = [
    ("max_messages", {"messages": [user("a"), user("b"), user("c")]}, "has 3 messages"),
    ("max_sources", {"kind": "collect", "sources": [{"type": "text", "text": "x"}] * 3}, "has 3 sources"),
    ("max_tools", {"tools": [TOOL, TOOL]}, "has 2 tools"),
    ("max_metadata_bytes", {"metadata": {"note": "x" * 200}}, "bytes of metadata"),
    ("max_source_text_bytes", {"kind": "collect", "sources": [{"type": "text", "text": "é" * 30}]},
     "has 60 bytes of inline source text"),
    ("max_message_bytes", {"messages": [user("x" * 5000)]}, "the message has at least"),
]


@pytest.mark.parametrize(("cap", "extra", "says"), OVER_CAPS, ids=[c[0] for c in OVER_CAPS])
def test_each_cap_refuses_at_submit_naming_the_limit(client: Client, cap: str, extra: dict[str, Any],
                                                     says: str) -> None:
    job = {"project": "reports", "messages": [user("hello")], **extra}
    with pytest.raises(InputInvalid) as info:
        client.submit(job)
    assert info.value.code.value == "E_INPUT_INVALID"
    assert f"limits.{cap} is {getattr(SMALL, cap)}" in info.value.message and says in info.value.message
    parsed = Job.model_validate(job)
    assert not client.results.job_record(job_ref(parsed.project, parsed.id))  # nothing sent or recorded


def test_a_job_within_every_cap_is_sent(client: Client) -> None:
    job_id = client.submit({"project": "reports", "messages": [user("a"), user("b")], "tools": [TOOL],
                            "metadata": {"k": "v"}})
    assert client.results.job_record(job_ref("reports", job_id))["state"] == "submitted"


@pytest.mark.parametrize("value", [
    {"a": [1, 2.5, None, True, False, "é\n\"x\""], "b": {}, "c": []},
    ["", {"k": {"k": [[], {}]}}],
    "plain",
])
def test_the_measure_is_the_canonical_json_size_without_escapes(value: Any) -> None:
    # escapes (\n, \") are the only difference from the real JSON: never more than it
    assert measure(value).bytes <= len(canonical(value).encode()) <= measure(value).bytes + 4


def test_the_measure_stops_at_the_cap_without_reading_the_rest() -> None:
    huge = {"job": {"messages": ["x" * 50_000_000]}}
    assert measure(huge, stop_bytes=1000).bytes > 1000  # stopped: the string is never encoded
    assert measure([[[[1]]]], stop_depth=2).depth == 3


# -- patterns on RE2 ---------------------------------------------------------------------------
def test_a_hostile_schema_pattern_is_checked_in_linear_time() -> None:
    job = Job(project="p", messages=[{"role": "user", "content": "x"}],
              response_schema={"type": "object", "properties": {"s": {"type": "string", "pattern": HOSTILE}},
                               "patternProperties": {HOSTILE: {"type": "integer"}}})
    checked = check_answer(f'{{"s": "{HOSTILE_TEXT}"}}', job, ProjectSettings(secret="s" * 8))
    assert not checked.ok and f"does not match {HOSTILE!r}" in checked.error
    # the property name goes through patternProperties (and additionalProperties) as well
    assert check_answer(f'{{"{HOSTILE_TEXT}": "not an int", "s": "aa"}}', job,
                        ProjectSettings(secret="s" * 8)).ok
    assert not check_answer('{"aaaa": "not an int"}', job, ProjectSettings(secret="s" * 8)).ok


def test_a_hostile_answer_pattern_is_checked_in_linear_time() -> None:
    project = ProjectSettings(secret="s" * 8, answer_pattern=HOSTILE)
    job = Job(project="p", messages=[{"role": "user", "content": "x"}])
    checked = check_answer(HOSTILE_TEXT, job, project)
    assert not checked.ok and HOSTILE in checked.error
    assert check_answer("first line\naaaa\nlast", job, project.model_copy(update={"answer_pattern": "^a+$"})).ok


def test_additional_properties_still_honour_pattern_properties() -> None:
    schema = {"type": "object", "patternProperties": {"^x_": {}}, "additionalProperties": False}
    job = Job(project="p", messages=[{"role": "user", "content": "x"}], response_schema=schema)
    project = ProjectSettings(secret="s" * 8)
    assert check_answer('{"x_1": 1}', job, project).ok
    checked = check_answer('{"x_1": 1, "y": 2}', job, project)
    assert not checked.ok and "'y'" in checked.error


@pytest.mark.parametrize("pattern", [r"(a)\1", "a(?=b)", "(?<!x)y"])
def test_patterns_re2_cannot_run_are_refused_at_submit_naming_them(client: Client, pattern: str) -> None:
    with pytest.raises(InputInvalid) as info:
        client.submit({"project": "reports", "messages": [user("x")],
                       "response_schema": {"type": "string", "pattern": pattern}})
    assert repr(pattern) in info.value.message and "not a valid regular expression" in info.value.message
    with pytest.raises(InputInvalid) as info:
        client.submit({"project": "reports", "messages": [user("x")],
                       "response_schema": {"type": "object", "patternProperties": {pattern: {}}}})
    assert repr(pattern) in info.value.message
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        ProjectSettings(secret="s" * 8, answer_pattern=pattern)


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_schema_depth_is_capped() -> None:
    check_schema(nested(MAX_SCHEMA_DEPTH // 2 - 1))  # each level is a mapping inside a mapping
    with pytest.raises(SchemaInvalid, match=f"nested deeper than {MAX_SCHEMA_DEPTH} levels"):
        check_schema(nested(900))  # deep enough to exhaust the recursion of an unbounded check


def test_schema_size_is_capped(client: Client) -> None:
    schema = {"type": "string", "enum": ["x" * 1000] * (MAX_SCHEMA_BYTES // 1000 + 1)}
    with pytest.raises(SchemaInvalid, match=f"at most {MAX_SCHEMA_BYTES} allowed"):
        check_schema(schema)
    with pytest.raises(ValidationError, match=f"at most {MAX_SCHEMA_BYTES} allowed"):
        ProjectSettings(secret="s" * 8, response_schema=schema)


def test_unevaluated_properties_with_pattern_properties_is_refused() -> None:
    # jsonschema would match those patterns with Python's re while evaluating unevaluatedProperties
    with pytest.raises(SchemaInvalid, match="unevaluatedProperties together with patternProperties"):
        check_schema({"patternProperties": {HOSTILE: {}}, "unevaluatedProperties": False})
    check_schema({"properties": {"a": {}}, "unevaluatedProperties": False})


# -- nesting -----------------------------------------------------------------------------------------
def brackets(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_json_past_the_depth_limit_is_refused_before_parsing_naming_the_field() -> None:
    assert loads(brackets(MAX_JSON_DEPTH)) and not too_deep(json.dumps(["[" * 1000]))  # strings are text
    assert not too_deep('{"a": "\\"[[[", "b": [[]]}')  # an escaped quote does not end a string
    for depth in (MAX_JSON_DEPTH + 1, 500, 100_000):  # parseable, or past Python's parser
        with pytest.raises(NestedTooDeep) as info:
            loads('{"ok": [1], "deep": {"x": ' + brackets(depth) + '}, "after": 2}')
        assert info.value.param == "deep" and f"deeper than {MAX_JSON_DEPTH}" in str(info.value)


def test_a_job_nested_too_deep_is_refused_at_submit_and_the_limit_itself_is_sent(
        redis_client: redis.Redis, key_prefix: str) -> None:
    client = Client(load_settings(env={}, key_prefix=key_prefix), redis_client=redis_client)
    # the job and its metadata take two levels
    limited = {"project": "reports", "messages": [user("a")],
               "metadata": {"a": json.loads(brackets(MAX_JSON_DEPTH - 2))}}
    assert client.submit(limited)
    deeper = {**limited, "metadata": {"a": json.loads(brackets(MAX_JSON_DEPTH - 1))}}
    with pytest.raises(InputInvalid, match=f"nested deeper than {MAX_JSON_DEPTH}"):
        client.submit(deeper)


def test_a_batch_line_nested_too_deep_is_an_error_line() -> None:
    line = parse_line('{"custom_id": "c", "messages": ' + brackets(100_000) + "}", "reports", 3)
    assert line.job is None and line.error and "line 3" in line.error and "nested deeper" in line.error


def test_an_answer_nested_too_deep_fails_its_check_instead_of_the_worker() -> None:
    job = Job(project="p", messages=[user("x")], response_schema={"type": "array"})
    checked = check_answer(brackets(100_000), job, ProjectSettings(secret="s" * 16))
    assert not checked.ok and "nested deeper" in (checked.error or "")
