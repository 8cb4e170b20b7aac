"""A backend ``/tokenize`` for ``httpx.MockTransport``: one token per 4 characters (+3 per message)."""

from __future__ import annotations

import json

import httpx


def fake_tokenize(request: httpx.Request) -> httpx.Response:
    """A /tokenize that counts one token per 4 characters (+3 per message)."""
    assert request.url.path == "/tokenize"
    body = json.loads(request.content)
    if "prompt" in body:
        assert body["add_special_tokens"] is False
        count = (len(body["prompt"]) + 3) // 4
    else:
        assert body["add_generation_prompt"] is True
        count = sum(3 + (len(m.get("content") or "") + 3) // 4 for m in body["messages"])
        count += len(json.dumps(body.get("tools", []))) // 4
    return httpx.Response(200, json={"count": count, "max_model_len": 4096, "tokens": []})
