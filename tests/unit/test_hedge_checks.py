"""When a waiting call is looked at for a hedge: the moment it is past due by the margin, not the next tick."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from encdis.llm_node.coordinator.hedging import NOT_SENT_SECONDS, PAST_DUE_SECONDS, CallProgress, Hedger
from encdis.llm_node.coordinator.metrics import CoordinatorMetrics
from encdis.llm_node.coordinator.settings import CoordinatorSettings


def hedger(**settings) -> Hedger:
    return Hedger(CoordinatorSettings(**settings), None, CoordinatorMetrics(CollectorRegistry()))


def test_a_call_is_looked_at_once_its_first_missing_image_is_past_due_by_the_margin() -> None:
    h = hedger(hedge_check_seconds=0.25, hedge_min_margin_seconds=0.05)
    progress = CallProgress(sent_at=10.0, finishes=[0.02, 0.04])
    # Due at 10.0 + 0.02 + 0.05: 30 ms from 10.04, long before the 250 ms tick.
    assert h.next_check(progress, 10.04) == pytest.approx(0.03 + PAST_DUE_SECONDS)
    progress.delivered.add(0)  # the first arrived: the second is due 20 ms later
    assert h.next_check(progress, 10.04) == pytest.approx(0.05 + PAST_DUE_SECONDS)
    # Past due already (looked at, not hedged: every other encoder busy): the interval.
    assert h.next_check(progress, 10.2) == pytest.approx(0.25)
    # Due after the tick: the tick comes first.
    assert h.next_check(CallProgress(sent_at=10.0, finishes=[2.0]), 10.0) == pytest.approx(0.25)


def test_the_learned_margin_moves_the_look() -> None:
    h = hedger(hedge_check_seconds=0.25, hedge_min_margin_seconds=0.0)
    for _ in range(20):
        h.errors.observe(0.1)  # calls have finished 100 ms past their prediction
    assert h.next_check(CallProgress(sent_at=0.0, finishes=[0.05]), 0.0) == pytest.approx(0.15 + PAST_DUE_SECONDS)


def test_a_call_not_sent_yet_is_looked_at_again_soon() -> None:
    assert hedger(hedge_check_seconds=0.25).next_check(CallProgress(), 5.0) == NOT_SENT_SECONDS
