"""Stale load reports: the others' unseen work is estimated, and images spread as it would have."""

from __future__ import annotations

import random
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from encdis.llm_node.coordinator.assignment import EncoderLoad, Spread, assign, interpreted_choice
from encdis.llm_node.coordinator.cost_model import CostModel
from encdis.llm_node.coordinator.handle import EncoderHandle
from encdis.llm_node.coordinator.identity import ModelIdentity
from encdis.llm_node.coordinator.load_reports import OWN_RATE_ERROR, LoadReport, UnseenWork, predicted_backlog
from encdis.llm_node.coordinator.pool import EncoderPool


def _report(utilization: float, received_at: float, drain: float = 0.0, made_at: float | None = None) -> LoadReport:
    return LoadReport(0.0, 0.0, drain, utilization, received_at=received_at, made_at=made_at)


def test_without_unseen_work_the_choice_is_the_earliest_finish() -> None:
    assert interpreted_choice([3.0, 1.0, 2.0], 0.0, random.Random(0)) == 1


def test_unseen_work_is_water_filled_and_each_encoder_drawn_by_its_share() -> None:
    # 3 s unseen onto finishes 0, 1, 5: level 2 (2 s onto the first, 1 s onto the second), so
    # 2/3 and 1/3 of the draws; the third is above the level and never drawn.
    rng = random.Random(1)
    drawn = Counter(interpreted_choice([0.0, 1.0, 5.0], 3.0, rng) for _ in range(30000))
    assert drawn[2] == 0
    assert drawn[0] / 30000 == pytest.approx(2 / 3, abs=0.015)
    assert drawn[1] / 30000 == pytest.approx(1 / 3, abs=0.015)


def test_eight_coordinators_reading_one_stale_view_do_not_all_pick_one_encoder() -> None:
    model = CostModel(5e-4, 2.6e-6, 5.2e-11)
    loads = [EncoderLoad(e, b, model) for e, b in enumerate([0.040, 0.046, 0.047, 0.090, 0.120])]
    plain = {assign([2000], loads)[0] for _ in range(8)}
    assert plain == {0}  # the same stale view: the same choice, a herd
    spread = [assign([2000], loads, Spread(0.02, random.Random(node)))[0] for node in range(8)]
    assert len(set(spread)) >= 2
    assert set(spread) <= {0, 1, 2}  # only encoders the unseen work is predicted to reach


def test_a_spread_of_nothing_changes_no_assignment() -> None:
    rng = random.Random(5)
    model = CostModel(5e-4, 2.6e-6, 5.2e-11)
    for _ in range(200):
        sizes = [rng.randint(16, 20000) for _ in range(rng.randint(1, 6))]
        loads = [EncoderLoad(e, rng.random() * 0.1, model) for e in range(4)]
        assert assign(sizes, loads, Spread(0.0, random.Random(0))) == assign(sizes, loads)


def test_unseen_work_is_the_others_rate_times_the_reports_staleness() -> None:
    unseen = UnseenWork(window=1.0)
    now = 100.0
    report = _report(0.75, now - 0.010)  # busy 3/4 of the time: 0.75 s of work per second arrives
    assert unseen.seconds("a", report, now, max_age=1.0) == pytest.approx(0.75 * 0.010)
    for k in range(10000):  # we send it 0.25 s of work per second ourselves
        unseen.sent("a", 0.00025, now - 10.0 + k * 0.001)
    assert unseen.own_rate("a", now) == pytest.approx(0.25, rel=0.05)
    # Our busy time is taken at up to OWN_RATE_ERROR times our predicted rate (our models' error).
    others = 0.75 - OWN_RATE_ERROR * 0.25
    assert unseen.seconds("a", report, now, max_age=1.0) == pytest.approx(others * 0.010, rel=0.05)
    # What we sent elsewhere is not ours here; stale reports and absent ones tell nothing.
    assert unseen.seconds("b", report, now, max_age=1.0) == pytest.approx(0.75 * 0.010)
    assert unseen.seconds("a", _report(0.75, now - 2.0), now, max_age=1.0) == 0.0
    assert unseen.seconds("a", None, now, max_age=1.0) == 0.0
    unseen.forget("a")
    assert unseen.own_rate("a", now) == 0.0


def test_a_lone_coordinator_sees_no_unseen_work() -> None:
    unseen = UnseenWork(window=1.0)
    now = 50.0
    for k in range(20000):  # all of the encoder's work is ours: 1 s per second, priced 10% low
        unseen.sent("a", 0.00045, now - 10.0 + k * 0.0005)
    assert unseen.seconds("a", _report(1.0, now - 0.05), now, max_age=1.0) == pytest.approx(0.0, abs=1e-3)


def test_a_report_is_aged_from_when_the_encoder_made_it_where_that_is_known() -> None:
    model = CostModel(0.0, 1e-3, 0.0)
    made = _report(0.0, received_at=10.0, drain=0.5, made_at=9.9)
    arrived = _report(0.0, received_at=10.0, drain=0.5)
    assert made.age(10.0) == pytest.approx(0.1) and made.made() == 9.9
    assert predicted_backlog(made, 0.0, [], model, 10.0, 1.0, 0.0) == pytest.approx(0.4)
    assert predicted_backlog(arrived, 0.0, [], model, 10.0, 1.0, 0.0) == pytest.approx(0.5)


async def test_the_pool_adds_the_others_unseen_work_to_their_encoder_and_spreads_by_its_sum() -> None:
    ident = ModelIdentity("f", 64, 3136, 200704)
    pool = EncoderPool([], ident, cost_model_factory=CostModel.prior, load_reports=True, report_max_age=1.0)
    theirs = EncoderHandle("127.0.0.1:1", "127.0.0.1:1", CostModel(0.0, 1e-4, 0.0))
    ours = EncoderHandle("127.0.0.1:2", "127.0.0.1:2", CostModel(0.0, 1e-4, 0.0))
    try:
        now = time.monotonic()
        for k in range(2000):  # we alone keep `ours` busy: 1 s of work per second over 10 s
            pool._unseen.sent(ours.address, 0.005, now - 10.0 + k * 0.005)
        # Both report busy all the time, 50 ms ago; only `ours` is busy with our work.
        for h in (theirs, ours):
            h.reports = SimpleNamespace(latest=_report(1.0, now - 0.05))
        unseen_theirs = pool.backlog_seconds(theirs)
        assert unseen_theirs == pytest.approx(0.05, abs=0.01)  # drain 0, aged; the others' 50 ms is not
        assert pool.backlog_seconds(ours) == pytest.approx(0.0, abs=0.01)
        spread = pool.spread([theirs, ours])
        assert spread is not None and spread.unseen_seconds == pytest.approx(0.05, abs=0.01)
        pool.load_reports = False
        assert pool.spread([theirs, ours]) is None
    finally:
        await theirs.channel.close()
        await ours.channel.close()
