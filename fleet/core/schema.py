"""Response schemas and answer patterns, checked before any work is spent on them.

A job's ``response_schema`` (and a project's default schema and ``answer_pattern``) is checked
where it enters: ``Job`` validation (so ``Client.submit`` refuses it before anything is sent, and a
prep worker refuses a job that went around the client before it takes a slot) and the settings
loader. Checking only after inference would spend a whole generation and then fail with an
internal error that looks retryable.

The validator class follows the schema's ``$schema`` (Draft 2020-12 when it names none); an
unknown ``$schema`` is refused rather than guessed. ``check_schema`` first caps the schema's size
(``MAX_SCHEMA_BYTES`` as compact JSON) and nesting (``MAX_SCHEMA_DEPTH``), then validates it
against that draft's metaschema with its format checker, which compiles every ``pattern`` and
``patternProperties`` key. The same class validates answers (fleet/infer/validate.py), so what
passes here is what the answer is held to.

Regular expressions run on RE2, never on Python's ``re``: a backtracking engine takes exponential
time on patterns such as ``^(a|aa)*$`` and holds the GIL meanwhile, so one answer could stall
every thread of a worker (lease renewals included). RE2 matches in linear time; it has no
backreferences or lookaround, so patterns that use them are refused on entry, naming the pattern.
jsonschema's own ``pattern``, ``patternProperties`` and ``additionalProperties`` use ``re``, so
the validator classes here replace those keywords; ``unevaluatedProperties`` next to
``patternProperties`` would still run ``re`` inside jsonschema and is refused.

Failures raise ``SchemaInvalid`` (a ``ValueError``, so pydantic reports it under the field and it
ends ``E_INPUT_INVALID``) naming the JSON path of the problem.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import re2
from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import ValidationError, best_match
from jsonschema.protocols import Validator
from jsonschema.validators import extend, validator_for

from fleet.core.limits import measure

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is reported to the submitter, not on stderr


class SchemaInvalid(ValueError):
    """A response schema or answer pattern that cannot be used."""


def _reason(exc: re2.error) -> str:
    reason = exc.args[0] if exc.args else exc
    return reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> Any:
    """The RE2 program of ``pattern``; ``SchemaInvalid`` naming it when RE2 cannot run it."""
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        raise SchemaInvalid(f"not a valid regular expression {pattern!r}: {_reason(exc)} "
                            "(patterns are RE2: no backreferences or lookaround)") from exc


def search(pattern: str, text: str) -> bool:
    return compile_pattern(pattern).search(text) is not None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: Mapping[str, Any], instance: Any,
                        schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, additional: Any, instance: Any,
                           schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    listed, patterns = schema.get("properties", {}), list(schema.get("patternProperties", {}))
    extras = sorted(key for key in instance
                    if key not in listed and not any(search(p, key) for p in patterns))
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif additional is False and extras:
        names = ", ".join(repr(extra) for extra in extras)
        if patterns:
            yield ValidationError(f"{names} not matched by properties or patternProperties")
        else:
            yield ValidationError(f"additional properties are not allowed ({names} unexpected)")


def _re2_checker(formats: FormatChecker) -> FormatChecker:
    checker = FormatChecker(formats.checkers)
    checker.checks("regex", raises=SchemaInvalid)(lambda value: not isinstance(value, str)
                                                   or compile_pattern(value) is not None)
    return checker


@functools.cache
def _on_re2(cls: type[Validator]) -> type[Validator]:
    keywords = {"pattern": _pattern, "patternProperties": _pattern_properties,
                "additionalProperties": _additional_properties}
    extended = extend(cls, keywords)  # type: ignore[arg-type]
    extended.FORMAT_CHECKER = _re2_checker(cls.FORMAT_CHECKER)
    return extended  # type: ignore[return-value]


def validator_class(schema: Mapping[str, Any]) -> type[Validator]:
    declared = schema.get("$schema")
    if declared is None:
        return _on_re2(Draft202012Validator)
    # validator_for with a default never fails; without one it raises for unknown drafts.
    found = validator_for({"$schema": declared}, default=None)  # type: ignore[arg-type]
    if found is None:
        raise SchemaInvalid(f"unknown $schema {declared!r}")
    return _on_re2(found)


def _keywords(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            yield from (key for key in item if isinstance(key, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _check_bounds(schema: Mapping[str, Any]) -> None:
    size = measure(schema, stop_bytes=MAX_SCHEMA_BYTES, stop_depth=MAX_SCHEMA_DEPTH)
    if size.depth > MAX_SCHEMA_DEPTH:
        raise SchemaInvalid(f"nested deeper than {MAX_SCHEMA_DEPTH} levels (at least {size.depth})")
    if size.bytes > MAX_SCHEMA_BYTES:
        raise SchemaInvalid(f"{size.bytes} bytes or more as JSON; at most {MAX_SCHEMA_BYTES} allowed")
    found = set(_keywords(schema))
    if {"unevaluatedProperties", "patternProperties"} <= found:
        raise SchemaInvalid("unevaluatedProperties together with patternProperties is not supported")


def check_schema(schema: Mapping[str, Any]) -> type[Validator]:
    """Raise ``SchemaInvalid`` unless ``schema`` is a valid JSON Schema; return its validator class."""
    _check_bounds(schema)
    cls = validator_class(schema)
    meta = validator_for(cls.META_SCHEMA, default=cls)(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)
    error = best_match(meta.iter_errors(schema))
    if error is not None:
        where = error.json_path if error.path else "$"
        because = f" ({error.cause})" if error.cause is not None else ""
        raise SchemaInvalid(f"not a valid JSON Schema: at {where}: {error.message}{because}")
    return cls


def answer_validator(schema: Mapping[str, Any]) -> Validator:
    """A validator for answers; raises ``SchemaInvalid`` as ``check_schema`` does."""
    return check_schema(schema)(schema)


def check_pattern(pattern: str) -> str:
    """Raise ``SchemaInvalid`` unless RE2 can run ``pattern``."""
    compile_pattern(pattern)
    return pattern


def search_multiline(pattern: str, text: str) -> bool:
    """``pattern`` found in ``text`` with ``^`` and ``$`` at line ends (answer patterns)."""
    return search(f"(?m){pattern}", text)
