"""What a bench run keeps for its charts (``--plot DIR``; drawn by fleet/bench/plot.py): the series
the scenarios already measure, gathered where they are measured, nothing sampled twice.

``inflight``   per run (fleet, ideal closed loop, 5 clients x 16): (seconds since the run's first
               admission (fleet) or first request (the others),
               sequences running at the simulator, leases the dispatcher store holds; None for a
               run without a dispatcher), from the saturation scenario's ``Sampler``
``cap``        backend.max_num_seqs of those runs
``shares``     per project: (admitted at, seconds since the dispatcher started; the job's backend
               cost in tokens), from the fairness scenario's envelopes; ``weights`` beside them
``latencies``  per policy: end-to-end seconds of each job (from the run's first admission or
               first request to its final result), the saturation scenario's same jobs under each
``loops``      per looping trace replayed through the loop watcher (fleet bench loops): its
               length, where the loop began and where the watcher cut it (tokens; None: never),
               and the watcher without the short-cycle detector's cut
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoopTrace:
    name: str
    kind: str  # "real" or "short capped" (generated)
    tokens: int
    onset: int
    cut: int | None
    old_cut: int | None


@dataclass
class Charts:
    cap: int = 0
    inflight: dict[str, list[tuple[float, int, int | None]]] = field(default_factory=dict)
    shares: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    loops: list[LoopTrace] = field(default_factory=list)
