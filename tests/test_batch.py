import json

from fleet.cli.batchfile import output_line, parse_lines
from fleet.core.codes import Code
from fleet.core.models import Envelope, Usage

OPENAI = {"custom_id": "a1", "method": "POST", "url": "/v1/chat/completions",
          "body": {"model": "local", "messages": [{"role": "user", "content": "hi"}],
                   "thinking_token_budget": 1000, "max_completion_tokens": 1500,
                   "response_format": {"type": "json_schema", "json_schema": {
                       "name": "x", "schema": {"type": "object"}}}}}


def test_openai_lines_map_onto_jobs():
    [line] = parse_lines([json.dumps(OPENAI)], "reports")
    assert line.error is None and line.custom_id == "a1"
    job = line.job
    assert job.project == "reports" and job.thinking_budget == 1000
    assert job.content_reserve == 500 and job.response_schema == {"type": "object"}
    assert job.metadata["custom_id"] == "a1"


def test_fleet_job_lines_and_malformed_lines_are_per_line():
    lines = parse_lines([
        json.dumps({"messages": [{"role": "user", "content": "x"}], "band": "interactive"}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "colour": "red"}),
        json.dumps({**OPENAI, "url": "/v1/embeddings"}),
        json.dumps({"kind": "collect", "sources": [{"type": "text", "text": "material"}],
                    "custom_id": "mine"}),
    ], "triage")
    assert [bool(line.job) for line in lines] == [True, False, False, False, True]
    assert lines[4].custom_id == "mine" and lines[4].job.metadata["custom_id"] == "mine"
    assert lines[0].job.band == "interactive"
    assert "colour: unknown field" in lines[2].error
    assert "/v1/chat/completions" in lines[3].error
    row = output_line(lines[1], None, "local")
    assert row["code"] == "E_INPUT_INVALID" and row["response"] is None
    assert row["error"]["message"].startswith("line 2")


def test_output_line_has_openai_batch_shape_plus_code():
    [line] = parse_lines([json.dumps(OPENAI)], "reports")
    envelope = Envelope(job_id="j", project="reports", code=Code.OK, content='{"a":1}',
                        usage=Usage(prompt_tokens=5, completion_tokens=7, reasoning_tokens=3))
    row = output_line(line, envelope, "local")
    body = row["response"]["body"]
    assert row["custom_id"] == "a1" and row["code"] == "OK" and row["error"] is None
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == '{"a":1}'
    assert body["usage"]["total_tokens"] == 12
    failed = output_line(line, Envelope.failure("j", "reports", Code.E_THINK_LOOP, "looped"), "local")
    assert failed["response"] is None and failed["error"]["code"] == "E_THINK_LOOP"
