"""bench/fleet/cache_sim.py's simulation: with digest affinity, a fleet encodes repeats about once.

A simulation of 8 coordinators sharing 8 caching encoders driving the real policy code
(affinity.Affinity, assignment.assign): the real fleet cannot run here. The full table is
`python -m bench.fleet.cache_sim`.
"""

from __future__ import annotations

from bench.fleet import cache_sim as fleet_cache_sim


def cell(workload: str, affinity: bool) -> dict:
    return fleet_cache_sim.run(workload, affinity, coordinators=8, encoders=8, refs=1000, distinct=150,
                               load=0.7, slack=1.0, seed=1)


def test_affinity_halves_the_fleets_forwards_of_repeated_images() -> None:
    on, off = cell("A", True), cell("A", False)
    assert on["forwards_per_distinct"] < 1.4
    assert off["forwards_per_distinct"] > 1.8


def test_affinity_keeps_the_tail_of_all_distinct_traffic() -> None:
    on, off = cell("B", True), cell("B", False)
    assert on["forwards"] == off["forwards"] == 1000  # nothing repeats: every image is a forward
    assert on["p99"] < 1.15 * off["p99"]
