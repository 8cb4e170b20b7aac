"""Output checks: the answer against the job's JSON Schema and the project's text rules.

Schema: ``job.response_schema``, else ``project.response_schema``. It is sent to vLLM as
``response_format: {"type": "json_schema", ...}`` (structured output through xgrammar) and checked
again on the answer here, because a forced end of thinking, a truncated answer or a backend without
structured output can still return something else. The answer is parsed (a surrounding
```` ```json ```` fence is tolerated: ``unfenced``, one linear scan, never a backtracking regex
on model output) and validated with ``jsonschema``, through the validator
class of fleet/core/schema.py that checked the schema when the job or the settings came in; the
first (best-matching) error is reported with its JSON path so a re-ask can quote it.

Text rules (per project): at least ``min_answer_chars`` (after stripping), at most
``max_answer_chars``, and ``answer_pattern`` (searched with ``^``/``$`` at line ends, on RE2 as
schema patterns are: linear time, see fleet/core/schema.py) must match.

On a failure fleet/infer/attempts.py re-asks - the invalid answer and ``reask_message(error)`` are
appended to the conversation - at most ``retry.reask_invalid`` times, then ends
``E_OUTPUT_INVALID``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import best_match

from fleet.core.config import ProjectSettings
from fleet.core.errors import InputInvalid
from fleet.core.limits import loads
from fleet.core.models import Job
from fleet.core.schema import SchemaInvalid, answer_validator, search_multiline

FENCE = "```"


@dataclass(frozen=True)
class Checked:
    ok: bool
    parsed: Any = None
    error: str = ""


def schema_for(job: Job, project: ProjectSettings) -> dict[str, Any] | None:
    return job.response_schema if job.response_schema is not None else project.response_schema


def response_format(job: Job, project: ProjectSettings) -> dict[str, Any] | None:
    schema = schema_for(job, project)
    if schema is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def _text_error(text: str, project: ProjectSettings) -> str:
    if len(text) < project.min_answer_chars:
        return f"the answer has {len(text)} characters; at least {project.min_answer_chars} needed"
    if project.max_answer_chars is not None and len(text) > project.max_answer_chars:
        return f"the answer has {len(text)} characters; at most {project.max_answer_chars} allowed"
    if project.answer_pattern and not search_multiline(project.answer_pattern, text):
        return f"the answer does not match the required pattern {project.answer_pattern!r}"
    return ""


def unfenced(text: str) -> str:
    """The body of a ```` ``` ```` or ```` ```json ```` fence around the whole of ``text`` (the
    opening line holds only the fence and its tag, the closing fence a line of its own), else
    ``text``. Slices and strips only: linear in the answer's length, where the regex this
    replaced backtracked for minutes on an opening fence followed by a few thousand newlines."""
    inner = text.strip()
    if not (inner.startswith(FENCE) and inner.endswith(FENCE)):
        return text
    head, newline, rest = inner[len(FENCE):-len(FENCE)].partition("\n")
    body = rest.rstrip()
    if not newline or head.rstrip() not in ("", "json") or "\n" not in rest[len(body):]:
        return text
    return body


def parse_json(text: str) -> Any:
    """The answer as JSON; ValueError for one that is not, or nests past ``MAX_JSON_DEPTH``."""
    return loads(unfenced(text))


def check_answer(content: str, job: Job, project: ProjectSettings) -> Checked:
    text = content.strip()
    error = _text_error(text, project)
    if error:
        return Checked(False, error=error)
    schema = schema_for(job, project)
    if schema is None:
        return Checked(True)
    try:
        parsed = parse_json(text)
    except ValueError as exc:
        return Checked(False, error=f"the answer is not valid JSON: {exc}")
    try:
        failure = best_match(answer_validator(schema).iter_errors(parsed))
    except SchemaInvalid as exc:
        # Unreachable for a validated Job or Settings (both check on entry); should it happen,
        # the fault is the job's, not a retryable internal error.
        raise InputInvalid(f"response_schema is {exc}") from exc
    if failure is not None:
        where = failure.json_path if failure.path else "$"
        return Checked(False, parsed=parsed, error=f"at {where}: {failure.message}")
    return Checked(True, parsed=parsed)


def reask_message(error: str, has_schema: bool) -> str:
    shape = "only a JSON value that satisfies the required schema" if has_schema else "the answer"
    return (
        f"[fleet note] Your previous answer was rejected: {error}. "
        f"Reply again with {shape}, fixing exactly that problem. Do not restart the reasoning."
    )
