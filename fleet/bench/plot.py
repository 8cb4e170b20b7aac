"""``--plot DIR``: a bench run's charts as PNG files (matplotlib, the ``bench`` extra), drawn from
the series the run kept (fleet/bench/charts.py). Each chart is written only when its run produced
its series (``fleet bench dispatch`` the first three, ``fleet bench loops`` the last):

  inflight.png     sequences running at the backend against its cap over time, per run (the
                   fleet, and the same jobs from the ideal closed loop and 5 clients x 16), with
                   the leases the fleet's dispatcher held
  token_share.png  each project's share of the backend's tokens admitted over time (fairness
                   scenario), its weight's share dashed beside it
  latency.png      the distribution (CDF) of the saturation jobs' end-to-end latency, one line
                   per policy
  loop_cuts.png    where the loop watcher cut looping traces: each real trace's length, loop
                   onset and cut (and the watcher's without the short-cycle detector), and the
                   tokens streamed past the onset before the cut on the short capped loops

Failure cases: a DIR that cannot be created raises OSError before anything is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleet.bench.charts import Charts

DPI = 110
SHARE_BINS = 20


def write_charts(charts: Charts, folder: str | Path) -> list[Path]:
    """Draw every chart ``charts`` has the series of into ``folder``; the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    drawn = [("inflight.png", _inflight, bool(charts.inflight)),
             ("token_share.png", _shares, bool(charts.shares)),
             ("latency.png", _latency, any(charts.latencies.values())),
             ("loop_cuts.png", _loop_cuts, bool(charts.loops))]
    written = []
    for name, draw, has_series in drawn:
        if has_series:
            written.append(_save(draw(charts), out / name))
    return written


def _save(figure: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def _inflight(charts: Charts) -> Any:
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(8, 4))
    for run, series in charts.inflight.items():
        ax.plot([t for t, _, _ in series], [r for _, r, _ in series], label=f"{run}: running at the backend",
                linewidth=1.2)
    fleet = charts.inflight.get("fleet", [])
    if any(leases is not None for _, _, leases in fleet):
        ax.plot([t for t, _, lease in fleet if lease is not None],
                [lease for _, _, lease in fleet if lease is not None], linestyle=":", color="black",
                linewidth=1, label="fleet: leases the dispatcher holds")
    ax.axhline(charts.cap, color="red", linestyle="--", linewidth=1, label=f"cap (max_num_seqs {charts.cap})")
    ax.set(xlabel="seconds since the run's first admission (fleet) or first request", ylabel="sequences in flight",
           title="In flight against the cap (saturation scenario)")
    ax.set_ylim(bottom=0, top=max(charts.cap * 1.6, 1))
    ax.legend(fontsize=8, loc="upper right")
    return figure


def _shares(charts: Charts) -> Any:
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(8, 4))
    end = max(t for series in charts.shares.values() for t, _ in series)
    width = max(end, 1e-6) / SHARE_BINS
    totals = [0.0] * SHARE_BINS
    per: dict[str, list[float]] = {p: [0.0] * SHARE_BINS for p in charts.shares}
    for project, series in charts.shares.items():
        for t, cost in series:
            i = min(SHARE_BINS - 1, int(t / width))
            per[project][i] += cost
            totals[i] += cost
    mids = [(i + 0.5) * width for i in range(SHARE_BINS)]
    weight_sum = sum(charts.weights.get(p, 1.0) for p in charts.shares) or 1.0
    for project in sorted(per):
        shares = [100 * c / t if t else float("nan") for c, t in zip(per[project], totals, strict=True)]
        line, = ax.plot(mids, shares, marker=".", label=project)
        ax.axhline(100 * charts.weights.get(project, 1.0) / weight_sum, color=line.get_color(),
                   linestyle="--", linewidth=0.8)
    backlogged = min(max(t for t, _ in series) for series in charts.shares.values())
    ax.axvline(backlogged, color="grey", linestyle=":", linewidth=1,
               label="last admission of the first project to run out")
    ax.set(xlabel="seconds since the dispatcher started (admission time)",
           ylabel="% of the tokens admitted",
           title="Per-project token share over time (fairness; dashed: the weight's share)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper right")
    return figure


def _latency(charts: Charts) -> Any:
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(8, 4))
    for policy, values in charts.latencies.items():
        if not values:
            continue
        ordered = sorted(values)
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post",
                label=f"{policy} ({len(ordered)} jobs)")
    ax.set(xlabel="latency, s (the run's first admission or first request to the job's final result)",
           ylabel="share of jobs finished",
           title="Latency distribution of the same jobs, one line per policy (saturation)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower right")
    return figure


def _loop_cuts(charts: Charts) -> Any:
    import matplotlib.pyplot as plt

    real = [t for t in charts.loops if t.kind == "real"]
    short = [t for t in charts.loops if t.kind != "real"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, max(3.5, 0.28 * len(real) + 1.5)))
    for row, trace in enumerate(real):
        left.barh(row, trace.tokens, color="lightgrey", height=0.6)
        left.plot(trace.onset, row, marker="|", color="orange", markersize=14)
        if trace.old_cut is not None:
            left.plot(trace.old_cut, row, marker="o", color="tab:blue", markersize=5, fillstyle="none")
        if trace.cut is not None:
            left.plot(trace.cut, row, marker="x", color="red", markersize=7)
    left.set_yticks(range(len(real)), [t.name[-22:] for t in real], fontsize=7)
    left.plot([], [], marker="|", color="orange", linestyle="", label="loop onset")
    left.plot([], [], marker="x", color="red", linestyle="", label="cut")
    left.plot([], [], marker="o", color="tab:blue", linestyle="", fillstyle="none",
              label="cut without the short-cycle detector")
    left.set(xlabel="tokens into the trace (grey: its length)",
             title=f"Real looping traces ({len(real)})" if real else "Real looping traces: none on this machine")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    new = [t.cut - t.onset for t in short if t.cut is not None and t.cut >= t.onset]
    old = [t.old_cut - t.onset for t in short if t.old_cut is not None and t.old_cut >= t.onset]
    import numpy

    bins = numpy.histogram_bin_edges(new + old or [0], bins=30)  # one set of bins for both
    right.hist(new, bins=bins, histtype="step", linewidth=1.6, color="red",
               label=f"watcher: {len(new)} of {len(short)} cut")
    right.hist(old, bins=bins, histtype="step", linewidth=1.2, color="tab:blue", linestyle="--",
               label=f"without the short-cycle detector: {len(old)} cut")
    right.set(xlabel="tokens streamed after the loop began, before the cut", ylabel="traces",
              title="Short capped loops (generated)")
    right.legend(fontsize=7)
    return figure
