"""The simulator's tokenizer: the deployment's 3.94 characters per token, determinism, round trips."""

from __future__ import annotations

import random

import pytest

from fleet.sim.jsongen import generate_json
from fleet.sim.template import render_chat
from fleet.sim.textgen import ProseStream
from fleet.sim.tokenizer import SPECIAL_BASE_ID, SPECIAL_TOKENS, Tokenizer, split_pieces
from tests.support.sim_samples import ENGLISH, JAPANESE


@pytest.mark.parametrize("text", [ENGLISH, JAPANESE], ids=["english", "japanese"])
def test_ratio_close_to_the_deployments(text: str) -> None:
    ratio = len(text) / Tokenizer.count(text)
    assert 3.94 * 0.93 < ratio < 3.94 * 1.07


def test_deterministic_across_instances() -> None:
    a, b = Tokenizer(), Tokenizer()
    b.encode(JAPANESE)  # a different history must not change ids
    assert a.encode(ENGLISH) == b.encode(ENGLISH)


@pytest.mark.parametrize("text", [ENGLISH, JAPANESE, '{"a": [1, 2.5, "x"]}\n\t  end', ""])
def test_detokenize_round_trip(text: str) -> None:
    tok = Tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single() -> None:
    tok = Tokenizer()
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<think>\n</think>")
    assert ids[0] == SPECIAL_BASE_ID + 1
    assert "".join(split_pieces("<think>")) == "<think>" and len(split_pieces("</think>")) == 1


def test_generated_prose_retokenizes_to_same_count() -> None:
    pieces = ProseStream(random.Random(3)).take(2_000)
    assert len(split_pieces("".join(pieces))) == pytest.approx(2_000, rel=0.01)


def test_chat_template_charges_tools() -> None:
    messages = [{"role": "user", "content": "hello"}]
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}
    bare = Tokenizer.count(render_chat(messages))
    with_tools = Tokenizer.count(render_chat(messages, [tool] * 10))
    assert with_tools > bare + 10 * 20
    off = render_chat(messages, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")


def test_json_generator_respects_schema() -> None:
    import json

    import jsonschema

    schema = {
        "type": "object", "additionalProperties": False, "required": ["name", "tags", "kind"],
        "properties": {
            "name": {"type": "string", "minLength": 3, "maxLength": 12},
            "score": {"type": "integer", "minimum": 5, "maximum": 9},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2,
                     "maxItems": 3},
            "kind": {"const": "fixed"},
            "child": {"$ref": "#/$defs/child"},
            "either": {"oneOf": [{"type": "null"}, {"type": "number", "maximum": 0}]},
        },
        "$defs": {"child": {"type": "object", "required": ["ok"],
                            "properties": {"ok": {"type": "boolean"}}}},
    }
    rng = random.Random(0)
    for _ in range(30):
        jsonschema.validate(json.loads(generate_json(schema, rng)), schema)


def test_id_table_stays_bounded_over_many_distinct_words() -> None:
    """A long-running simulator sees new pieces forever; its table must not grow with them."""
    tok = Tokenizer(max_pieces=1_000)
    words = [" " + "".join(chr(ord("a") + int(d)) for d in f"{n:05d}") for n in range(20_000)]
    assert len(split_pieces("".join(words))) == len(words)  # one new piece per word
    for word in words:
        tok.encode(word)
    assert len(tok) <= 1_000 + len(SPECIAL_TOKENS)
    recent = "".join(words[-10:])
    assert tok.decode(tok.encode(recent)) == recent
    assert tok.encode(words[0]) == Tokenizer().encode(words[0])  # ids still come from the digest


def test_default_table_is_bounded() -> None:
    tok = Tokenizer()
    for n in range(tok.max_pieces + 5_000):
        tok.piece_id(f"p{n}")
    assert len(tok) <= tok.max_pieces + len(SPECIAL_TOKENS)
