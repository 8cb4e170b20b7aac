import json

from fleet.core.batchfile import (
    BatchLine,
    ResultMatcher,
    batch_tag,
    duplicate_custom_ids,
    jsonl_lines,
    output_line,
    parse_lines,
)
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
    # the limit is planned as a chat's (fleet/infer/budget.py), the reserve stays the project's
    assert job.max_tokens == 1500 and job.content_reserve is None
    assert job.response_schema == {"type": "object"}
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


def test_jsonl_lines_split_at_lf_only_and_tolerate_crlf():
    answer = "a\u2028b\u2029c\u0085d\x0be\x0cf\x1cg 日本語"
    first = {"custom_id": "u", "messages": [{"role": "user", "content": answer}]}
    text = json.dumps(first, ensure_ascii=False) + "\r\n\r\n" + json.dumps(OPENAI) + "\n"
    lines = parse_lines(jsonl_lines(text), "reports")
    assert [line.error for line in lines] == [None, None]
    assert [line.number for line in lines] == [1, 3]
    assert lines[0].job.messages[0].content == answer


def _envelope(job_id, code=Code.OK):
    return Envelope(job_id=job_id, project="reports", code=code, content=f"answer {job_id}")


def test_results_out_of_order_match_lines_with_duplicate_custom_ids_and_shared_jobs():
    text = "\n".join(json.dumps({"custom_id": cid, "messages": [{"role": "user", "content": cid}]})
                     for cid in ["same", "same", "other", "same"])
    lines = parse_lines(jsonl_lines(text), "reports")
    # lines 1 and 4 share a job (one idempotency key); line 3 was never sent
    matcher = ResultMatcher({1: "j1", 2: "j2", 4: "j1"})
    assert matcher.add(_envelope("j2", Code.E_THINK_LOOP)) == 1
    assert matcher.add(_envelope("j1")) == 2
    assert matcher.add(_envelope("j1")) == 0  # a repeated result finishes nothing more
    assert matcher.add(_envelope("stranger")) == 0
    rows = [output_line(line, matcher.envelope_for(line), "local") for line in lines]
    assert [(r["custom_id"], r["code"]) for r in rows] == [
        ("same", "OK"), ("same", "E_THINK_LOOP"), ("other", "E_INTERNAL"), ("same", "OK")]
    assert rows[0]["response"]["body"]["choices"][0]["message"]["content"] == "answer j1"
    assert rows[3]["response"]["request_id"] == "j1"


class _CountedId(str):
    """A job id that counts how often it is compared or hashed (shared by all ids of one test)."""

    budget = 0
    used = 0

    def _spend(self):
        type(self).used += 1
        assert type(self).used <= type(self).budget, "matching does more than linear work"

    def __eq__(self, other):
        self._spend()
        return str.__eq__(self, other)

    def __hash__(self):
        self._spend()
        return str.__hash__(self)


def test_a_batch_of_100000_lines_is_matched_with_linear_work():
    n = 100_000
    _CountedId.budget, _CountedId.used = 10 * n, 0
    ids = [_CountedId(f"job-{i}") for i in range(n)]
    matcher = ResultMatcher({i + 1: job_id for i, job_id in enumerate(ids)})
    finished, result = 0, _envelope("template")
    for job_id in reversed(ids):
        finished += matcher.add(result.model_copy(update={"job_id": job_id}))
    assert finished == n
    lines = [BatchLine(number=i + 1, custom_id="dup") for i in range(n)]
    assert all(matcher.envelope_for(line).job_id == line_id for line, line_id in zip(lines, ids, strict=True))
    assert _CountedId.used <= _CountedId.budget


def test_upstream_errors_are_openai_responses_and_fleet_errors_are_errors():
    [line] = parse_lines([json.dumps(OPENAI)], "reports")
    upstream = output_line(line, Envelope.failure("j", "reports", Code.E_UPSTREAM_UNAVAILABLE,
                                                  "backend down"), "local")
    assert upstream["error"] is None and upstream["code"] == "E_UPSTREAM_UNAVAILABLE"
    assert upstream["response"]["status_code"] == 503
    assert upstream["response"]["body"]["error"] == {
        "message": "backend down", "type": "upstream_error", "param": None,
        "code": "E_UPSTREAM_UNAVAILABLE"}
    rejected = output_line(line, Envelope.failure("j", "reports", Code.E_UPSTREAM_REJECTED, "no"), "x")
    assert rejected["response"]["status_code"] == 400
    fleet = output_line(line, Envelope.failure("j", "reports", Code.E_DEADLINE, "late"), "local")
    assert fleet["response"] is None and fleet["error"] == {"code": "E_DEADLINE", "message": "late"}


def test_the_same_file_names_the_same_jobs_and_an_own_id_is_kept():
    text = [json.dumps({**OPENAI, "custom_id": "x"}),
            json.dumps({"custom_id": "y", "id": "mine", "messages": [{"role": "user", "content": "q"}]})]
    first = parse_lines(text, "reports", batch_tag(b"file one"))
    again = parse_lines(text, "reports", batch_tag(b"file one"))
    other = parse_lines(text, "reports", batch_tag(b"file two"))
    assert [line.job.id for line in first] == [line.job.id for line in again]
    assert first[0].job.id != other[0].job.id
    assert first[1].job.id == "mine"


def test_duplicate_custom_ids_are_named():
    lines = parse_lines([json.dumps({**OPENAI, "custom_id": c}) for c in ["a", "b", "a", "c", "b"]],
                        "reports")
    assert duplicate_custom_ids(lines) == ["a", "b"]
