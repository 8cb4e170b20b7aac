"""Fair share across projects: token-weighted start-time fair queuing, bands, priorities, aging.

Pure functions of a snapshot (the heads of every project's queues, virtual times, weights, a
clock). The stores call ``order`` to get the candidates in fair order and ``charge`` when one is
admitted; the admission limits (schedulers/policy/limits.py) then pick the first candidate that fits.

Virtual time (start-time fair queuing on tokens)
  Every project has a finish tag F_p; the system has a virtual time V. A backlogged project's
  start tag is S_p = max(V, F_p). The project with the smallest start tag goes next; admitting a
  job of cost c (prompt + max new tokens: what it takes from the backend) sets
  F_p = S_p + c / weight_p and V = S_p. Over any period in which several projects stay
  backlogged, each gets tokens in proportion to its weight, whatever the job sizes. An idle
  project's start tag is pulled up to V when it comes back, so it cannot hoard credit, and its
  share goes to the others meanwhile (work-conserving).

Queues of one project
  Four sorted sets: band (interactive, batch) x size (short, long: prompt over the long
  threshold). Inside a band the order is by ``pending_score`` = enqueued_at - priority * aging_s:
  a priority-1 job counts as if it had arrived ``aging_s`` earlier, so higher priorities go
  first yet a waiting job gains one priority level per ``aging_s`` and nothing starves. The score
  never changes after submission, so a job whose lease expired goes back to its original place.
  Keeping long prompts apart gives each band a short fallback: when the band's head is a long
  prompt that cannot go (three long ones in flight), the first short job behind it may. In the
  batch band a project's long prompt goes before its short jobs, whatever their places: nobody
  waits on either, and a long prefill then runs early, beside many decoding sequences, instead of
  being left for the end of a backlog where the long prompts prefill one after another beside
  few (the project's fair share is the same either way).
  With several backends each of the four is split by eligibility class (the bit mask of the
  backends a job may run on): a band's candidates are every class's head (and short fallback), in
  line order, so a job only one full backend can take never holds up its project's jobs behind it
  that another backend could run.

Bands and aging across projects
  While some project has interactive work, a project is in tier 0 when it has an interactive job
  or a candidate that has waited ``aging_s`` (the oldest of its candidates counts), else in tier
  1; tier 0 goes first, by virtual time. So fresh interactive work is strictly first, and batch
  work that has waited ``aging_s`` competes with it by weight: a stream of interactive jobs cannot starve batch. With no
  interactive work anywhere there is one tier (age does not put one project's batch before
  another's: that would make a newly arrived project wait ``aging_s`` behind a backlog). Inside
  one project the interactive band is strictly first (a project flooding its own interactive
  band delays only its own batch work).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BANDS = ("interactive", "batch")
SIZES = ("short", "long")


@dataclass(frozen=True)
class Head:
    """A job at the head of one of a project's queues."""

    job_id: str
    project: str
    band: str
    prompt_tokens: int
    max_new_tokens: int
    enqueued_at: float
    score: float  # pending_score(), milliseconds
    long: bool = False
    uncached_tokens: int | None = None  # prep's estimate of the prompt's prefix-cache misses
    eligible: int = 1  # bit mask of the backends it may run on (its queue's class): bit b = backend b
    # the backend expected to hold its longest cached prefix (its uncached tokens count there; on
    # any other the whole prompt does), or None: no backend holds any (placement.pick)
    hint: int | None = None
    # the first job of its queue's score and enqueue time, when locality offered a later one in
    # its place (schedulers/policy/locality.py): the queue keeps its place in every order (the
    # line's score) and its age (``tier``), so which project goes next does not change
    line_score: float | None = None
    line_enqueued_at: float | None = None

    @property
    def place(self) -> float:
        """The score its queue's place in line is ordered by."""
        return self.score if self.line_score is None else self.line_score

    @property
    def waiting_since(self) -> float:
        return self.enqueued_at if self.line_enqueued_at is None else min(self.enqueued_at, self.line_enqueued_at)

    @property
    def cost(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


@dataclass(frozen=True)
class ProjectView:
    project: str
    weight: float
    finish_tag: float
    heads: tuple[Head, ...]  # at most one per (band, size) queue


@dataclass(frozen=True)
class FairSnapshot:
    projects: tuple[ProjectView, ...]
    vtime: float
    now: float


def pending_score(enqueued_at: float, priority: int, aging_s: float) -> float:
    """Sort key inside a band, in milliseconds (see module docstring)."""
    return round((enqueued_at - priority * aging_s) * 1000.0, 3)


def start_tag(vtime: float, finish_tag: float) -> float:
    return max(vtime, finish_tag)


def forgive(vtime: float, finish_tags: Iterable[float]) -> float:
    """Virtual time when an admission finds nothing in flight: the largest finish tag, so a
    drained system starts even. Without it a project that was served far ahead of the others in
    an earlier busy period (its finish tag far beyond V) would get nothing while they catch up,
    long after the period that earned it the lead."""
    return max([vtime, *finish_tags])


def charge(vtime: float, finish_tag: float, weight: float, cost: float) -> tuple[float, float]:
    """Virtual time and the project's finish tag after admitting a job of ``cost`` tokens (its
    prompt and output limit, times its backend's ``charge_per_token``)."""
    start = start_tag(vtime, finish_tag)
    return start, start + cost / weight


def band_candidates(heads: Iterable[Head], band: str) -> list[Head]:
    """Per eligibility class of the band (one queue pair each): its head in line, then (if that
    head is long) its first short job as fallback; all classes' together in line order. In the
    batch band long heads are first whatever their places (module docstring)."""
    by_class: dict[int, list[Head]] = {}
    for h in heads:
        if h.band == band:
            by_class.setdefault(h.eligible, []).append(h)
    out: list[Head] = []
    for in_class in by_class.values():
        in_class.sort(key=lambda h: _line_key(h, band))
        first = in_class[0]
        fallback = [h for h in in_class[1:] if not h.long] if first.long else []
        out += [first, *fallback[:1]]
    out.sort(key=lambda h: _line_key(h, band))
    return out


def _line_key(head: Head, band: str) -> tuple[bool, float, str]:
    """A band's line order: by score (then id); in the batch band long prompts first."""
    return (band == "batch" and not head.long, head.place, head.job_id)


def project_candidates(view: ProjectView) -> list[Head]:
    return [h for band in BANDS for h in band_candidates(view.heads, band)]


def tier(candidates: Sequence[Head], now: float, aging_s: float) -> int:
    """0 for a project whose first candidate is interactive or whose oldest candidate has waited
    ``aging_s``, else 1. The oldest, not the first: in the batch band a fresh long head goes before
    an aged short one, and taking the age from it would cost the short job its aging lift (the
    project would sit in tier 1 for as long as fresh long prompts keep arriving)."""
    if candidates[0].band == "interactive":
        return 0
    oldest = min(c.waiting_since for c in candidates)
    return 0 if now - oldest >= aging_s else 1


def order(snapshot: FairSnapshot, aging_s: float) -> list[Head]:
    """Every candidate, in the order admission should try them."""
    per_project = [(view, project_candidates(view)) for view in snapshot.projects]
    per_project = [(view, candidates) for view, candidates in per_project if candidates]
    banded = any(candidates[0].band == "interactive" for _, candidates in per_project)
    ranked = []
    for view, candidates in per_project:
        key = (
            tier(candidates, snapshot.now, aging_s) if banded else 0,
            start_tag(snapshot.vtime, view.finish_tag),
            candidates[0].place,
            view.project,
        )
        ranked.append((key, candidates))
    ranked.sort(key=lambda pair: pair[0])
    return [head for _, candidates in ranked for head in candidates]


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index of per-project normalised shares (1.0 = perfectly fair)."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return (total * total) / (len(values) * squares) if squares else 1.0
