"""bench/fleet/sim.py's simulation: shared load reports beat each coordinator's own view at K=8.

A simulation of encoder timing driving the real policy code (assign, Backlog, CostModel,
predicted_backlog): the real fleet cannot run here. The full grid is `python -m bench.fleet.sim`.
"""

from __future__ import annotations

import pytest

from bench.fleet import sim as fleet


def test_a_batch_on_a_freezing_encoder_waits_out_the_freeze() -> None:
    start = fleet.FIRST_FREEZE - 0.5
    assert fleet.frozen_extension(start, 0.2) == pytest.approx(start + 0.2)  # done before it stops
    # 0.5 s before the stop, 0.5 s during it, the rest after it.
    assert fleet.frozen_extension(start, 1.0) == pytest.approx(fleet.FIRST_FREEZE + fleet.FREEZE_FOR + 0.5)
    inside = fleet.FIRST_FREEZE + 0.5
    assert fleet.frozen_extension(inside, 0.1) == pytest.approx(fleet.FIRST_FREEZE + fleet.FREEZE_FOR + 0.1)


def test_eight_coordinators_balance_better_on_shared_reports_than_on_their_own_view() -> None:
    pool = [1.0, 1.0, 1.0, 0.5]
    run = {policy: fleet.simulate(8, pool, 0.85, policy, 0.005, 1500, seed=3, freeze=False)
           for policy in ("own_view", "shared", "oracle")}
    assert run["shared"]["p99"] * 1.3 < run["own_view"]["p99"]
    assert run["shared"]["p99"] <= 1.25 * run["oracle"]["p99"]


def test_a_cell_is_the_same_run_for_the_same_seed() -> None:
    # The coordinators' dice (assignment.Spread) are seeded from the cell's seed: reruns repeat.
    pool = [1.0] * 7 + [0.5]
    runs = [fleet.simulate(8, pool, 0.85, "shared_hedge", 0.005, 600, seed=5, freeze=False) for _ in range(2)]
    assert runs[0] == runs[1]
    other = fleet.simulate(8, pool, 0.85, "shared_hedge", 0.005, 600, seed=6, freeze=False)
    assert other != runs[0]
