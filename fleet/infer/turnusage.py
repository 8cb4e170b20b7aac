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


class TurnProgress:
    """What the streaming turn of one delivery has received so far, for the usage ledger's
    progress entry (``UsageLedger.checkpoint``), read by the lease keeper's thread at each
    renewal while the inference thread updates it (plain counters: a read sees a recent value).
    Exact when the server sends its running count in every chunk (the queue path asks for it:
    ``continuous_usage_stats``), else ``StreamResult``'s estimate: a delta is at least one token,
    about 4 characters a token."""

    def __init__(self, project: str, job_id: str, fence: int, model: str, key: str = QUEUE_KEY) -> None:
        self.project, self.job_id, self.fence, self.model = project, job_id, fence, model
        self.key = key  # the job's API key (``tagged_key``), else queue
        self.turn = 0
        self.prompt_tokens = 0
        self._counts = [0, 0, 0, 0]  # reasoning deltas, chars; content deltas, chars
        self._exact: tuple[int, int] | None = None  # the server's running (reasoning, completion)
        self._streaming = False

    def start(self, turn: int, prompt_tokens: int) -> None:
        self.turn, self.prompt_tokens, self._counts = turn, prompt_tokens, [0, 0, 0, 0]
        self._exact = None
        self._streaming = False

    def seen(self, reasoning: str, content: str, tool_calls: bool = False,
             streamed: tuple[int, int] | None = None) -> None:
        if streamed is not None:
            self._exact = streamed
        counts = self._counts
        if reasoning:
            counts[0] += 1
            counts[1] += len(reasoning)
        if content or tool_calls:
            counts[2] += 1
            counts[3] += len(content)
        self._streaming = True

    def stop(self) -> None:
        """The turn's stream is over (it counts itself now): nothing more to record."""
        self._streaming = False

    def snapshot(self) -> TurnUsage | None:
        """What a crash now would leave counted; None before the first token or after the end."""
        if not self._streaming:
            return None
        counts, exact = list(self._counts), self._exact
        if exact is not None:  # the server's own running count: exact as far as it was received
            reasoning, answer = exact[0], exact[1] - exact[0]
        else:
            reasoning, answer = max(counts[0], round(counts[1] / 4)), max(counts[2], round(counts[3] / 4))
        return TurnUsage(project=self.project, job_id=self.job_id, fence=self.fence, turn=self.turn,
                         code="", key=self.key, model=self.model, prompt_tokens=self.prompt_tokens,
                         reasoning_tokens=reasoning, answer_tokens=answer, ended_at=time.time())
