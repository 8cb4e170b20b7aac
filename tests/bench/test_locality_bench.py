"""``fleet bench locality`` (fleet/bench/locality.py): the replay orders one workload by each policy
through the simulator's own prefix cache; these check what each policy promises, not figures."""

from __future__ import annotations

import subprocess
import sys

from fleet.bench.locality import WEIGHTS, Server, block_hashes, replay, replay_fleet

ADMISSIONS = 500


def test_block_hashes_name_the_prefix_whatever_the_segments() -> None:
    """Equal leading tokens, equal leading block hashes, however the segments split them; a
    different earlier token changes every block after it."""
    block = 100
    whole = block_hashes((("a", 250),), block)
    split = block_hashes((("a", 120), ("other", 130)), block)
    assert len(whole) == len(split) == 2  # whole blocks only
    assert whole[0] == split[0] and whole[1] != split[1]  # the first 100 tokens are the same text
    assert block_hashes((("a", 100), ("b", 150)), block)[0] == block_hashes((("a", 100), ("c", 5)), block)[0]
    assert block_hashes((("a", 100), ("b", 150)), block)[1] != block_hashes((("a", 100), ("c", 150)), block)[1]


def test_dlpm_keeps_its_deficit_bound_and_the_oracle_does_not() -> None:
    deficit = 20_000.0
    dlpm = replay("dlpm", admissions=ADMISSIONS, deficit=deficit)
    oracle = replay("oracle", admissions=ADMISSIONS, deficit=deficit)
    largest_job = (60_000 + Server().max_new) / min(WEIGHTS.values())
    assert dlpm.spread <= deficit + largest_job  # a pick's lead: within the bound before its own charge
    assert oracle.spread > dlpm.spread
    assert oracle.hit_rate >= dlpm.hit_rate - 0.02  # locality first, fairness ignored: the most hits
    fair = replay("fair", admissions=ADMISSIONS)
    assert dlpm.hit_rate > fair.hit_rate  # the editor's cached conversations go before evicted ones
    assert set(fair.served) == set(WEIGHTS) and all(v > 0 for v in fair.served.values())


def test_the_fleet_order_comes_from_the_dispatcher_store() -> None:
    run = replay_fleet(admissions=ADMISSIONS)
    assert run.admissions == ADMISSIONS and set(run.served) == set(WEIGHTS)
    assert 0 < run.hit_rate < 1


def test_the_command_prints_every_policy() -> None:
    done = subprocess.run([sys.executable, "-m", "fleet", "bench", "locality", "--loads", "1.5",
                           "--admissions", "300", "--seeds", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for policy in ("fleet", "fair", "oracle", "dlpm", "dlpm_8", "dlpm_1", "dlpm_wait120"):
        assert f"| {policy} |" in done.stdout
