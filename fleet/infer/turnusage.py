"""What the usage ledger counts for one model turn (fleet/core/usage.py), from its stream.

A turn whose stream ended with vLLM's usage chunk counts vLLM's own figures: prompt, cached
prompt (``prompt_tokens_details.cached_tokens``), reasoning and completion tokens. A turn cut
before it (the loop watcher, a cancel, a client gone, a dropped stream, a deadline) is a
``cut`` turn counted from what the fleet saw: the prompt as the fleet counted it when a token
came back (vLLM had computed it), none when nothing did, and the deltas received (a delta is at
least one token, a token about 4 characters: ``StreamResult``'s estimate), no cached tokens.
A turn with no stream at all (refused before streaming) counts as a request with no tokens.
"""

from __future__ import annotations

import time
from dataclasses import replace

from fleet.core.usage import QUEUE_KEY, TurnUsage
from fleet.infer.vllm import StreamResult


def turn_usage(project: str, job_id: str, fence: int, turn: int, code: str,
               result: StreamResult | None, counted_prompt: int, *, key: str = QUEUE_KEY,
               model: str = "local", tool_round: bool = False) -> TurnUsage:
    base = TurnUsage(project=project, job_id=job_id, fence=fence, turn=turn, code=code, key=key,
                     model=model, tool_round=tool_round, ended_at=time.time(), cut=True)
    if result is None:
        return base
    served = result.usage is not None and result.usage.get("completion_tokens") is not None
    if result.prompt_tokens is not None:
        prompt = result.prompt_tokens
    else:
        prompt = counted_prompt if result.first_token_s is not None else 0
    reasoning = result.reasoning_tokens
    return replace(base, prompt_tokens=prompt, cached_tokens=result.cached_tokens,
                   reasoning_tokens=reasoning,
                   answer_tokens=max(0, result.completion_tokens - reasoning), cut=not served)
