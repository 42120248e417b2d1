"""Hung and slow encoders: a frozen encoder costs a request one attempt's bound, not its freeze.

Two real encoder nodes (subprocesses on 127.0.0.1) serve the session's tiny checkpoint;
the coordinator runs in-process. SIGSTOP freezes one of them the way a hung process or a
stalled host does: its sockets stay open, nothing answers. Bounds come from the coordinator's
settings: each attempt max(floor, margin x predicted cost); keepalive pings on every channel.
Nothing here reads a clock for its verdict: a request that waited for the freeze would still
be waiting when its `gather` inside the freeze returns, and which bound freed it shows in the
coordinator's fault counters (a timeout fault is the attempt bound, an outpaced fault a hedge that
delivered first; none is keepalive).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time

import pytest
from grpc._cython import cygrpc

from encdis.client.errors import DeadlineExceeded, Unavailable
from encdis.launcher import NodeProcess
from encdis.llm_node.coordinator.handle import EncoderState
from tests.integration.test_coordinator import (
    coordinator,
    metric,
    png,
    started_encoders,
    wait_for,
)

FLOOR = 2.0  # attempt_timeout_floor_seconds: the bound once cost models are fitted (tiny images)
STOP_SECONDS = 8.0
FAULTS = "encdis_coordinator_encoder_faults_total"


@pytest.fixture(scope="module")
def two(tiny_ckpt):
    # No embedding cache: the tests repeat their images across parametrisations, and every image
    # must be a forward for a frozen encoder to hold it.
    with started_encoders(tiny_ckpt, extra=("--cache-bytes", "0")) as nodes:
        yield nodes


@contextlib.contextmanager
def frozen(node: NodeProcess):
    os.kill(node.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(node.pid, signal.SIGCONT)


def keepalives_sent(address: str) -> dict[int, int]:
    """Keepalive pings sent so far on this process's connections to `address`, by socket id (channelz)."""
    sent = {}
    for chan in json.loads(cygrpc.channelz_get_top_channels(0)).get("channel", []):
        if not chan["data"]["target"].endswith(address):
            continue
        for ref in chan.get("subchannelRef", []):
            sub = json.loads(cygrpc.channelz_get_subchannel(int(ref["subchannelId"])))["subchannel"]
            for sock_ref in sub.get("socketRef", []):
                sock = json.loads(cygrpc.channelz_get_socket(int(sock_ref["socketId"])))["socket"]
                sent[int(sock_ref["socketId"])] = int(sock["data"].get("keepAlivesSent", 0))
    return sent


def status(coord, address: str):
    return next(e for e in coord.encoders() if e.address == address)


async def warm_up(coord, seed: int) -> None:
    """Both encoders serving and their cost models fitted (so each attempt's bound is FLOOR)."""
    await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
    await coord.encode([png(100 + 14 * i, 120, seed=seed + i) for i in range(8)])
    assert all(h.cost_model.observations > 0 for h in coord.pool.encoders())
    # A warm-up call late on this shared machine may have been hedged, and its encoder marked
    # slow by the hedge that beat it: both must be back before the test starts.
    await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving after the warm-up")


async def back_in_rotation(coord, node: NodeProcess, seed: int) -> None:
    await wait_for(lambda: status(coord, node.address).state == "serving", timeout=60,
                   what="the thawed encoder serving again")
    before = status(coord, node.address).assigned_images
    # Its lateness during the freeze is remembered (halving every 10 s): until it has decayed
    # below the other encoder's backlog, a small request may all go elsewhere. Back in rotation
    # means it gets work again well within that.
    deadline = time.monotonic() + 60
    for k in range(1000):
        await coord.encode([png(90 + 14 * i, 100, seed=seed + 10 * k + i) for i in range(8)])
        if status(coord, node.address).assigned_images > before:
            return
        assert time.monotonic() < deadline, "the thawed encoder got no work for 60 s"


# What marks a frozen encoder slow: with hedging off, only its attempt bound; with it on (the
# not the default), whichever comes first of that bound and a hedge that delivers its images first.
SLOW_BY = {"off": {"timeout": "bound"}, "on": {"timeout": "bound", "outpaced": "outpaced"}}


@pytest.mark.parametrize("hedge", ["off", "on"])
async def test_a_frozen_encoder_costs_requests_one_attempt_bound_and_leaves_the_rotation(
        two, tiny_ckpt, hedge) -> None:
    victim, other = two
    async with coordinator(tiny_ckpt, [victim.address, other.address], attempt_timeout_floor_seconds=FLOOR,
                           slow_seconds=1.0, slow_max_seconds=4.0, describe_timeout_seconds=1.0,
                           hedge=hedge) as coord:
        await warm_up(coord, seed=7000)
        retries: list[int] = []

        async def one_request(i: int) -> None:
            result = await coord.encode([png(112, 84 + 14 * (i % 8), seed=7100 + 2 * i),
                                         png(84, 112, seed=7101 + 2 * i)])
            retries.append(result.retries)

        tasks = []
        assigned_when_slow = None
        with frozen(victim):
            t_stop = time.monotonic()
            while time.monotonic() - t_stop < STOP_SECONDS:  # a steady load: one request every 0.2 s
                tasks.append(asyncio.ensure_future(one_request(len(tasks))))
                await asyncio.sleep(0.2)
                s = status(coord, victim.address)
                if assigned_when_slow is None and s.state == "slow":
                    assigned_when_slow = s.assigned_images
                    assert any(word in s.reason for word in SLOW_BY[hedge].values()), s.reason
            # Every request finishes while the victim is still frozen: none waited for the thaw.
            await asyncio.gather(*tasks)
            stalled = status(coord, victim.address)
            assert stalled.state == "slow", stalled
            faults = sum(metric(coord.registry, FAULTS, encoder=victim.address, kind=kind) for kind in SLOW_BY[hedge])
        # A request sent to the frozen encoder was retried elsewhere, or rescued by a hedge.
        rescued = metric(coord.registry, "encdis_coordinator_hedges_total", event="won")
        assert sum(retries) + rescued > 0, "no request was sent to the frozen encoder: nothing was tested"
        assert len(retries) == len(tasks)
        # Each image lost one attempt at most (to the attempt bound), then the other encoder served it.
        assert max(retries) <= 2, retries
        assert faults >= 1
        assert assigned_when_slow is not None
        # Once marked slow it got no new work while frozen.
        assert stalled.assigned_images == assigned_when_slow
        await back_in_rotation(coord, victim, seed=7500)


