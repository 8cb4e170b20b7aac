"""``POST /v1/completions``: vLLM's text-completion route, as the fleet uses it to continue a cut
reasoning (fleet/infer/resume.py).

The request: ``model``, ``prompt`` (a string or a list of token ids, as vLLM takes both),
``max_tokens`` (vLLM's default 16), ``stop`` (a string or a list), ``stream`` and
``stream_options``, ``seed``, ``temperature``, ``response_format``, ``cache_salt``,
``request_id``. The simulator reads the prompt as its own chat template renders a conversation
(fleet/sim/template.py) and decides what comes next from where the prompt ends:

- inside an open reasoning (the last assistant header, then ``<think>`` and no ``</think>``): the
  rest of the reasoning, as long as the request's plan would have thought minus what the prompt
  already holds (at least a little: a model that resumes a thought still closes it), then
  ``</think>`` and the answer; with ``</think>`` among the ``stop`` strings it stops there
  (``finish_reason: "stop"``, the stop string not in the text, as vLLM does);
- after ``</think>``: the answer only, less what the prompt already holds of it (a continued
  answer: the rest of a prose answer's planned length, at least a little), (JSON of the
  ``response_format`` when there is one; under a
  ``tool`` marker, with tools in the prompt's tools section, a hermes ``<tool_call>`` block as the
  chat route would write it, in the text: the tool as ``tool_choice: "auto"`` picks it);
- anything else: prose.

The scenario markers of the conversation's user turns apply as they do on the chat route (the
``/K`` counts are shared with it, so a ``drop/1`` that cut the chat request does not cut its
continuation). The stream's chunks are ``text_completion`` objects with ``choices[0].text``, then
the usage chunk and ``[DONE]``; everything the model writes is text (reasoning, ``</think>``,
hermes tool calls), since no reasoning or tool parser runs on this route.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from fleet.sim.engine import Sequence
from fleet.sim.kvcache import block_hashes, note_prompt
from fleet.sim.plan import RequestShape, build_plan, seeded
from fleet.sim.responses import Completion, CompletionFullWriter, CompletionStreamWriter
from fleet.sim.scenarios import MarkerError, breaking_of, chosen_tool, enact_refusals
from fleet.sim.template import tools_in
from fleet.sim.validate import APIError, opt_int, response_format_of, salt_of

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_ASSISTANT = "<|im_start|>assistant\n"
_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
DEFAULT_MAX_TOKENS = 16  # vLLM's, for a completion request that sets none


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise APIError(400, "stop must be a string or a list of strings", "stop")


def _prompt(body: dict[str, Any], state: Any) -> tuple[str, list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt, state.tokenizer.encode(prompt)
    if (isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in prompt)):
        return state.tokenizer.decode(prompt), list(prompt)
    raise APIError(400, "prompt must be a non-empty string or list of token ids", "prompt")


def where_it_ends(text: str) -> tuple[str, str]:
    """Where a rendered prompt ends: ("reasoning", the reasoning so far), ("answer", the answer so
    far) after ``</think>``, or ("text", "")."""
    cut = text.rfind(_ASSISTANT)
    if cut < 0:
        return "text", ""
    turn = text[cut + len(_ASSISTANT):]
    if THINK_CLOSE in turn:
        return "answer", turn[turn.index(THINK_CLOSE) + len(THINK_CLOSE):].lstrip("\n")
    opened = turn.find(THINK_OPEN)
    if opened < 0:
        return "text", ""
    return "reasoning", turn[opened + len(THINK_OPEN):].removeprefix("\n")  # the template's newline


class CompletionHandler:
    def __init__(self, state: Any) -> None:
        self.s = state

    def accept(self, body: Any, rid: str) -> Any:
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        served = self.s.profile.served_model_names
        asked = body.get("model") or served[0]
        if asked not in served:
            raise APIError(404, f"The model `{asked}` does not exist.", "model")
        text, ids = _prompt(body, self.s)
        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        if options is not None and not stream:
            raise APIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        requested = opt_int(body, "max_tokens", 1)
        stops = _stops(body)
        users = _USER.findall(text)
        try:
            scenario = self.s.scenarios.resolve(users[-1] if users else "", users[0] if users else "")
        except MarkerError as exc:
            raise APIError(400, str(exc), "prompt") from exc
        prompt_len = len(ids)
        limit = self.s.profile.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                           f"your request has {prompt_len} input tokens. Please reduce the length "
                           "of the input.", "input_tokens")
        room = limit - prompt_len
        max_tokens = min(room, DEFAULT_MAX_TOKENS if requested is None else requested)
        mode, so_far = where_it_ends(text)
        reasoning = so_far if mode == "reasoning" else ""
        shape = RequestShape(max_tokens, thinking=mode == "reasoning",
                             answered=self.s.tokenizer.count(so_far) if mode == "answer" and so_far else 0,
                             response_format=response_format_of(body),
                             tool=chosen_tool(tools_in(text), "auto", scenario),
                             thought=self.s.tokenizer.count(reasoning) if reasoning else 0,
                             stop_at_think_end=THINK_CLOSE in stops)
        plan = build_plan(shape, scenario, seeded(self.s.config.seed, [body.get("seed"), text,
                                                                       stops]), self.s.config.lengths)
        hashes = block_hashes(ids, self.s.profile.block_tokens, salt_of(body))
        note_prompt(self.s.requests, rid, prompt_len, hashes)
        seq = Sequence(
            request_id=rid, prompt_len=prompt_len, hashes=hashes, total=plan.total,
            finish_reason=plan.finish_reason, long=prompt_len > self.s.config.long_threshold,
            slow_first_s=scenario.number("slow_first_token"), stall_at=plan.stall_at,
            stall_s=scenario.number("stall"))
        enact_refusals(scenario, self.s.engine)
        self.s.engine.submit(seq)
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        continuous = bool(isinstance(options, dict) and options.get("continuous_usage_stats"))
        completion = Completion(self.s.engine, seq, plan, f"cmpl-{rid}", int(time.time()), served[0],
                                include_usage, breaking_of(scenario), continuous, details=False,
                                crash_s=scenario.number("crash", math.inf))
        return CompletionStreamWriter(completion) if stream else CompletionFullWriter(completion)
