"""What the gateway sends, checked against OpenAI's published OpenAPI description (the subset in
``tests/support/openapi/``, see its README).

The description is OpenAPI 3.1, whose schemas are JSON Schema 2020-12 with a few leftovers of
OpenAPI 3.0; ``load_schemas`` turns it into plain JSON Schema in three steps:

1. ``nullable: true`` (OpenAPI 3.0, still on a few properties) becomes a ``"null"`` type (added to
   ``type`` and to ``enum``, or an ``anyOf`` with ``{"type": "null"}`` where there is no ``type``);
2. the fleet's known differences (``DIFFERENCES``) are written into the schemas they concern, each
   with its reason: a field the gateway adds is declared with its own type, a field the gateway
   sends as ``null`` where OpenAI's own API does too (but the description says only ``string``)
   becomes nullable;
3. every object schema with ``properties`` gets ``unevaluatedProperties: false``: OpenAI's
   description allows any extra field, so without this a misspelt or unplanned field would pass.
   With it, a field is either OpenAI's or named in ``DIFFERENCES`` with a reason.

The whole document is one ``referencing`` resource, so every ``#/components/schemas/...`` ``$ref``
resolves through a ``referencing.Registry``; ``problems(name, body)`` lists what is wrong with a
body (empty when it conforms) and ``assert_conforms`` fails naming each problem.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC = Path(__file__).with_name("openapi") / "openai-openapi-subset.json"
BASE = "urn:fleet-tests:openai-openapi"

_STRING = {"type": "string"}
_NULLABLE_STRING = {"type": ["string", "null"]}

# (schema, pointer inside it) -> {field: (its JSON Schema, why the gateway sends it)}. A pointer
# "" is the component itself. ``None`` as the JSON Schema: the field is OpenAI's, made nullable.
DIFFERENCES: dict[tuple[str, str], dict[str, tuple[dict[str, Any] | None, str]]] = {
    ("ChatCompletionStreamResponseDelta", ""): {
        "reasoning": (_STRING, "vLLM's field for a thinking model's reasoning text, streamed before the "
                               "content; OpenAI's API does not return reasoning text"),
    },
    ("ChatCompletionResponseMessage", ""): {
        "reasoning": (_NULLABLE_STRING, "vLLM's field for the reasoning text (null when there was none)"),
    },
    ("Model", ""): {
        "root": (_STRING, "vLLM's model object: the model the served one is"),
        "parent": ({"type": ["string", "null"]}, "vLLM's model object: null for a base model"),
        "max_model_len": ({"type": "integer"}, "vLLM's model object: the context length, which "
                                               "clients read to size their prompts"),
        "permission": ({"type": "array"}, "vLLM's model object (always empty)"),
    },
    ("CreateChatCompletionResponse", ""): {
        "fleet": ({"type": "object"}, "the fleet's own figures: a chat answer's message code (also in "
                                      "X-Fleet-Code), and on a batch output line's answer the attempts, "
                                      "warnings and the parsed answer; SDKs keep it as an extra field"),
    },
    ("CreateChatCompletionStreamResponse", ""): {
        "fleet": ({"type": "object", "properties": {"code": {"type": "string"}, "backend": {"type": "string"}},
                   "required": ["code"]},
                  "the chunk with the finish reason (and the usage chunk) carries the request's message "
                  "code and the backend that finished the answer, which a streaming client cannot read "
                  "from headers sent before the answer (or before a failover)"),
    },
    ("Batch", ""): {
        "output_file_id": (None, "null until there is an output file, as OpenAI's API sends it (its "
                                 "SDK types the field as optional)"),
        "error_file_id": (None, "null until there is an error file, as OpenAI's API sends it"),
        **{stamp: (None, "null until the batch reaches that state, as OpenAI's API sends it")
           for stamp in ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
                         "expired_at", "cancelling_at", "cancelled_at")},
        "errors": (None, "null when no line failed validation, as OpenAI's API sends it"),
        "usage": (None, "null until the batch is final"),
    },
    ("ListFilesResponse", ""): {
        "first_id": (None, "null on an empty page, as OpenAI's API sends it"),
        "last_id": (None, "null on an empty page, as OpenAI's API sends it"),
    },
    ("ListBatchesResponse", ""): {
        "first_id": (None, "null on an empty page, as OpenAI's API sends it"),
        "last_id": (None, "null on an empty page, as OpenAI's API sends it"),
    },
    ("OpenAIFile", ""): {
        "status_details": (None, "deprecated; null as OpenAI's API sends it"),
        "expires_at": (None, "null for a file that does not expire, as OpenAI's API sends it"),
    },
}

# A line of a batch's output or error file. OpenAI's description has no schema for it (the content
# endpoint returns a string); this is the line its batch documentation describes, plus the
# fleet's ``code``. Its ``response.body`` is checked against the chat completion or error schemas.
BATCH_LINE: dict[str, Any] = {
    "type": "object",
    "required": ["id", "custom_id", "response", "error"],
    "properties": {
        "id": _STRING, "custom_id": _STRING,
        "response": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["status_code", "request_id", "body"],
            "properties": {"status_code": {"type": "integer"}, "request_id": _STRING,
                           "body": {"type": "object"}},
            "unevaluatedProperties": False}]},
        "error": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["code", "message"],
            "properties": {"code": _STRING, "message": _STRING}, "unevaluatedProperties": False}]},
        "code": (_STRING),  # the fleet's message code, beside OpenAI's fields
    },
    "unevaluatedProperties": False,
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` that also accepts ``null`` (OpenAPI 3.0's ``nullable: true``)."""
    schema = {k: v for k, v in schema.items() if k != "nullable"}
    kind = schema.get("type")
    if isinstance(kind, str) and "$ref" not in schema:
        schema["type"] = [kind, "null"]
        if "enum" in schema and None not in schema["enum"]:
            schema["enum"] = [*schema["enum"], None]
        return schema
    if isinstance(kind, list) and "$ref" not in schema:
        schema["type"] = [*kind, "null"] if "null" not in kind else kind
        return schema
    return {"anyOf": [schema, {"type": "null"}]}


