"""The co-located transport against real encoder-node subprocesses on this host (no vLLM).

The coordinator runs in-process with `--colocated require`: each encoder opens a gloo pair
(the CPU build of the same code path NCCL takes on GPUs), headers come over gRPC and bytes
over the pair. Compared with a coordinator on gRPC alone (`off`): byte-identical embeddings,
the bytes counted by the same metric. Failures: a pair whose transfer times out (the
encoder's test fault hook stalls between header and bytes) and an encoder killed with
SIGKILL in the middle of a co-located transfer; both requests complete, from the gRPC path
or the other encoder, and each fallback is counted.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from encdis.encoder_node.colocated import TEST_FAULT_STALL_ENV
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.coordinator.coordinator import Coordinator
from encdis.llm_node.coordinator.settings import CoordinatorSettings
from encdis.pair_group import read_boot_id
from tests.fake_encoder import FakeEncoder
from tests.integration.test_coordinator import encoder_args, metric, png, wait_for
from tests.needs import require_or_skip

pytestmark = [pytest.mark.timeout(600)]

require_or_skip(bool(read_boot_id()), "a host boot id (/proc/sys/kernel/random/boot_id)",
                "the co-located transport pairs processes of one Linux host")

NODE_TIMEOUT = 300
BYTES = "encdis_coordinator_embedding_bytes_received_total"
COLOCATED = "encdis_coordinator_colocated_embeddings_total"
FALLBACKS = "encdis_coordinator_colocated_fallbacks_total"


@pytest.fixture(scope="module")
def encoder(tiny_ckpt):
    node = start_node(encoder_args(tiny_ckpt, "127.0.0.1"), timeout=NODE_TIMEOUT)
    yield node
    node.stop()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    # Different sizes: different rows per image, so a mix-up of bytes cannot match.
    return [png(224, 224, 1), png(336, 168, 2), png(84, 112, 3), png(448, 336, 4)]


async def started(ckpt, addresses: list[str], mode: str, receive_buffers=None,
                  **overrides) -> tuple[Coordinator, CollectorRegistry]:
    registry = CollectorRegistry()
    settings = CoordinatorSettings(encoders=tuple(addresses), colocated=mode, cache_bytes=0, **overrides)
    coord = Coordinator.from_checkpoint(settings, registry, ckpt)
    coord.receive_buffers = receive_buffers
    await coord.start()
    return coord, registry


def raw(result) -> list[bytes]:
    """Each embedding's bytes as the coordinator hands them on."""
    return [bytes(e.embeds.contiguous().view(-1).view(torch.uint8).numpy()) for e in result.images]


async def reference(ckpt, address: str, images: list[bytes]) -> list[bytes]:
    coord, _ = await started(ckpt, [address], "off")
    try:
        return raw(await coord.encode(images))
    finally:
        await coord.stop()


async def test_colocated_embeddings_are_byte_identical_to_grpc(tiny_ckpt, encoder, images):
    grpc_coord, grpc_reg = await started(tiny_ckpt, [encoder.address], "off")
    co_coord, co_reg = await started(tiny_ckpt, [encoder.address], "require")
    try:
        via_grpc = await grpc_coord.encode(images)
        via_pair = await co_coord.encode(images)
        assert [s.state for s in co_coord.encoders()] == ["serving"]
        assert raw(via_pair) == raw(via_grpc)
        assert [e.grid_thw for e in via_pair.images] == [e.grid_thw for e in via_grpc.images]
        assert metric(co_reg, COLOCATED) == len(images) and metric(grpc_reg, COLOCATED) == 0
        total = sum(len(b) for b in raw(via_grpc))
        assert metric(grpc_reg, BYTES) == total and metric(co_reg, BYTES) == total  # either path counts
        # Concurrent calls on one pair: each image's bytes go to its own call (unique tags).
        results = await asyncio.gather(*(co_coord.encode([img]) for img in reversed(images)))
        assert [raw(r)[0] for r in results] == list(reversed(raw(via_grpc)))
        assert metric(co_reg, COLOCATED) == 2 * len(images)
        assert metric(co_reg, FALLBACKS, reason="timeout") == 0
    finally:
        await grpc_coord.stop()
        await co_coord.stop()


