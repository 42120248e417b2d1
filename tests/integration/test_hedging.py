"""Hedging: images sent to a frozen encoder complete from the other one, within the budget.

Two real encoder nodes (subprocesses on 127.0.0.1) serve the session's tiny checkpoint; the
coordinator runs in-process. SIGSTOP freezes one: its sockets stay open and nothing answers.
The attempt bound (attempt_timeout_floor_seconds) is set far above the hedge margin, so an
image that completes without a timeout fault was delivered by its hedge.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal

import pytest
import torch

from encdis.client.encoder_client import AsyncEncoderClient
from encdis.launcher import NodeProcess
from tests.integration.test_coordinator import (
    MAX_PIXELS,
    MIN_PIXELS,
    coordinator,
    metric,
    png,
    started_encoders,
    wait_for,
)

BUDGET = 0.5  # generous: this test sends few images, and one hedge is a large share of them
FLOOR = 20.0  # attempt bound: far beyond any hedge margin here


@pytest.fixture(scope="module")
def two(tiny_ckpt):
    with started_encoders(tiny_ckpt) as nodes:
        yield nodes


def cancelled_calls(node: NodeProcess) -> float:
    with contextlib.suppress(AssertionError):
        return node.metric('encdis_encoder_requests_total{code="CANCELLED"}')
    return 0.0


def frozen_first(nodes: list[NodeProcess], statuses, patches: int) -> tuple[NodeProcess, NodeProcess]:
    """(the node predicted to finish an image of `patches` first, the other one)."""
    by_address = {s.address: s for s in statuses}

    def predicted_finish(node: NodeProcess) -> float:
        s = by_address[node.address]
        return s.backlog_seconds + patches / s.patches_per_second if s.patches_per_second > 0 else math.inf

    first = min(nodes, key=predicted_finish)
    return first, next(n for n in nodes if n is not first)


def assigned_images(coord, node: NodeProcess) -> int:
    return next(s.assigned_images for s in coord.encoders() if s.address == node.address)


async def test_images_on_a_frozen_encoder_complete_from_the_other_and_the_straggler_is_cancelled(
        two, tiny_ckpt) -> None:
    # Load reports off: the warm-up's jitter on this shared machine must not make an encoder look
    # late (lateness counts only with reports).
    async with coordinator(tiny_ckpt, [n.address for n in two], hedge="on", hedge_budget=BUDGET,
                           load_reports="off", attempt_timeout_floor_seconds=FLOOR,
                           encode_timeout_seconds=FLOOR) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        for i in range(6):  # fit both cost models and the prediction errors
            await coord.encode([png(150 + 14 * i, 150, seed=800 + i), png(150, 160 + 14 * i, seed=900 + i)])
        # A warm-up call late on this shared machine may have been hedged, and its encoder marked
        # slow by the hedge that beat it: both must be back before the freeze.
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving after the warm-up")
        images = [[png(180, 180 + 14 * i, seed=1000 + i), png(190 + 14 * i, 180, seed=1100 + i)] for i in range(4)]
        # Freeze the encoder the coordinator predicts to finish the largest image first: it gets
        # that image whatever speeds the warm-up measured on this shared machine.
        largest = max(t * h * w for t, h, w in coord.image_grids(sum(images, [])))
        victim, other = frozen_first(two, coord.encoders(), patches=largest)
        assigned_before = assigned_images(coord, victim)
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            # At once: the victim's images wait, and are hedged once the other's predicted finish
            # is below the time they have waited.
            results = await asyncio.gather(*(coord.encode(request) for request in images))
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        r = coord.registry
        assert assigned_images(coord, victim) > assigned_before, "the frozen encoder got no image"
        assert metric(r, "encdis_coordinator_hedges_total", event="sent") >= 1, coord.encoders()
        assert metric(r, "encdis_coordinator_hedges_total", event="won") >= 1
        assert metric(r, "encdis_coordinator_hedges_total", event="cancelled") >= 1
        # The hedges that beat the victim marked it slow, as its attempt bound would have.
        assert metric(r, "encdis_coordinator_encoder_faults_total", encoder=victim.address, kind="outpaced") >= 1
        stalled = next(e for e in coord.encoders() if e.address == victim.address)
        assert stalled.state == "slow" and stalled.reason.startswith("outpaced"), stalled
        # Delivered by the hedges, not by the attempt bound moving them.
        assert metric(r, "encdis_coordinator_encoder_faults_total", encoder=victim.address, kind="timeout") == 0
        hedged = metric(r, "encdis_coordinator_hedge_patches_total")
        sent = sum(metric(r, "encdis_coordinator_assigned_patches_total", encoder=e.address) for e in two)
        assert 0 < hedged <= BUDGET * sent
        # Each answer is the embedding the other encoder gives for that image.
        client = AsyncEncoderClient(other.address)
        try:
            for request, result in zip(images, results, strict=True):
                direct = await client.encode(request, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
                for got, want in zip(result.images, direct, strict=True):
                    torch.testing.assert_close(got.embeds, torch.from_numpy(want.array().copy()))
        finally:
            await client.close()


async def test_an_encoder_drops_a_cancelled_calls_images_that_have_not_started(two, tiny_ckpt) -> None:
    """What a hedge's loser sees: its call cancelled while queued, its image never encoded."""
    node = two[1]
    dropped_before = await asyncio.to_thread(node.metric, "encdis_encoder_dropped_images_total")
    prepared_before = await asyncio.to_thread(node.metric, "encdis_encoder_preprocess_seconds_count")
    cancelled_before = await asyncio.to_thread(cancelled_calls, node)
    busy = AsyncEncoderClient(node.address)
    waiting = AsyncEncoderClient(node.address)
    try:
        # Three forwards' worth of patches (16384 per forward by default): the next image queues behind.
        ahead = asyncio.ensure_future(busy.encode([png(448, 448, seed=2000 + i) for i in range(48)],
                                                  min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS))
        await wait_for(lambda: node.metric("encdis_encoder_preprocess_seconds_count") >= prepared_before + 48,
                       what="the first call's images queued")
        behind = asyncio.ensure_future(waiting.encode([png(100, 100, seed=2100)], min_pixels=MIN_PIXELS,
                                                      max_pixels=MAX_PIXELS))
        # Preprocessed means queued: the servicer submits it to the batcher right after.
        await wait_for(lambda: node.metric("encdis_encoder_preprocess_seconds_count") >= prepared_before + 49,
                       what="the second call's image queued")
        behind.cancel()
        await asyncio.gather(behind, return_exceptions=True)
        # A call accepted now finds the first call's work still queued, and says so per image.
        [probe] = await waiting.encode([png(90, 90, seed=2200)], min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        first = await ahead
        assert probe.accepted_backlog is not None and probe.accepted_backlog.queued_patches > 0
        assert probe.accepted_backlog.seconds > 0  # the node has measured its speed by now
        assert first[0].accepted_backlog is not None
    finally:
        await busy.close()
        await waiting.close()
    await wait_for(lambda: node.metric("encdis_encoder_dropped_images_total") > dropped_before,
                   what="the cancelled image dropped from the queue")
    assert cancelled_calls(node) > cancelled_before
