"""The whole-fleet benches' workload: job specs (who sends a job, its exact reasoning and answer
lengths, whether its prompt is long), the mixes the scenarios draw, the long document, and what
a spec becomes: a fleet Job or the request body a direct client sends straight to the simulator.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, replace
from typing import Any

import httpx

PROJECTS = ("assistant", "reports", "translate", "triage", "research")
TOPIC = "Summarise the operational risks of the nightly batch and propose two checks."


@dataclass(frozen=True)
class Spec:
    """One job: who sends it, its exact reasoning/answer lengths, and whether its prompt is long."""

    project: str
    think: int
    answer: int
    long: bool = False
    tag: str = ""
    extra: str = ""  # more scenario markers (fleet/bench/continuations.py), made unique by the tag
    band: str = "batch"  # interactive | batch (fleet/bench/fleet/mix.py)

    @property
    def thinking_budget(self) -> int:
        return self.think + 64

    @property
    def content_reserve(self) -> int:
        return self.answer + 64


def short_mix(n: int, think: int, answer: int, projects: tuple[str, ...] = PROJECTS) -> list[Spec]:
    """``n`` short jobs round-robin over ``projects``; lengths vary +-25% (seeded) around the mean."""
    rng = random.Random(7)
    return [
        Spec(
            projects[i % len(projects)],
            int(think * rng.uniform(0.75, 1.25)),
            int(answer * rng.uniform(0.75, 1.25)),
            tag=f"s{i}",
        )
        for i in range(n)
    ]


def with_long(specs: list[Spec], share: float) -> list[Spec]:
    """Every ``1/share``-th job becomes a long-prompt job (same lengths otherwise)."""
    step = round(1 / share)
    return [Spec(s.project, s.think, s.answer, long=(i % step == step - 1), tag=s.tag) for i, s in enumerate(specs)]


def with_long_each(specs: list[Spec], share: float) -> list[Spec]:
    """Every ``1/share``-th job of each project becomes a long-prompt job, staggered between
    projects (``with_long`` over the round-robin of five projects makes every long job the same
    project's)."""
    step, seen = round(1 / share), dict.fromkeys(PROJECTS, 0)
    order = {p: i for i, p in enumerate(PROJECTS)}
    out = []
    for s in specs:
        k = seen[s.project] = seen.get(s.project, 0) + 1
        out.append(replace(s, long=(k + 2 * order.get(s.project, 0)) % step == 0))
    return out


class LongText:
    """A ~``target`` token document for the simulator's tokenizer; each job gets a unique head so
    the simulator's prefix cache never hits (a real 60K-token prompt, sent and counted as such)."""

    def __init__(self, base_url: str, target_tokens: int) -> None:
        rng = random.Random(11)
        words = (
            "ledger",
            "queue",
            "invoice",
            "shard",
            "latency",
            "replica",
            "batch",
            "cursor",
            "budget",
            "region",
            "tenant",
            "kernel",
            "packet",
            "vector",
            "schema",
        )
        unit = lambda: f"{rng.choice(words)} {rng.randint(0, 999)}."  # noqa: E731
        body = " ".join(unit() for _ in range(target_tokens // 3))
        count = _tokenize(base_url, body)
        if count > target_tokens:  # cut to size by the measured characters per token
            body = body[: int(len(body) * target_tokens / count * 1.002)]
            count = _tokenize(base_url, body)
        while count < target_tokens:  # top up until the count reaches the target
            body += " " + " ".join(unit() for _ in range((target_tokens - count) // 4 + 2))
            count = _tokenize(base_url, body)
        self.body, self.tokens = body, count

    def content(self, tag: str) -> str:
        return f"Document {tag} {uuid.uuid4().hex}:\n{self.body}\n\n{TOPIC}"


def _tokenize(base_url: str, text: str) -> int:
    reply = httpx.post(base_url + "/tokenize", json={"prompt": text}, timeout=60)
    reply.raise_for_status()
    return int(reply.json()["count"])


def content_of(spec: Spec, long_text: LongText | None) -> str:
    markers = f"[sim:think={spec.think}] [sim:answer={spec.answer}]"
    if spec.extra:  # /K markers count per first message: this job's own
        markers += f" (job {spec.tag}) {spec.extra}"
    if spec.long:
        assert long_text is not None
        return f"{long_text.content(spec.tag)} {markers}"
    return f"{TOPIC} {markers}"


def job_of(spec: Spec, long_text: LongText | None) -> dict[str, Any]:
    return {
        "project": spec.project,
        "band": spec.band,
        "thinking_budget": spec.thinking_budget,
        "content_reserve": spec.content_reserve,
        "metadata": {"tag": spec.tag, "long": spec.long},
        "messages": [{"role": "user", "content": content_of(spec, long_text)}],
    }


def body_of(spec: Spec, long_text: LongText | None, model: str) -> dict[str, Any]:
    """What the inference worker sends for this job (same messages, caps and budget)."""
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": spec.thinking_budget + spec.content_reserve,
        "thinking_token_budget": spec.thinking_budget,
        "messages": [{"role": "user", "content": content_of(spec, long_text)}],
    }