async def test_keepalive_drops_a_frozen_encoders_connection_and_real_encoders_permit_the_pings(
        two, tiny_ckpt, caplog) -> None:
    victim, other = two
    caplog.set_level(logging.INFO, logger="encdis.llm_node.coordinator.pool")
    # Attempt bounds far beyond the test and no hedges (a winning hedge would free a request
    # and mark the victim slow first): only keepalive can free the requests.
    async with coordinator(tiny_ckpt, [victim.address, other.address], attempt_timeout_floor_seconds=100.0,
                           keepalive_time_seconds=1.0, keepalive_timeout_seconds=1.0, hedge="off") as coord:
        await warm_up(coord, seed=8000)
        # Pings every second on idle channels: an encoder that did not permit them would answer
        # GOAWAY (too many pings) after its third, and the connection would be replaced.
        caplog.clear()
        before = {a: keepalives_sent(a) for a in (victim.address, other.address)}
        assert all(before.values()), f"no connection to an encoder in channelz: {before}"

        def pinged_four_more_times_on_one_connection(address: str) -> bool:
            # The same socket: a connection replaced after a GOAWAY has a new id and starts at 0.
            now = keepalives_sent(address)
            return any(now.get(sock, -1) - n >= 4 for sock, n in before[address].items())

        await wait_for(lambda: all(map(pinged_four_more_times_on_one_connection, before)),
                       what="four more keepalive pings on one connection to each encoder")
        assert not [r.getMessage() for r in caplog.records if "-> unhealthy" in r.getMessage()]
        assert {e.state for e in coord.encoders()} == {"serving"}

        with frozen(victim):
            # Eight images a request, so that both encoders get some (as in the warm-up).
            results = await asyncio.gather(*(coord.encode([png(98, 70 + 14 * i, seed=8100 + 8 * r + i)
                                                           for i in range(8)]) for r in range(3)))
            assert sum(r.retries for r in results) > 0, "no request was sent to the frozen encoder"
            # Keepalive broke the connection (the requests end while frozen); the 100 s attempt
            # bound, which would count a timeout fault, never fired.
            assert metric(coord.registry, FAULTS, encoder=victim.address, kind="timeout") == 0
            await wait_for(lambda: status(coord, victim.address).state != "serving", timeout=5,
                           what="the frozen encoder leaving the rotation")
        await back_in_rotation(coord, victim, seed=8500)


async def test_the_callers_deadline_bounds_the_attempt_and_does_not_blame_the_encoder(two, tiny_ckpt) -> None:
    victim, _ = two
    async with coordinator(tiny_ckpt, [victim.address], attempt_timeout_floor_seconds=100.0) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 1, what="the encoder serving")
        with frozen(victim):
            # The encoder's own attempt bound (100 s) is far off: only the caller's deadline can
            # end this call while the encoder is frozen.
            with pytest.raises(DeadlineExceeded, match="deadline"):
                await coord.encode([png(120, 120, seed=9000)], deadline=time.monotonic() + 1.0)
            assert status(coord, victim.address).state != "slow"  # the caller's bound, not the encoder's fault
            assert metric(coord.registry, FAULTS, encoder=victim.address, kind="timeout") == 0
        await wait_for(lambda: status(coord, victim.address).state == "serving", timeout=30,
                       what="the encoder serving after thawing")
        assert len((await coord.encode([png(120, 120, seed=9001)])).images) == 1


async def test_when_every_encoder_is_slow_images_still_go_to_them_but_never_to_quarantined_ones(
        two, tiny_ckpt) -> None:
    async with coordinator(tiny_ckpt, [n.address for n in two], slow_seconds=60.0, slow_max_seconds=60.0) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        for h in coord.pool.encoders():
            coord.pool.penalise(h, EncoderState.SLOW, "ran past its bound")
        assert {e.state for e in coord.encoders()} == {"slow"}
        # Late beats refused: the request is answered while the 60 s back-off still holds.
        result = await coord.encode([png(112, 98, seed=9500)])
        assert len(result.images) == 1
        assert {e.state for e in coord.encoders()} == {"slow"}

        for h in coord.pool.encoders():
            coord.pool.penalise(h, EncoderState.QUARANTINED, "sent rows its grid does not imply")
        with pytest.raises(Unavailable, match="quarantined"):
            await coord.encode([png(112, 98, seed=9501)])
