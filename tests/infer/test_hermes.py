"""Tool calls read from a model's raw text (fleet/infer/hermes.py), as vLLM's hermes parser reads
them, whole and streamed in pieces of every size."""

from __future__ import annotations

import json

import pytest

from fleet.infer.hermes import Splitter, as_deltas, parse

ONE = 'Let me look.\n<tool_call>\n{"name": "search_docs", "arguments": {"query": "Rechnung März"}}\n</tool_call>'
TWO = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
       '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')


def names(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_the_text_before_the_first_block_is_the_content_and_each_block_a_call() -> None:
    content, calls = parse(ONE)
    assert content == "Let me look.\n"
    assert names(calls) == [("search_docs", {"query": "Rechnung März"})]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert "März" in calls[0]["function"]["arguments"]  # not escaped, as vLLM sends it
    content, calls = parse(TWO)
    assert content == "" and names(calls) == [("a", {"x": 1}), ("b", {})]
    assert len({c["id"] for c in calls}) == 2


def test_a_last_block_without_its_closing_tag_is_read() -> None:
    content, calls = parse('<tool_call>\n{"name": "a", "arguments": {"x": 2}}\n')
    assert (content, names(calls)) == ("", [("a", {"x": 2})])


@pytest.mark.parametrize("text", [
    "no call at all",
    '<tool_call>\n{"name": "a", "arguments": {"x": </tool_call>',  # not JSON
    '<tool_call>["a"]</tool_call>',  # not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>oops</tool_call>',  # one unreadable
    '<tool_call>{"name": "a"}</tool_call>',  # no arguments: vLLM's parser gives up on it too
    "<tool_call>" + "[" * 100_000,  # nested past the JSON parser's depth (a RecursionError)
])
def test_text_that_does_not_read_as_calls_is_all_content(text: str) -> None:
    assert parse(text) == (text, [])


@pytest.mark.parametrize("text", [ONE, TWO, "plain prose with a < sign and <tool", "ends in <tool_ca",
                                  '<tool_call>{"name": 1}</tool_call>'])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, 1000])
def test_a_stream_passes_the_same_content_on_and_never_a_tag(text: str, size: int) -> None:
    splitter = Splitter()
    streamed = "".join(splitter.feed(text[i:i + size]) for i in range(0, len(text), size))
    assert "<tool_call>" not in streamed
    content, rest, calls = splitter.end()
    assert streamed + rest == content
    assert (content, names(calls)) == (parse(text)[0], names(parse(text)[1]))


def test_the_calls_go_out_as_one_delta_with_their_indexes() -> None:
    _content, calls = parse(TWO)
    deltas = as_deltas(calls)
    assert [d["index"] for d in deltas] == [0, 1]
    assert deltas[1]["function"] == calls[1]["function"] and deltas[1]["id"] == calls[1]["id"]
