"""Response schemas and answer patterns, checked before any work is spent on them.

A job's ``response_schema`` (and a project's default schema and ``answer_pattern``) is checked
where it enters: ``Job`` validation (so ``Client.submit`` refuses it before anything is sent, and a
prep worker refuses a job that went around the client before it takes a slot) and the settings
loader. Checking only after inference would spend a whole generation and then fail with an
internal error that looks retryable.

The validator class follows the schema's ``$schema`` (Draft 2020-12 when it names none); an
unknown ``$schema`` is refused rather than guessed. ``check_schema`` validates against that
draft's metaschema with its format checker, which also compiles every ``pattern`` and
``patternProperties`` key as a regular expression. The same class validates answers
(fleet/infer/validate.py), so what passes here is what the answer is held to.

Failures raise ``SchemaInvalid`` (a ``ValueError``, so pydantic reports it under the field and it
ends ``E_INPUT_INVALID``) naming the JSON path of the problem.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for


class SchemaInvalid(ValueError):
    """A response schema or answer pattern that cannot be used."""


def validator_class(schema: Mapping[str, Any]) -> type[Validator]:
    declared = schema.get("$schema")
    if declared is None:
        return Draft202012Validator
    # validator_for with a default never fails; without one it raises for unknown drafts.
    found = validator_for({"$schema": declared}, default=None)  # type: ignore[arg-type]
    if found is None:
        raise SchemaInvalid(f"unknown $schema {declared!r}")
    return found


def check_schema(schema: Mapping[str, Any]) -> type[Validator]:
    """Raise ``SchemaInvalid`` unless ``schema`` is a valid JSON Schema; return its validator class."""
    cls = validator_class(schema)
    meta = validator_for(cls.META_SCHEMA, default=cls)(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)
    error = best_match(meta.iter_errors(schema))
    if error is not None:
        where = error.json_path if error.path else "$"
        raise SchemaInvalid(f"not a valid JSON Schema: at {where}: {error.message}")
    return cls


def answer_validator(schema: Mapping[str, Any]) -> Validator:
    """A validator for answers; raises ``SchemaInvalid`` as ``check_schema`` does."""
    return check_schema(schema)(schema)


def check_pattern(pattern: str) -> str:
    """Raise ``SchemaInvalid`` unless ``pattern`` compiles as a Python regular expression."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise SchemaInvalid(f"not a valid regular expression {pattern!r}: {exc}") from exc
    return pattern