async def test_both_paths_receive_into_the_nodes_shared_region(tiny_ckpt, encoder, images, tmp_path):
    from encdis.llm_node.embedding_region import EmbeddingRegion

    region = EmbeddingRegion(torch.float32, parent=str(tmp_path))
    want = await reference(tiny_ckpt, encoder.address, images)
    try:
        for mode in ("off", "require"):  # gRPC chunks; the gloo pair
            coord, registry = await started(tiny_ckpt, [encoder.address], mode, receive_buffers=region.buffer)
            try:
                result = await coord.encode(images)
            finally:
                await coord.stop()
            assert raw(result) == want
            assert metric(registry, COLOCATED) == (len(images) if mode == "require" else 0)
            # Each embedding is a whole file of the region: a request holding it links, never copies.
            assert all(region.file_of(e.embeds) is not None for e in result.images), mode
            assert len(os.listdir(region.path)) == len(images)
            del result
            gc.collect()
            await wait_for(lambda: os.listdir(region.path) == [], 10, "the region's files to go with their tensors")
    finally:
        region.close()


async def test_require_refuses_an_encoder_that_cannot_pair(tiny_ckpt):
    fake = await FakeEncoder(tiny_ckpt).start()  # describes no boot id: not on this host as far as we know
    coord, _ = await started(tiny_ckpt, [fake.address], "require")
    try:
        for _ in range(100):
            states = coord.encoders()
            if states and states[0].state != "connecting":
                break
            await asyncio.sleep(0.05)
        assert states[0].state == "refused" and "--colocated require" in states[0].reason
    finally:
        await coord.stop()
        await fake.stop()


async def test_auto_keeps_cpu_pairs_on_grpc(tiny_ckpt, encoder, images):
    coord, registry = await started(tiny_ckpt, [encoder.address], "auto")
    try:
        await coord.encode(images[:1])
        assert metric(registry, COLOCATED) == 0 and metric(registry, BYTES) > 0
    finally:
        await coord.stop()


async def test_a_collective_timeout_falls_back_to_grpc(tiny_ckpt, encoder, images):
    want = await reference(tiny_ckpt, encoder.address, images[:2])
    stalled = start_node(encoder_args(tiny_ckpt, "127.0.0.1"), env={TEST_FAULT_STALL_ENV: "30"},
                         timeout=NODE_TIMEOUT, name="stalled-encoder")
    coord, registry = await started(tiny_ckpt, [stalled.address], "require", colocated_timeout_seconds=1.0)
    try:
        t0 = time.monotonic()
        result = await coord.encode(images[:2])
        assert raw(result) == want
        assert metric(registry, FALLBACKS, reason="timeout") >= 1
        assert result.retries >= 1 and time.monotonic() - t0 < 20  # not waiting out the encoder's stall
        # The pair stays closed (re-opened later): the next request goes over gRPC at once.
        again = await coord.encode(images[2:])
        assert len(again.images) == 2 and again.retries == 0
    finally:
        await coord.stop()
        stalled.stop()


async def test_kill_9_mid_transfer_completes_from_the_other_encoder(tiny_ckpt, encoder):
    victim: NodeProcess = start_node(encoder_args(tiny_ckpt, "127.0.0.1"), env={TEST_FAULT_STALL_ENV: "120"},
                                     timeout=NODE_TIMEOUT, name="victim-encoder")
    coord, registry = await started(tiny_ckpt, [encoder.address, victim.address], "require",
                                    colocated_timeout_seconds=60.0)
    try:
        # Four equal images over two idle encoders: each gets some (earliest predicted finish).
        same = [png(224, 224, 10 + i) for i in range(4)]
        # The reference is made afterwards: made first, the encoder's cache would hold all four and
        # digest affinity would send it every one (a hit beats a forward).
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        request = asyncio.ensure_future(coord.encode(same))
        for _ in range(1200):  # the victim's header is in, its bytes are not: a receive waits on its pair
            if coord.colocated.receiving(victim.address) >= 1:
                break
            assert not request.done(), "the victim got no image"
            await asyncio.sleep(0.05)
        assert coord.colocated.receiving(victim.address) >= 1, "no co-located transfer got stuck on the victim"
        os.kill(victim.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        result = await asyncio.wait_for(request, 60)
        assert time.monotonic() - t0 < 30 and result.retries >= 1
        assert raw(result) == await reference(tiny_ckpt, encoder.address, same)
        assert sum(metric(registry, FALLBACKS, reason=r) for r in ("peer_lost", "abandoned", "closed")) >= 1
    finally:
        await coord.stop()
        victim.stop()
