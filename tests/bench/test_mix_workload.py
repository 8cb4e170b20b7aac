"""The mix scenario's workload (fleet/bench/fleet/mix.py): a tenth of each project's jobs long,
staggered between projects, and only the named projects' short jobs in the interactive band."""

from __future__ import annotations

from collections import Counter

from fleet.bench.fleet.mix import MIXES, banded
from fleet.bench.fleet.workload import PROJECTS, short_mix, with_long, with_long_each


def test_every_project_sends_a_tenth_of_its_jobs_long_and_not_all_at_once() -> None:
    specs = with_long_each(short_mix(200, 200, 50), 0.1)
    assert Counter(s.project for s in specs if s.long) == dict.fromkeys(PROJECTS, 4)
    positions = [i for i, s in enumerate(specs) if s.long]
    assert min(b - a for a, b in zip(positions, positions[1:], strict=False)) > 1  # never two in a row
    # the one-project construction it replaces in this scenario
    assert {s.project for s in with_long(short_mix(200, 200, 50), 0.1) if s.long} == {"research"}


def test_only_the_named_projects_short_jobs_are_interactive() -> None:
    specs = with_long_each(short_mix(100, 200, 50), 0.1)
    bands = {label: Counter((s.project, s.long, s.band) for s in banded(specs, projects))
             for label, projects in MIXES}
    batch_only, beside, deployment = (bands[label] for label, _ in MIXES)
    assert {band for (_p, _l, band) in batch_only} == {"batch"}
    assert {p for (p, _long, band) in beside if band == "interactive"} == {"assistant", "triage"}
    assert {p for (p, _long, band) in deployment if band == "interactive"} == {"assistant"}
    assert not any(long and band == "interactive" for counts in bands.values() for (_p, long, band) in counts)