def _translate(node: Any, in_all_of: bool = False) -> Any:
    """Steps 1 and 3 of the module's docstring, on one schema tree (``in_all_of``: a member of an
    ``allOf``, which sees only its own properties, so the schema holding the ``allOf`` is made
    strict instead)."""
    if isinstance(node, list):
        return [_translate(item, in_all_of) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: (_translate(value, key == "allOf") if key not in ("properties", "$defs")
                 else {name: _translate(sub) for name, sub in value.items()})
           for key, value in node.items() if key not in ("description", "example", "x-oaiMeta")}
    if out.get("nullable") is True:
        out = _nullable(out)
    out.pop("nullable", None)
    strict_target = out["anyOf"][0] if "anyOf" in out and node.get("nullable") is True else out
    if ("properties" in strict_target or "allOf" in strict_target) and not in_all_of and not (
            {"additionalProperties", "unevaluatedProperties"} & strict_target.keys()):
        strict_target["unevaluatedProperties"] = False
    return out


def _pointer(document: dict[str, Any], schema: str, inside: str) -> dict[str, Any]:
    node = document["components"]["schemas"][schema]
    for part in filter(None, inside.split("/")):
        node = node[part]
    return node


def _all_of_refs(node: Any) -> list[str]:
    if isinstance(node, list):
        return [ref for item in node for ref in _all_of_refs(item)]
    if not isinstance(node, dict):
        return []
    direct = [m["$ref"] for m in node.get("allOf", []) if isinstance(m, dict) and "$ref" in m]
    return direct + [ref for value in node.values() for ref in _all_of_refs(value)]


@cache
def document() -> dict[str, Any]:
    """The description as JSON Schema: the fleet's differences written in, then translated."""
    raw = json.loads(SPEC.read_text(encoding="utf-8"))
    spec = copy.deepcopy(raw)
    for (schema, inside), fields in DIFFERENCES.items():
        target = _pointer(spec, schema, inside)
        properties = target.setdefault("properties", {})
        for field, (extra, _why) in fields.items():
            if extra is None:
                assert field in properties, f"{schema}{inside}: {field} is not OpenAI's field"
                properties[field] = _nullable(properties[field])
            else:
                assert field not in properties, f"{schema}{inside}: {field} is OpenAI's own field"
                properties[field] = extra
    schemas = spec["components"]["schemas"]
    # components that are members of an allOf elsewhere (the request schemas) stay open too
    members = {ref.rsplit("/", 1)[1] for ref in _all_of_refs(schemas)}
    spec["components"] = {"schemas": {name: _translate(body, name in members)
                                      for name, body in schemas.items()}}
    spec["components"]["schemas"]["FleetBatchLine"] = BATCH_LINE
    return spec


@cache
def _registry() -> Registry:
    resource = Resource.from_contents(document(), default_specification=DRAFT202012)
    return Registry().with_resource(BASE, resource)


@cache
def validator(name: str) -> Draft202012Validator:
    """A validator of ``#/components/schemas/<name>`` (``FleetBatchLine``: a batch result line)."""
    assert name in document()["components"]["schemas"], f"no schema {name} in the description"
    return Draft202012Validator({"$ref": f"{BASE}#/components/schemas/{name}"}, registry=_registry())


def problems(name: str, body: Any) -> list[str]:
    """What in ``body`` does not conform to schema ``name``: one line per error, with its path."""
    found = []
    for error in validator(name).iter_errors(body):
        where = "/".join(map(str, error.absolute_path)) or "(top)"
        # an anyOf/oneOf error says only that no branch matched: add what each branch found
        branches = "; ".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in error.context[:4])
        found.append(f"{where}: {error.message}" + (f" [{branches}]" if branches else ""))
    return found


def assert_conforms(name: str, body: Any) -> None:
    found = problems(name, body)
    assert found == [], f"not an OpenAI {name}:\n  " + "\n  ".join(found) + f"\nbody: {json.dumps(body)[:2000]}"
