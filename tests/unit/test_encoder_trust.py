"""The rules behind quarantine, slow marks and attempt bounds, without servers.

What an embedding must be (expectation.py), how back-offs grow and are forgiven (penalty.py),
how long one attempt may take and how retry rounds are spaced (dispatch.py), and the LLM
node's flags for all of it (settings.py).
"""

from __future__ import annotations

import argparse
import time

import pytest
from prometheus_client import CollectorRegistry

from encdis.client.wire import Embedding
from encdis.llm_node import settings as llm_settings
from encdis.llm_node.coordinator.cost_model import CostModel
from encdis.llm_node.coordinator.dispatch import Dispatcher
from encdis.llm_node.coordinator.embedding_cache import EmbeddingCache
from encdis.llm_node.coordinator.expectation import PendingImage, embedding_mismatch
from encdis.llm_node.coordinator.handle import EncoderHandle
from encdis.llm_node.coordinator.identity import ModelIdentity
from encdis.llm_node.coordinator.metrics import CoordinatorMetrics
from encdis.llm_node.coordinator.penalty import BackoffSchedule, FaultRecord
from encdis.llm_node.coordinator.pool import EncoderPool
from encdis.llm_node.coordinator.settings import CoordinatorSettings

HIDDEN = 64
JOB = PendingImage(index=2, digest="d" * 64, grid=(1, 16, 16), rows=64)


def embedding(**changes) -> Embedding:
    fields = dict(image_index=0, grid_thw=(1, 16, 16), datatype="FP32", shape=(64, HIDDEN),
                  data=bytes(64 * HIDDEN * 4), digest="d" * 64)
    fields.update(changes)
    return Embedding(**fields)


def test_only_the_embedding_asked_for_passes() -> None:
    assert embedding_mismatch(embedding(), JOB, HIDDEN, "FP32") is None
    assert embedding_mismatch(embedding(datatype="BF16", data=bytes(64 * HIDDEN * 2)), JOB, HIDDEN, None) is None
    wrong = {
        "grid_thw": embedding(grid_thw=(1, 16, 20)),
        "rows": embedding(shape=(60, HIDDEN)),
        "hidden": embedding(shape=(64, HIDDEN * 2)),
        "datatype": embedding(datatype="FP16"),
        "digest": embedding(digest="e" * 64),
        "no digest": embedding(digest=""),
    }
    for what, emb in wrong.items():
        assert embedding_mismatch(emb, JOB, HIDDEN, "FP32") is not None, what
    assert "60 rows" in embedding_mismatch(wrong["rows"], JOB, HIDDEN, "FP32")


def test_back_off_doubles_per_fault_up_to_its_cap_and_a_clean_stretch_forgives() -> None:
    schedule = BackoffSchedule(5.0, 300.0)
    assert [schedule.seconds(k) for k in range(1, 9)] == [5, 10, 20, 40, 80, 160, 300, 300]
    record = FaultRecord()
    now = 1000.0
    assert [record.strike(now + k, schedule) for k in range(3)] == [1, 2, 3]
    # Clean for longer than the longest back-off after the last one served: forgiven.
    assert record.strike(now + 2 + 20 + 300 + 1, schedule) == 1
    with pytest.raises(ValueError):
        BackoffSchedule(10.0, 5.0)


def dispatcher(**settings) -> Dispatcher:
    ident = ModelIdentity("f", HIDDEN, 3136, 200704)
    pool = EncoderPool([], ident, cost_model_factory=CostModel.prior)
    return Dispatcher(CoordinatorSettings(**settings), pool, EmbeddingCache(0), CoordinatorMetrics(CollectorRegistry()),
                      hidden_size=HIDDEN, min_pixels=3136, max_pixels=200704)


def test_retry_rounds_back_off_exponentially_with_jitter() -> None:
    d = dispatcher(retry_backoff_seconds=0.1, retry_backoff_max_seconds=1.0)
    for rounds, cap in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)):
        pauses = [d.retries.pause(rounds) for _ in range(200)]
        assert all(cap / 2 <= p <= cap for p in pauses), (rounds, min(pauses), max(pauses))
        assert max(pauses) - min(pauses) > cap / 10  # jittered: requests that failed together spread out


async def test_an_attempt_is_bounded_by_predicted_cost_a_floor_and_the_callers_deadline() -> None:
    d = dispatcher(attempt_timeout_floor_seconds=2.0, attempt_timeout_margin=3.0, encode_timeout_seconds=120.0)
    h = EncoderHandle("127.0.0.1:1", "127.0.0.1:1", CostModel(0.0, 1e-3, 0.0))  # 1 ms per patch
    try:
        big = [PendingImage(i, "x", (1, 40, 50), 500) for i in range(2)]  # 2 x 2000 patches: 4 s predicted
        # Before its cost model has seen a batch the prediction means nothing: the configured bound.
        assert d.attempt_timeout(h, big, None)[0] == 120.0
        h.cost_model.observe([2000], 2.0)
        timeout, predicted, by_caller = d.attempt_timeout(h, big, None)
        assert by_caller is False and predicted == pytest.approx(4.0, rel=0.05)
        assert timeout == pytest.approx(3 * predicted)
        assert d.attempt_timeout(h, [PendingImage(0, "x", (1, 2, 2), 1)], None)[0] == 2.0  # the floor
        timeout, _, by_caller = d.attempt_timeout(h, big, time.monotonic() + 1.0)
        assert by_caller is True and 0.9 < timeout <= 1.0
        # A busy answer makes its queue look longer, so the bound and the assignment follow.
        d.pool.report_busy(h)
        assert d.attempt_timeout(h, big, None)[1] == pytest.approx(predicted + d.pool.busy_seconds, abs=0.05)
    finally:
        await h.channel.close()


def test_llm_node_flags_and_environment_reach_the_coordinator() -> None:
    parser = argparse.ArgumentParser()
    llm_settings.add_arguments(parser, environ={"ENCDIS_QUARANTINE_SECONDS": "2.5"})
    args = parser.parse_args(["--model", "/m", "--keepalive-time-seconds", "3", "--slow-max-seconds", "30",
                              "--encoder-datatype", "BF16"])
    s = llm_settings.from_args(args).coordinator
    assert (s.quarantine_seconds, s.keepalive_time_seconds, s.slow_max_seconds) == (2.5, 3.0, 30.0)
    assert s.encoder_datatype == "BF16"
    with pytest.raises(ValueError, match="encoder-datatype"):
        CoordinatorSettings(encoder_datatype="bf16")
    with pytest.raises(ValueError, match="keepalive-time-seconds"):
        CoordinatorSettings(keepalive_time_seconds=0.2)  # encoders would answer GOAWAY
    with pytest.raises(ValueError, match="quarantine-max-seconds"):
        CoordinatorSettings(quarantine_seconds=10.0, quarantine_max_seconds=5.0)
    with pytest.raises(ValueError, match="attempt-timeout-margin"):
        CoordinatorSettings(attempt_timeout_margin=0.5)
