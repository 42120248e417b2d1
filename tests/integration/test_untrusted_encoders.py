"""The coordinator trusts no encoder: a misbehaving one is refused, quarantined, and its images
go to a good one.

One real encoder node (a subprocess on 127.0.0.1) serves the session's tiny checkpoint; a
FakeEncoder (tests/fake_encoder.py: a real gRPC EncoderService that misbehaves as told)
stands beside it in the coordinator's pool. Every answer must equal a direct call to the
real node, the fake must show as quarantined with its reason where ListEncoders reads it,
and it must get no work while quarantined.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import pytest
import torch

from encdis.client.encoder_client import AsyncEncoderClient, EncoderClient
from encdis.launcher import NodeProcess
from encdis.llm_node.grpc_front import encoder_info
from tests.fake_encoder import FakeEncoder
from tests.integration.test_coordinator import (
    MAX_PIXELS,
    MIN_PIXELS,
    NODE_TIMEOUT,
    coordinator,
    encoder_args,
    metric,
    png,
    wait_for,
)

GiB = 1024**3


@pytest.fixture(scope="module")
def real(tiny_ckpt):
    node = NodeProcess(encoder_args(tiny_ckpt, "127.0.0.1"), host="127.0.0.1").wait_ready(NODE_TIMEOUT)
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
async def fake(tiny_ckpt):
    f = await FakeEncoder(tiny_ckpt).start()
    try:
        yield f
    finally:
        await f.stop()


def status(coord, address: str):
    return next(e for e in coord.encoders() if e.address == address)


def assert_equal_to_direct_call(result, real: NodeProcess, images: list[bytes]) -> None:
    with EncoderClient(real.address) as direct:
        expected = direct.encode(images, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert len(result.images) == len(images)
    for got, want in zip(result.images, expected, strict=True):
        assert got.grid_thw == want.grid_thw and got.digest == want.digest
        torch.testing.assert_close(got.embeds, torch.from_numpy(want.array().copy()))


async def serve_past_the_fake(coord, fake: FakeEncoder, real: NodeProcess, seed: int) -> list[bytes]:
    """A request of four images (both idle encoders get some) that must succeed despite the fake."""
    images = [png(224, 224 - 28 * i, seed=seed + i) for i in range(4)]
    calls = fake.calls
    result = await coord.encode(images)
    assert fake.calls > calls, "the fake got none of the request's images: nothing was tested"
    assert_equal_to_direct_call(result, real, images)
    return images


MISBEHAVIOURS = {
    # knobs -> what the reason must name
    "fewer_rows_consistent_header": ({"rows_delta": -4}, "rows x hidden"),
    "more_rows_consistent_header": ({"rows_delta": 4}, "rows x hidden"),
    "more_rows_than_its_header": ({"rows_delta": 4, "rows_delta_in_header": False}, "exceed"),
    "fewer_rows_than_its_header": ({"rows_delta": -4, "rows_delta_in_header": False}, "bytes"),
    "wrong_digest": ({"wrong_digest": True}, "digest"),
    "wrong_datatype": ({"datatype": "FP16"}, "datatype"),
}


@pytest.mark.parametrize("name", list(MISBEHAVIOURS))
async def test_a_misbehaving_encoder_is_quarantined_and_the_request_served_by_a_good_one(
        name, real, fake, tiny_ckpt) -> None:
    knobs, named = MISBEHAVIOURS[name]
    for k, v in knobs.items():
        setattr(fake, k, v)
    async with coordinator(tiny_ckpt, [fake.address, real.address], quarantine_seconds=60.0) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        await serve_past_the_fake(coord, fake, real, seed=1000)

        bad = status(coord, fake.address)
        assert bad.state == "quarantined", bad
        assert named in bad.reason, bad.reason
        assert bad.backoff_seconds == 60.0 and bad.faults == 1
        shown = encoder_info(bad)  # what ListEncoders answers
        assert shown.state == "quarantined" and named in shown.reason
        assert (shown.backoff_seconds, shown.faults) == (60.0, 1)
        assert 0.0 < shown.backoff_remaining_seconds <= 60.0
        assert status(coord, real.address).state == "serving"
        assert metric(coord.registry, "encdis_coordinator_encoder_faults_total",
                      encoder=fake.address, kind="bad_embedding") >= 1

        # Its health still says SERVING; it stays out of rotation all the same.
        calls = fake.calls
        later = [png(200, 120 + 14 * i, seed=2000 + i) for i in range(4)]
        assert_equal_to_direct_call(await coord.encode(later), real, later)
        assert fake.calls == calls


async def test_quarantine_back_off_grows_on_repeat_and_ends_with_a_fresh_describe(real, fake, tiny_ckpt) -> None:
    fake.rows_delta = 4  # answers that differ silently from the monolithic model's, if accepted
    async with coordinator(tiny_ckpt, [fake.address, real.address], quarantine_seconds=0.5,
                           quarantine_max_seconds=60.0) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        handle = next(h for h in coord.pool.encoders() if h.address == fake.address)
        back_offs = []
        for round_ in range(3):
            await serve_past_the_fake(coord, fake, real, seed=3000 + 10 * round_)
            bad = status(coord, fake.address)
            assert bad.state == "quarantined"
            back_offs.append((bad.backoff_seconds, bad.faults))
            until = handle.penalty.until
            await wait_for(lambda: status(coord, fake.address).state == "serving", timeout=30,
                           what="the fake back in rotation after its back-off")
            # Not before its back-off ended, whatever its health watch said meanwhile.
            assert time.monotonic() >= until
    assert back_offs == [(0.5, 1), (1.0, 2), (2.0, 3)]


async def test_an_encoder_announcing_2_gib_for_a_64_token_image_is_refused_without_the_memory(
        real, fake, tiny_ckpt) -> None:
    fake.announce_bytes = 2 * GiB
    async with coordinator(tiny_ckpt, [fake.address, real.address], quarantine_seconds=60.0) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        images = [png(224, 224, seed=4000 + i) for i in range(4)]  # 64 tokens each
        # tracemalloc sees numpy's buffers when they are allocated, touched or not (RSS would not:
        # an untouched np.empty costs no pages).
        tracemalloc.start()
        try:
            result = await coord.encode(images)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert fake.calls >= 1
        assert_equal_to_direct_call(result, real, images)
        bad = status(coord, fake.address)
        assert bad.state == "quarantined" and "announced" in bad.reason, bad
    assert peak < 64 * 1024**2, f"{peak / 2**20:.0f} MiB allocated at the peak"
    # It hung up on the fake at the header: the fake never got to stream its 2 GiB.
    assert fake.sent_bytes < 256 * 1024**2, fake.sent_bytes


async def test_resource_exhausted_makes_the_coordinator_send_that_encoder_less(real, fake, tiny_ckpt) -> None:
    fake.resource_exhausted = True
    async with coordinator(tiny_ckpt, [fake.address, real.address], busy_seconds=30.0) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        await serve_past_the_fake(coord, fake, real, seed=5000)
        busy = status(coord, fake.address)
        assert busy.state == "serving"  # busy is not broken
        assert busy.backlog_seconds > 20  # it looks loaded: 30 s, decaying
        assert metric(coord.registry, "encdis_coordinator_encoder_faults_total",
                      encoder=fake.address, kind="busy") >= 1
        calls = fake.calls
        images = [png(150, 150, seed=5100 + i) for i in range(6)]
        assert_equal_to_direct_call(await coord.encode(images), real, images)
        assert fake.calls == calls  # every image went to the encoder that was not busy


async def test_concurrent_requests_to_one_bad_encoder_count_as_one_fault(real, fake, tiny_ckpt) -> None:
    fake.wrong_digest = True
    async with coordinator(tiny_ckpt, [fake.address, real.address], quarantine_seconds=60.0) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        batches = [[png(112, 112 + 28 * i, seed=6000 + 10 * r + i) for i in range(2)] for r in range(6)]
        results = await asyncio.gather(*(coord.encode(b) for b in batches))
        assert fake.calls >= 2
        for result, images in zip(results, batches, strict=True):
            assert_equal_to_direct_call(result, real, images)
        bad = status(coord, fake.address)
        assert bad.state == "quarantined" and bad.faults == 1 and bad.backoff_seconds == 60.0


async def test_images_are_used_as_they_arrive_not_when_the_call_ends(fake, tiny_ckpt) -> None:
    fake.linger_after_images = 5.0  # the call stays open this long after its last image
    async with coordinator(tiny_ckpt, [fake.address]) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 1, what="the fake serving")
        t0 = time.monotonic()
        result = await coord.encode([png(224, 224, seed=7000)])
        assert time.monotonic() - t0 < fake.linger_after_images, "the request waited for the call's end"
        assert torch.all(result.images[0].embeds == 0.0)  # the fake's rows for image 0
        # The call is read to its end in the background, not cancelled: the encoder ends it as always.
        await wait_for(lambda: fake.calls_ended == 1, timeout=15, what="the call's own end")
        assert fake.calls_cancelled == 0
        assert status(coord, fake.address).state == "serving"


async def test_a_client_closed_after_its_images_lets_the_call_end_and_cancels_a_lingering_one(fake) -> None:
    # Closed at once after its images, with the status a moment behind them: the call still ends
    # as the encoder sent it (its last send is recorded and counted there), not cancelled.
    fake.linger_after_images = 0.2
    async with AsyncEncoderClient(fake.address, timeout=30) as client:
        assert len(await client.encode([png(224, 224, seed=7050)], min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)) == 1
    await wait_for(lambda: fake.calls_ended == 1, timeout=15, what="the call's own end")
    assert fake.calls_cancelled == 0
    # A call that stays open after its images does not hold close() up: it is cancelled.
    fake.linger_after_images = 30.0
    client = AsyncEncoderClient(fake.address, timeout=60)
    assert len(await client.encode([png(224, 224, seed=7051)], min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)) == 1
    t0 = time.monotonic()
    await client.close()
    assert time.monotonic() - t0 < fake.linger_after_images, "close() waited for a lingering call's end"
    await wait_for(lambda: fake.calls_cancelled == 1, timeout=15, what="the lingering call cancelled")
    assert fake.calls_ended == 1


async def test_an_encoder_sending_more_after_its_images_is_quarantined(fake, tiny_ckpt) -> None:
    fake.extra_after_images = True
    async with coordinator(tiny_ckpt, [fake.address], quarantine_seconds=60.0) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 1, what="the fake serving")
        result = await coord.encode([png(224, 224, seed=7100)])  # every image was whole and checked
        assert len(result.images) == 1
        await wait_for(lambda: status(coord, fake.address).state == "quarantined", what="the fake quarantined")
        assert "more images than the 1 requested" in status(coord, fake.address).reason
        assert metric(coord.registry, "encdis_coordinator_encoder_faults_total",
                      encoder=fake.address, kind="bad_embedding") == 1
