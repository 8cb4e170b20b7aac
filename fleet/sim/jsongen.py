"""Random JSON values that satisfy a JSON Schema: what guided decoding would let the model write.

Covered keywords: ``type`` (one or a list), ``properties``, ``required``, ``additionalProperties``
(only listed properties are ever generated, so ``false`` holds), ``items``, ``prefixItems``,
``enum``, ``const``, ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum``,
``multipleOf`` (integers), ``minLength``/``maxLength``, ``minItems``/``maxItems``, ``anyOf``,
``oneOf``, ``allOf`` (merged), ``$ref`` into ``$defs``/``definitions``, ``nullable`` and common
string ``format``s (date, date-time, email, uri, uuid). ``pattern`` is not honoured, and not
checked either: jsonschema checks it with Python's backtracking ``re``, and a test's hostile
pattern would stall the simulator instead of the fleet under test.

``generate_json`` validates the result with ``jsonschema`` and retries with other draws (other
``oneOf`` branches, for instance) before giving up and returning the last candidate. The text is
compact (no whitespace), as xgrammar writes it with ``disable_any_whitespace``.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Iterator
from typing import Any

import jsonschema

from fleet.sim.textgen import iter_words

log = logging.getLogger(__name__)
_MAX_DEPTH = 8


class _Gen:
    def __init__(self, root: dict[str, Any], rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.words = iter_words(rng)

    def resolve(self, schema: Any) -> dict[str, Any]:
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema and seen < 32:
            ref = schema["$ref"]
            node: Any = self.root
            for part in ref.lstrip("#/").split("/") if ref.startswith("#") else []:
                node = node.get(part, {}) if isinstance(node, dict) else {}
            extra = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**node, **extra} if isinstance(node, dict) else extra
            seen += 1
        if isinstance(schema, dict) and "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for sub in schema["allOf"]:
                sub = self.resolve(sub)
                props = {**merged.get("properties", {}), **sub.get("properties", {})}
                req = list(merged.get("required", [])) + list(sub.get("required", []))
                merged = {**merged, **sub, "properties": props, "required": req}
            schema = merged
        return schema if isinstance(schema, dict) else {}

    def value(self, schema: Any, depth: int = 0) -> Any:
        schema = self.resolve(schema)
        if "const" in schema:
            return schema["const"]
        if schema.get("enum"):
            return self.rng.choice(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if schema.get(key):
                base = {k: v for k, v in schema.items() if k != key}
                return self.value({**base, **self.resolve(self.rng.choice(schema[key]))}, depth)
        kind = self._type(schema)
        return getattr(self, f"_{kind}")(schema, depth)

    def _type(self, schema: dict[str, Any]) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):
            options = [k for k in kind if k != "null"] or ["null"]
            kind = self.rng.choice(options)
        if kind is None:
            if "properties" in schema:
                kind = "object"
            elif "items" in schema:
                kind = "array"
            else:
                kind = "string"
        return kind if kind in ("object", "array", "string", "integer", "number", "boolean",
                                "null") else "string"

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props: dict[str, Any] = schema.get("properties", {}) or {}
        required = set(schema.get("required", []))
        out: dict[str, Any] = {}
        for name, sub in props.items():
            if name in required or (depth < _MAX_DEPTH and self.rng.random() < 0.7):
                out[name] = self.value(sub, depth + 1)
        if not props and schema.get("additionalProperties") not in (False, None):
            extra = schema["additionalProperties"]
            for _ in range(self.rng.randint(1, 3)):
                out[next(self.words)] = self.value(extra if isinstance(extra, dict) else {},
                                                   depth + 1)
        return out

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        lo = int(schema.get("minItems", 0))
        hi = int(schema.get("maxItems", max(lo, 4)))
        if depth >= _MAX_DEPTH:
            hi = lo
        prefix = schema.get("prefixItems") or []
        n = self.rng.randint(max(lo, len(prefix)) if prefix else lo, max(hi, lo))
        items = schema.get("items", {})
        items = items if isinstance(items, dict) else {}
        return [self.value(prefix[i] if i < len(prefix) else items, depth + 1) for i in range(n)]

    def _string(self, schema: dict[str, Any], depth: int) -> str:
        fmt = schema.get("format")
        if fmt in _FORMATS:
            return _FORMATS[fmt](self.rng)
        lo = int(schema.get("minLength", 0))
        hi = int(schema.get("maxLength", max(lo, 80)))
        words: list[str] = []
        target = self.rng.randint(min(lo + 3, hi), hi) if hi > 0 else 0
        while len(" ".join(words)) < target:
            words.append(next(self.words))
        text = " ".join(words)[:hi]
        while len(text) < lo:
            text += "x"
        return text

    def _integer(self, schema: dict[str, Any], depth: int) -> int:
        lo, hi = _bounds(schema, integer=True)
        value = self.rng.randint(int(lo), int(hi))
        step = schema.get("multipleOf")
        if isinstance(step, int) and step > 0:
            value = value - value % step
            if value < lo:
                value += step
        return value

    def _number(self, schema: dict[str, Any], depth: int) -> float:
        lo, hi = _bounds(schema, integer=False)
        return round(self.rng.uniform(lo, hi), 3)

    def _boolean(self, schema: dict[str, Any], depth: int) -> bool:
        return self.rng.random() < 0.5

    def _null(self, schema: dict[str, Any], depth: int) -> None:
        return None


def _bounds(schema: dict[str, Any], integer: bool) -> tuple[float, float]:
    lo = schema.get("minimum", 0)
    hi = schema.get("maximum", max(lo, 0) + 1000)
    eps = 1 if integer else 1e-3
    if "exclusiveMinimum" in schema and not isinstance(schema["exclusiveMinimum"], bool):
        lo = max(lo, schema["exclusiveMinimum"] + eps)
    if "exclusiveMaximum" in schema and not isinstance(schema["exclusiveMaximum"], bool):
        hi = min(hi, schema["exclusiveMaximum"] - eps)
    if integer:
        lo, hi = math.ceil(lo), math.floor(hi)
    return lo, max(lo, hi)


_FORMATS = {
    "date": lambda r: f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "date-time": lambda r: f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T"
    f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:00Z",
    "email": lambda r: f"user{r.randint(1, 999)}@example.com",
    "uri": lambda r: f"https://example.com/item/{r.randint(1, 9999)}",
    "uuid": lambda r: f"{r.getrandbits(32):08x}-0000-4000-8000-{r.getrandbits(48):012x}",
}


def _ignored(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
    return iter(())


def _checker(schema: dict[str, Any]) -> Any:
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return jsonschema.validators.extend(cls, {"pattern": _ignored})(schema)


def generate_json(schema: Any, rng: random.Random, attempts: int = 8) -> str:
    """A compact JSON document valid against ``schema`` (best effort after ``attempts`` draws)."""
    if not isinstance(schema, dict):
        schema = {}
    candidate: Any = None
    for _ in range(attempts):
        candidate = _Gen(schema, rng).value(schema)
        try:
            _checker(schema).validate(candidate)
            break
        except jsonschema.ValidationError:
            continue
        except jsonschema.SchemaError:
            log.warning("sim: response schema is not a valid JSON Schema; output unchecked")
            break
    return json.dumps(candidate, ensure_ascii=False, separators=(",", ":"))


def generate_object(rng: random.Random) -> str:
    """Content for ``{"type": "json_object"}``: a small free-form object."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 200},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                       "items": {"type": "array", "items": {"type": "string", "maxLength": 30}}},
        "required": ["answer", "confidence"],
    }
    return generate_json(schema, rng)
