"""Digest affinity (affinity.py): rendezvous ranking, what encoders hold, the bounded-load choice."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from encdis.llm_node.coordinator.affinity import FRUITLESS_ASKS, Affinity, HeldDigests, affinity_assign, rank
from encdis.llm_node.coordinator.assignment import EncoderLoad, assign
from encdis.llm_node.coordinator.cost_model import CostModel
from encdis.llm_node.coordinator.load_reports import LoadReport
from encdis.llm_node.coordinator.settings import CoordinatorSettings

DIGESTS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4000)]
KEYS = [f"10.0.0.{i}:50051" for i in range(8)]


def tops(keys: list[str]) -> dict[str, str]:
    return {d: keys[rank(d, keys)[0]] for d in DIGESTS}


def loads(backlogs: list[float], keys: list[str] | None = None) -> list[EncoderLoad]:
    keys = keys or KEYS[: len(backlogs)]
    return [EncoderLoad(k, b, CostModel(0.0, 1e-3, 0.0)) for k, b in zip(keys, backlogs, strict=True)]


def test_ranking_is_the_same_whatever_the_order_of_the_pool() -> None:
    for d in DIGESTS[:200]:
        shuffled = KEYS[3:] + KEYS[:3]
        assert [KEYS[i] for i in rank(d, KEYS)] == [shuffled[i] for i in rank(d, shuffled)]


def test_removing_an_encoder_moves_only_its_digests() -> None:
    before = tops(KEYS)
    gone = KEYS[5]
    after = tops([k for k in KEYS if k != gone])
    moved = {d for d in DIGESTS if before[d] != after[d]}
    assert moved == {d for d in DIGESTS if before[d] == gone}
    assert moved  # it did hold some


def test_adding_an_encoder_moves_about_one_in_n() -> None:
    before = tops(KEYS)
    new = "10.0.0.99:50051"
    after = tops([*KEYS, new])
    moved = [d for d in DIGESTS if before[d] != after[d]]
    assert all(after[d] == new for d in moved)  # only to the newcomer
    assert 0.7 / 9 < len(moved) / len(DIGESTS) < 1.3 / 9


def test_digests_spread_evenly() -> None:
    counts = Counter(tops(KEYS).values())
    mean = len(DIGESTS) / len(KEYS)
    assert set(counts) == set(KEYS)
    assert max(counts.values()) < 1.2 * mean and min(counts.values()) > 0.8 * mean


def test_an_idle_pool_sends_each_digest_to_its_top_encoder() -> None:
    for d in DIGESTS[:100]:
        assert affinity_assign([1000], [d], loads([0.0] * 8), slack=1.0) == [rank(d, KEYS)[0]]


def test_a_hot_digest_spills_to_the_next_ranked_once_the_top_is_behind_by_more_than_its_cost() -> None:
    d = DIGESTS[0]
    order = rank(d, KEYS)
    cost = 1000 * 1e-3  # the image's forward: 1 s
    backlogs = [0.0] * 8
    backlogs[order[0]] = 0.9 * cost  # behind by less than its cost: stays
    assert affinity_assign([1000], [d], loads(backlogs), slack=1.0) == [order[0]]
    backlogs[order[0]] = 1.1 * cost  # behind by more: the next ranked, not just any idle one
    assert affinity_assign([1000], [d], loads(backlogs), slack=1.0) == [order[1]]
    backlogs[order[1]] = 5.0  # both behind: the third
    assert affinity_assign([1000], [d], loads(backlogs), slack=1.0) == [order[2]]
    # A bigger slack tolerates more.
    assert affinity_assign([1000], [d], loads(backlogs), slack=2.0) == [order[0]]


def test_only_seen_backlog_makes_a_digest_leave_its_top_encoder() -> None:
    # Lateness and other nodes' unseen work are per-node estimates: a spill on them would send one
    # digest to different encoders from different LLM nodes. What the encoder reported spills it.
    d = DIGESTS[2]
    order = rank(d, KEYS)
    model = CostModel(0.0, 1e-3, 0.0)
    estimated = [EncoderLoad(k, 5.0 if e == order[0] else 0.0, model, 0.0) for e, k in enumerate(KEYS)]
    assert affinity_assign([1000], [d], estimated, slack=1.0) == [order[0]]
    seen = [EncoderLoad(k, 5.0 if e == order[0] else 0.0, model, 5.0 if e == order[0] else 0.0)
            for e, k in enumerate(KEYS)]
    assert affinity_assign([1000], [d], seen, slack=1.0) == [order[1]]


def test_a_big_image_waits_at_most_the_mean_images_cost_for_its_encoder() -> None:
    # Pinning a 4K image behind up to its own cost would double its latency: Affinity caps the
    # tolerance at the moving mean image's cost.
    aff = Affinity(CoordinatorSettings())
    small = [DIGESTS[500 + i] for i in range(50)]
    for d in small:
        aff.assign([100], [d], loads([0.0] * 8))
    assert aff.mean_cost == pytest.approx(0.1)
    d = DIGESTS[3]
    order = rank(d, KEYS)
    backlogs = [0.0] * 8
    backlogs[order[0]] = 0.5  # far less than the big image's 4 s, more than the mean image's 0.1 s
    assert affinity_assign([4000], [d], loads(backlogs), slack=1.0) == [order[0]]  # uncapped: stays
    assert aff.assign([4000], [d], loads(backlogs)) == [order[1]]


def test_a_known_hit_goes_to_its_holder_whatever_its_queue() -> None:
    # An encoder answers a hit from its cache at once, with no forward and no place in its queue.
    d = DIGESTS[1]
    order = rank(d, KEYS)
    held = HeldDigests()
    backlogs = [0.0] * 8
    backlogs[order[0]] = 3.0  # far behind: a forward there would spill
    backlogs[order[1]] = 3.0
    assert affinity_assign([1000], [d], loads(backlogs), slack=1.0, held=held) == [order[2]]
    held.learn(KEYS[order[0]], d)
    assert affinity_assign([1000], [d], loads(backlogs), slack=1.0, held=held) == [order[0]]
    # Held by the second ranked only: there, not a new forward at an idle top.
    held2 = HeldDigests()
    held2.learn(KEYS[order[1]], d)
    assert affinity_assign([1000], [d], loads([0.0] * 8), slack=1.0, held=held2) == [order[1]]
    # Many images of the same request at the holder cost transfers, not forwards.
    many = DIGESTS[100:110]
    for x in many:
        held.learn(KEYS[order[0]], x)
    picks = affinity_assign([1000] * 10, many, loads([0.0] * 8), slack=0.0, held=held,
                            transfer_seconds_per_patch=1e-6)
    assert picks == [order[0]] * len(many)  # ten transfers (10 ms) beat any forward (1 s)


def test_images_to_be_forwarded_are_asked_of_their_two_top_encoders_first() -> None:
    aff = Affinity(CoordinatorSettings())
    d, e = DIGESTS[5], DIGESTS[6]
    od, oe = rank(d, KEYS), rank(e, KEYS)
    # Alone, a node knows what it sent where: nothing to ask until an encoder answers from its
    # cache something this node never sent it (a hit on its own sends does not count).
    assert aff.to_ask([1000], [d], loads([0.0] * 8)) == {}
    aff.observe(KEYS[0], 1000, DIGESTS[7], 0.01)
    aff.observe(KEYS[0], 1000, DIGESTS[7], 0.01, cached=True)
    assert not aff.shared
    aff.observe(KEYS[1], 1000, DIGESTS[8], 0.01, cached=True)
    assert aff.shared
    # Or a load report of images in flight that cannot be ours: none outstanding there, and our
    # last embedding from it arrived before the report was made.
    other = Affinity(CoordinatorSettings())
    other.observe(KEYS[0], 1000, DIGESTS[7], 0.01)
    busy = LoadReport(queued_patches=500.0, images_in_flight=2.0, drain_seconds=0.1, utilization=0.5,
                      received_at=time.monotonic() - 10.0)  # made before our embedding arrived: may be ours
    other.see_report(KEYS[0], busy, own_patches=0)
    other.see_report(KEYS[0], dataclasses.replace(busy, received_at=time.monotonic()), own_patches=300)
    other.see_report(KEYS[0], dataclasses.replace(busy, images_in_flight=0.0, received_at=time.monotonic()), 0)
    assert not other.shared
    other.see_report(KEYS[0], dataclasses.replace(busy, received_at=time.monotonic()), own_patches=0)
    assert other.shared
    ask = aff.to_ask([1000, 1000], [d, e], loads([0.0] * 8))
    assert {k: sorted(v) for k, v in ask.items()} == {
        k: sorted(x for x, o in ((d, od), (e, oe)) if k in o[:2]) for k in set(od[:2]) | set(oe[:2])}
    # What an encoder says it holds is learnt (an answer of the wrong length is not trusted),
    # and a known hit is not asked about again.
    aff.answers(KEYS[od[1]], [d, e], [True])
    assert not aff.held.holds(KEYS[od[1]], d)
    aff.answers(KEYS[od[1]], [d], [True])
    assert aff.assign([1000], [d], loads([0.0] * 8)) == [od[1]]
    assert all(d not in v for v in aff.to_ask([1000], [d], loads([0.0] * 8)).values())
    # Images that repeat across nodes nowhere: asking stops, until a reply shows one that does.
    fresh = DIGESTS[1000:1000 + FRUITLESS_ASKS]
    aff.answers(KEYS[0], fresh, [False] * len(fresh))
    assert aff.to_ask([1000], [e], loads([0.0] * 8)) == {}
    aff.observe(KEYS[2], 1000, DIGESTS[9], 0.01, cached=True)
    assert aff.to_ask([1000], [e], loads([0.0] * 8)) != {}


def test_non_repeating_images_stay_balanced() -> None:
    # A request of many distinct images: the affinity choice's makespan stays within one image's
    # cost (the slack) of the cost-only policy's.
    patches = [1000] * 64
    ds = DIGESTS[200:264]
    picks = affinity_assign(patches, ds, loads([0.0] * 8), slack=1.0)
    base = assign(patches, loads([0.0] * 8))
    span = max(Counter(picks).values())
    assert span <= max(Counter(base).values()) + 1


def handle(cache_bytes: int) -> SimpleNamespace:
    return SimpleNamespace(description=SimpleNamespace(cache_bytes=cache_bytes))


def test_the_off_switch_gives_the_cost_policy_unchanged() -> None:
    aff = Affinity(CoordinatorSettings(affinity="off"))
    assert not aff.applies([handle(1 << 30)] * 3)
    d = DIGESTS[2]
    backlogs = [0.5, 0.0, 0.2]
    keys = KEYS[:3]
    assert aff.assign([1000], [d], loads(backlogs, keys), aff.applies([handle(1)])) == \
        assign([1000], loads(backlogs, keys))


def test_not_applied_when_an_encoder_has_no_cache() -> None:
    aff = Affinity(CoordinatorSettings())
    assert aff.applies([handle(1 << 30)] * 3)
    assert not aff.applies([handle(1 << 30), handle(0), handle(1 << 30)])
    assert not aff.applies([handle(1 << 30), SimpleNamespace(description=None)])
    assert not aff.applies([])


def test_held_digests_are_bounded_and_forgotten() -> None:
    held = HeldDigests(per_encoder=3)
    for d in DIGESTS[:5]:
        held.learn("a", d)
    assert held.count("a") == 3 and not held.holds("a", DIGESTS[0]) and held.holds("a", DIGESTS[4])
    held.learn("a", DIGESTS[2])  # refreshed: now the most recent
    held.learn("a", DIGESTS[5])
    assert held.holds("a", DIGESTS[2]) and not held.holds("a", DIGESTS[3])
    held.forget("a")
    assert held.count("a") == 0


def test_settings_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="--affinity must be on or off"):
        CoordinatorSettings(affinity="maybe")
    with pytest.raises(ValueError, match="--affinity-slack"):
        CoordinatorSettings(affinity_slack=-1.0)
