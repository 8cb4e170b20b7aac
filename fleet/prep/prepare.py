"""The preparation pipeline: collect a job's sources, lay out its prompt, trim it to fit.

This is everything that happens before inference, on prep workers, without holding an inference
slot (the Celery prep task in fleet/worker/jobs/prep.py calls ``prepare`` and hands the result on).

Layout (prefix-cache friendly, see fleet/prep/prefix.py)::

    [project system_prompt] [job's leading system messages]     stable prefix, byte-identical
    [one user message per collected source, untrusted flag]       material
    [the job's other messages, in order]                          the conversation

Steps, by job kind:
  * every kind: collect the sources (fleet/prep/collect.py). A failed source whose ``required`` is
    true, or whose ``required`` is unset on a job with ``on_source_error: "fail"``, raises
    ``CollectFailed`` naming every such source and its reason; otherwise it is dropped with a
    warning (and listed in ``material`` with its ``error``).
  * ``collect``: stop there; ``material`` entries carry the texts. No trimming, no fit check.
  * ``trim``, ``infer``, ``collect+trim+infer``: on collected material, whitespace
    normalisation and near-duplicate paragraphs per ``job.trim`` (default TrimPolicy); then
    per-source quotas (``Source.quota_tokens``); then, if the prompt is longer than
    ``room_tokens``, the trimmable texts are cut (fleet/prep/trim.py) to shares of what is left after
    the fixed parts. Trimmable: collected material and untrusted user messages with plain text
    content (material the producer inlined). Fixed: system messages, trusted messages, tool
    schemas. ``trim`` jobs also get the texts in ``material``.

Guarantee: on success ``prompt_tokens <= room_tokens``, where ``prompt_tokens`` is the count of
the final message list (chat template and tools included) by the counter, exact when the backend
answered (``exact``), else the conservative estimate, flagged in ``warnings``. The final count
is what is checked; per-piece counts only steer the cuts, and a miss (token counts of pieces do
not add up exactly) shrinks the budget by the overshoot plus a margin and tries again, a bounded
number of rounds. When it cannot fit (``allow_trim`` false, nothing trimmable, or the fixed
parts alone too big) ``PromptTooLong`` states the prompt tokens, the room, ``max_model_len`` and
the project's prompt budget.

``allow_trim`` false forbids cutting to fit; explicit per-source quotas still apply (the producer
asked for them) and so do the whitespace/duplicate steps its TrimPolicy names.
Between collecting and trimming the job's cancel request (``{p}cancel:{<ref>}``, only if signed by
the job's project) is checked, so a
cancelled job stops before its most expensive remaining step (raises ``Cancelled``); a job without
sources collects nothing, so it is not read again there (the prep task checked it just before; the
gateway made the job id a moment ago).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import redis

from fleet.core.config import ProjectSettings, Settings
from fleet.core.errors import Cancelled, CollectFailed, PromptTooLong
from fleet.core.keys import Keys, job_ref
from fleet.core.models import Job, Message, TrimPolicy
from fleet.core.promptcache import leading_system
from fleet.core.request import build_request_messages, new_fence_tag, tools_allowed
from fleet.core.routing import route
from fleet.core.seal import cancel_valid
from fleet.prep.collect import Collected, Collector
from fleet.prep.prefix import prefix_warning, stable_prefix
from fleet.prep.tokens import TokenCounter
from fleet.prep.trim import Fitted, allocate, drop_near_duplicates, fit_text, normalise_whitespace

log = logging.getLogger(__name__)

MAX_ROUNDS = 4
MIN_MARGIN_TOKENS = 16


@dataclass
class Prepared:
    messages: list[Message]
    prompt_tokens: int
    exact: bool
    material: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    prefix_tokens: int = 0  # the stable prefix (0 when there is none)
    fence_tag: str = ""  # the untrusted-data fence tag the count used; inference sends the same


class _Tally:
    """Counts through the TokenCounter and remembers whether any count was an estimate.

    ``prompt`` counts a message list the way fleet/infer/attempts.py will send it: untrusted parts
    neutralised and fenced with the data note, tools as ``tools_allowed`` leaves them
    (fleet/core/request.py). Both are deterministic functions of the job and the fence tag drawn
    here (stored with the prepared job), so the count made here is the count vLLM sees.
    """

    def __init__(self, counter: TokenCounter, job: Job, project: ProjectSettings) -> None:
        self.counter = counter
        self.job = job
        self.project = project
        self.fence_tag = new_fence_tag()
        self.estimated = False

    def text(self, text: str) -> int:
        tokens, exact = self.counter.count_text(text)
        self.estimated |= not exact
        return tokens

    def prompt(self, messages: list[Message]) -> tuple[int, bool]:
        view = self.job.model_copy(update={"messages": messages, "sources": []})
        wire, _ = build_request_messages(view, self.fence_tag)
        tools, _, _ = tools_allowed(view, self.project)
        return self._count(wire, tools)

    def plain(self, messages: list[Message]) -> tuple[int, bool]:
        return self._count([m.to_openai() for m in messages], None)

    def _count(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[int, bool]:
        tokens, exact = self.counter.count_messages(messages, tools)
        self.estimated |= not exact
        return tokens, exact


@dataclass
class _Piece:
    """A trimmable text: collected material or an untrusted user message."""

    label: str
    original: str
    header: str = ""
    entry: dict[str, Any] | None = None  # the material entry this piece reports into
    source_index: int | None = None  # its place in job.sources, for the quota
    text: str = ""
    size: int = -1  # tokens of ``original``
    elided_tokens: int = 0

    def __post_init__(self) -> None:
        self.text = self.original

    @property
    def trimmed(self) -> bool:
        return self.text != self.original


@dataclass
class _Slot:
    """One message of the prompt; its content comes from ``piece`` when it has one."""

    message: Message
    piece: _Piece | None = None

    def build(self, blank: bool = False) -> Message:
        if self.piece is None:
            return self.message
        text = "" if blank else self.piece.text
        return self.message.model_copy(update={"content": self.piece.header + text})


def prepare(
    job: Job,
    settings: Settings,
    project: ProjectSettings,
    client: redis.Redis,
    keys: Keys,
    room_tokens: int,
    counter: TokenCounter,
    *,
    collector: Collector | None = None,
) -> Prepared:
    """Collect, lay out and trim ``job``; see the module docstring for the guarantees."""
    route(settings, project, job.model)  # a model no backend serves: UnknownModel, before any work
    warnings: list[str] = []
    collected = _collect(job, settings, collector, warnings)
    material = [_entry(item) for item in collected]
    if job.sources:  # nothing collected: the caller's check a moment ago stands
        _check_cancelled(job, settings, client, keys)
    tally = _Tally(counter, job, project)
    prefix = stable_prefix(project, job)
    slots, pieces = _layout(job, prefix, collected, material)
    if job.kind == "collect":
        tokens, exact = tally.prompt([s.build() for s in slots])
    else:
        _tidy(pieces, job.trim or TrimPolicy(), job)
        _apply_quotas(pieces, job, tally)
        tokens, exact = _fit(job, slots, pieces, room_tokens, tally, settings, project)
        _report_trims(pieces, warnings)
    prefix_tokens = _prefix_check(prefix, tally, settings, warnings)
    _finish_material(material, pieces, tally, job)
    if tally.estimated:
        warnings.append(
            f"token counts are estimates (~3.94 chars/token): {counter.last_failure or 'backend'}"
        )
    return Prepared([s.build() for s in slots], tokens, exact, material, warnings, prefix_tokens,
                    fence_tag=tally.fence_tag)


# -- collect --------------------------------------------------------------------------------
def _collect(
    job: Job, settings: Settings, collector: Collector | None, warnings: list[str]
) -> list[Collected]:
    if not job.sources:
        return []
    if collector is None:
        with Collector(settings.collect) as own:
            collected = own.collect(job.sources, job.project)
    else:
        collected = collector.collect(job.sources, job.project)
    fatal = []
    for item in collected:
        if item.ok:
            warnings.extend(f"source {item.name!r}: {note}" for note in item.notes)
            continue
        required = item.required if item.required is not None else job.on_source_error == "fail"
        if required:
            fatal.append(f"source {item.name!r} ({item.type}): {item.error}")
        else:
            warnings.append(f"source {item.name!r} ({item.type}) dropped: {item.error}")
    if fatal:
        raise CollectFailed("; ".join(fatal))
    return collected


def _entry(item: Collected) -> dict[str, Any]:
    return {
        "name": item.name,
        "type": item.type,
        "chars": len(item.text),
        "collected_chars": len(item.text),
        "tokens": 0,
        "untrusted": item.untrusted,
        "trimmed": False,
        "error": item.error,
        "content_type": item.content_type,
    }


def _check_cancelled(job: Job, settings: Settings, client: redis.Redis, keys: Keys) -> None:
    try:
        request = client.get(keys.cancel(job_ref(job.project, job.id)))
    except redis.RedisError as exc:
        log.warning("cannot check the cancel flag of job %s: %s", job.id, exc)
        return
    if cancel_valid(settings, job.project, job.id, request):  # type: ignore[arg-type]
        raise Cancelled(f"job {job.id} was cancelled during preparation")


# -- layout ---------------------------------------------------------------------------------
def _layout(
    job: Job, prefix: list[Message], collected: list[Collected], material: list[dict[str, Any]]
) -> tuple[list[_Slot], list[_Piece]]:
    slots = [_Slot(m) for m in prefix]
    pieces: list[_Piece] = []
    for item, entry in zip(collected, material, strict=True):
        if not item.ok:
            continue
        piece = _Piece(item.name, item.text, f"[source: {item.name}]\n", entry, item.index)
        slots.append(_Slot(Message(role="user", untrusted=item.untrusted), piece))
        pieces.append(piece)
    for index, message in enumerate(job.messages[len(leading_system(job)) :]):
        if message.role == "user" and message.untrusted and isinstance(message.content, str):
            piece = _Piece(f"message #{index + 1}", message.content)
            slots.append(_Slot(message, piece))
            pieces.append(piece)
        else:
            slots.append(_Slot(message))
    return slots, pieces


# -- trim -----------------------------------------------------------------------------------
def _tidy(pieces: list[_Piece], policy: TrimPolicy, job: Job) -> None:
    """Whitespace and near-duplicates: always on material, on messages only if asked for."""
    for piece in pieces:
        if piece.entry is None and job.trim is None:
            continue
        text = piece.original
        if policy.normalise_whitespace:
            text = normalise_whitespace(text)
        if policy.drop_near_duplicates:
            text, dropped = drop_near_duplicates(text)
            if piece.entry is not None and dropped:
                piece.entry["duplicates_dropped"] = dropped
        piece.original = piece.text = text


def _apply_quotas(pieces: list[_Piece], job: Job, tally: _Tally) -> None:
    policy = job.trim or TrimPolicy()
    quotas = {i: s.quota_tokens for i, s in enumerate(job.sources) if s.quota_tokens}
    for piece in pieces:
        piece.size = tally.text(piece.original)
        quota = quotas.get(piece.source_index) if piece.source_index is not None else None
        if quota is not None and piece.size > quota:
            fitted = _fit_piece(piece, quota, tally, policy)
            piece.original = piece.text = fitted.text
            piece.elided_tokens = fitted.elided_tokens
            piece.size = fitted.tokens
            if piece.entry is not None:
                piece.entry["trimmed"] = True


def _fit(
    job: Job,
    slots: list[_Slot],
    pieces: list[_Piece],
    room: int,
    tally: _Tally,
    settings: Settings,
    project: ProjectSettings,
) -> tuple[int, bool]:
    full, exact = tally.prompt([s.build() for s in slots])
    if full <= room:
        return full, exact
    too_long = _TooLong(full, room, settings, project)
    if not job.allow_trim:
        raise too_long("trimming is not allowed (allow_trim is false)")
    if not pieces:
        raise too_long("nothing in it can be trimmed (only material and untrusted user text can)")
    fixed, _ = tally.prompt([s.build(blank=True) for s in slots])
    available = room - fixed
    policy = job.trim or TrimPolicy()
    for _round in range(MAX_ROUNDS):
        if available <= 0:
            raise too_long(f"the parts that cannot be trimmed are {fixed} tokens on their own")
        limits = allocate([p.size for p in pieces], available)
        for piece, limit in zip(pieces, limits, strict=True):
            _cut(piece, limit, tally, policy)
        full, exact = tally.prompt([s.build() for s in slots])
        if full <= room:
            return full, exact
        too_long.prompt_tokens = full
        available -= (full - room) + max(MIN_MARGIN_TOKENS, math.ceil(0.01 * available))
    raise too_long(f"trimming did not converge in {MAX_ROUNDS} rounds")


def _cut(piece: _Piece, limit: int, tally: _Tally, policy: TrimPolicy) -> None:
    if piece.size <= limit:
        piece.text = piece.original
        return
    fitted = _fit_piece(piece, limit, tally, policy)
    piece.text = fitted.text
    piece.elided_tokens = fitted.elided_tokens


def _fit_piece(piece: _Piece, limit: int, tally: _Tally, policy: TrimPolicy) -> Fitted:
    """``piece``'s original text cut to ``limit`` tokens by the job's trim policy."""
    return fit_text(piece.original, limit, tally.text, strategy=policy.strategy,
                    head_fraction=policy.head_fraction, tokens=piece.size)


class _TooLong:
    """Builds PromptTooLong with the numbers the issue asks for."""

    def __init__(self, prompt_tokens: int, room: int, settings: Settings, project: ProjectSettings):
        self.prompt_tokens = prompt_tokens
        self.room = room
        self.max_model_len = settings.backend.max_model_len
        self.budget = project.prompt_budget_tokens

    def __call__(self, reason: str) -> PromptTooLong:
        budget = self.budget if self.budget is not None else "none"
        exc = PromptTooLong(
            f"prompt is {self.prompt_tokens} tokens but only {self.room} fit "
            f"(max_model_len {self.max_model_len} minus max_tokens; project prompt budget "
            f"{budget}): {reason}"
        )
        exc.prompt_tokens, exc.room_tokens = self.prompt_tokens, self.room
        return exc


def _report_trims(pieces: list[_Piece], warnings: list[str]) -> None:
    cut = [p for p in pieces if p.trimmed or p.elided_tokens]
    if cut:
        names = ", ".join(f"{p.label} (~{p.elided_tokens} tokens elided)" for p in cut)
        warnings.append(f"trimmed: {names}")


# -- report ---------------------------------------------------------------------------------
def _prefix_check(
    prefix: list[Message], tally: _Tally, settings: Settings, warnings: list[str]
) -> int:
    if not prefix:
        return 0
    tokens, exact = tally.plain(prefix)
    warning = prefix_warning(tokens, settings.backend.block_tokens, exact)
    if warning:
        warnings.append(warning)
    return tokens


def _finish_material(
    material: list[dict[str, Any]], pieces: list[_Piece], tally: _Tally, job: Job
) -> None:
    with_text = job.kind in ("collect", "trim")
    for piece in pieces:
        if piece.entry is None:
            continue
        piece.entry["chars"] = len(piece.text)
        piece.entry["tokens"] = tally.text(piece.text)
        piece.entry["trimmed"] = piece.entry["trimmed"] or piece.trimmed
        if piece.elided_tokens:
            piece.entry["elided_tokens"] = piece.elided_tokens
        if with_text:
            piece.entry["text"] = piece.text
