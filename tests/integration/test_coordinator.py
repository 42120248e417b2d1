"""The coordinator in-process against real encoder-node subprocesses (no vLLM).

Two encoders serve the session's tiny checkpoint on 127.0.0.2 and 127.0.0.3 with the SAME
port, so a DNS name listing both addresses (a headless Service, as in Kubernetes) reaches
them; a third serves another checkpoint (seed 1) and must be refused. A tiny DNS server on
loopback, written here with dnspython's message codec, plays the cluster DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import numpy as np
import pytest
import torch
from PIL import Image
from prometheus_client import CollectorRegistry

from encdis.client.encoder_client import EncoderClient
from encdis.client.errors import IMAGE_INVALID, InvalidArgument, Unavailable
from encdis.client.wire import content_digest
from encdis.launcher import NodeProcess
from encdis.llm_node.coordinator.coordinator import Coordinator
from encdis.llm_node.coordinator.discovery import Resolver
from encdis.llm_node.coordinator.settings import CoordinatorSettings
from tests.dns_server import LoopbackDNS
from tests.fake_encoder import FakeEncoder

# The tiny checkpoint's processor bounds, sent explicitly so digests match the coordinator's.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 256
NODE_TIMEOUT = 300


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def encoder_args(model, host: str, port: int = 0) -> list[str]:
    return ["encoder", "--model", str(model), "--host", host, "--port", str(port), "--metrics-port", "0"]


@contextlib.contextmanager
def started_encoders(model, count: int = 2, extra: Sequence[str] = ()) -> Iterator[list[NodeProcess]]:
    """`count` encoder-node processes on 127.0.0.1 (`extra`: more flags), started together; thawed
    (a test may have SIGSTOPped one) and stopped at the end."""
    nodes: list[NodeProcess] = []
    try:
        for _ in range(count):
            nodes.append(NodeProcess([*encoder_args(model, "127.0.0.1"), *extra], host="127.0.0.1"))
        for n in nodes:
            n.wait_ready(NODE_TIMEOUT)
        yield nodes
    finally:
        for n in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(n.pid, signal.SIGCONT)
            n.stop()


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


# -- nodes -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_ckpt, other_ckpt):
    """(a, b, other): a and b serve tiny_ckpt on 127.0.0.2/127.0.0.3 with one port; other serves seed 1."""
    started: list[NodeProcess] = []
    try:
        a = NodeProcess(encoder_args(tiny_ckpt, "127.0.0.2"), host="127.0.0.2")
        other = NodeProcess(encoder_args(other_ckpt, "127.0.0.1"), host="127.0.0.1")
        started += [a, other]
        a.wait_ready(NODE_TIMEOUT)
        b = NodeProcess(encoder_args(tiny_ckpt, "127.0.0.3", a.grpc_port), host="127.0.0.3")
        started.append(b)
        b.wait_ready(NODE_TIMEOUT)
        other.wait_ready(NODE_TIMEOUT)
        yield a, b, other
    finally:
        for node in started:
            node.stop()


@pytest.fixture
def victim(tiny_ckpt):
    """An encoder of the right checkpoint that a test may kill or drain."""
    node = NodeProcess(encoder_args(tiny_ckpt, "127.0.0.1"), host="127.0.0.1").wait_ready(NODE_TIMEOUT)
    try:
        yield node
    finally:
        node.stop()


@contextlib.asynccontextmanager
async def coordinator(ckpt, encoders: Sequence[str], **settings) -> AsyncIterator[Coordinator]:
    registry = CollectorRegistry()
    settings.setdefault("encoder_wait_seconds", 30.0)
    coord = Coordinator.from_checkpoint(CoordinatorSettings(encoders=tuple(encoders), **settings), registry, ckpt)
    coord.registry = registry  # for the tests' metric reads
    await coord.start()
    try:
        yield coord
    finally:
        await coord.stop()


async def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def states(coord: Coordinator) -> dict[str, str]:
    return {e.address: e.state for e in coord.encoders()}


def unread_tcp_bytes(pid: int) -> int:
    """Bytes the kernel received on `pid`'s TCP sockets that it has not read (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    total = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as fh:
            for line in fh.read().splitlines()[1:]:
                fields = line.split()  # sl local remote st tx_queue:rx_queue ... uid timeout inode
                if fields[9] in inodes:
                    total += int(fields[4].split(":")[1], 16)
    return total


# -- tests -----------------------------------------------------------------------------------


async def test_images_spread_over_both_encoders_and_equal_a_direct_call(pair, tiny_ckpt) -> None:
    a, b, _ = pair
    images = [png(40 + 50 * i, 300 - 30 * i, seed=i) for i in range(8)]
    async with coordinator(tiny_ckpt, [a.address, b.address]) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        result = await coord.encode(images)
        per_encoder = {e.address: e for e in coord.encoders()}
    assert all(per_encoder[n.address].assigned_images > 0 for n in (a, b)), per_encoder
    assert sum(e.assigned_images for e in per_encoder.values()) == len(images)
    with EncoderClient(a.address) as direct:
        expected = direct.encode(images, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert len(result.images) == len(images)
    assert result.cached == [False] * len(images)
    for got, want in zip(result.images, expected, strict=True):
        assert got.grid_thw == want.grid_thw and got.digest == want.digest
        assert got.embeds.shape == (want.shape[0], want.shape[1])
        # Both encoders run the same weights in fp32; only a batch's matmul shapes may differ.
        torch.testing.assert_close(got.embeds, torch.from_numpy(want.array().copy()))
    assert result.wall_seconds > 0


async def test_time_split_parts_match_what_the_encoder_did(tiny_ckpt) -> None:
    """Each part of the split against an independent measure: a fake encoder that reports a
    known queue (with its preprocessing) and batch time and stalls a known time between an embedding's header and its
    bytes (so the transfer part is long and the others are not)."""
    fake = await FakeEncoder(tiny_ckpt).start()
    fake.queue_seconds, fake.preprocess_seconds, fake.batch_seconds, fake.stall_after_header = 0.25, 0.1, 0.125, 0.5
    try:
        async with coordinator(tiny_ckpt, [fake.address]) as coord:
            await wait_for(lambda: len(coord.pool.serving()) == 1, what="the fake encoder serving")
            t0 = time.perf_counter()
            result = await coord.encode([png(120, 90, seed=11), png(60, 60, seed=12)])
            wall = time.perf_counter() - t0
    finally:
        await fake.stop()
    assert fake.calls == 1
    assert result.encode_seconds == 0.125  # the batch time the encoder reported
    # The encoder's queue less its preprocessing, plus any wait for an encoder.
    assert result.preprocess_seconds == 0.1
    assert 0.15 <= result.queue_seconds < 0.15 + 0.2
    # Two images, each stalled 0.5 s after its header: each receive takes >= 0.5 s, not 1 s.
    assert 0.5 <= result.transfer_seconds < 0.5 + 0.3
    assert wall >= 1.0 and abs(result.wall_seconds - wall) < 0.05


async def test_encoder_of_another_checkpoint_is_refused_and_gets_no_work(pair, tiny_ckpt) -> None:
    a, _, other = pair
    before = other.metric("encdis_encoder_patches_total")
    async with coordinator(tiny_ckpt, [other.address, a.address]) as coord:
        await wait_for(lambda: states(coord) == {other.address: "refused", a.address: "serving"},
                       what="other refused, a serving")
        refused = next(e for e in coord.encoders() if e.address == other.address)
        assert "weights_fingerprint" in refused.reason
        await coord.encode([png(120, 90, seed=100 + i) for i in range(4)])
        assert refused.assigned_images == 0
        assert next(e for e in coord.encoders() if e.address == a.address).assigned_images == 4
        assert metric(coord.registry, "encdis_coordinator_encoders", state="refused") == 1
    assert other.metric("encdis_encoder_patches_total") == before


async def test_no_usable_encoder_fails_with_unavailable_naming_why(pair, tiny_ckpt) -> None:
    _, _, other = pair
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    async with coordinator(tiny_ckpt, [other.address, dead], encoder_wait_seconds=5.0) as coord:
        t0 = time.monotonic()
        with pytest.raises(Unavailable) as info:
            await coord.encode([png(64, 64, seed=1)])
        assert time.monotonic() - t0 < 20
    message = info.value.message
    # Callers learn the states, not the addresses (those and the reasons are in the node's log).
    assert message.startswith("no encoder can serve this request (2 encoder(s): 1 refused, 1 unhealthy"), message
    assert other.address not in message and dead not in message
    async with coordinator(tiny_ckpt, []) as coord:
        with pytest.raises(Unavailable, match="no encoder"):
            await coord.encode([png(64, 64, seed=1)])


async def test_repeated_image_hits_the_cache_and_identical_in_flight_images_encode_once(pair, tiny_ckpt) -> None:
    a, _, _ = pair
    image = png(200, 150, seed=7)
    async with coordinator(tiny_ckpt, [a.address]) as coord:
        start = a.metric("encdis_encoder_patches_total")
        first = await coord.encode([image])
        after_first = a.metric("encdis_encoder_patches_total")
        assert after_first > start and first.cached == [False]
        second = await coord.encode([image])
        assert second.cached == [True] and torch.equal(second.images[0].embeds, first.images[0].embeds)
        assert a.metric("encdis_encoder_patches_total") == after_first  # no second encode
        assert metric(coord.registry, "encdis_coordinator_cache_hits_total") == 1
        assert metric(coord.registry, "encdis_coordinator_cache_misses_total") == 1

        fresh = png(300, 200, seed=8)
        before = a.metric("encdis_encoder_patches_total")
        results = await asyncio.gather(coord.encode([fresh]), coord.encode([fresh]), coord.encode([fresh, fresh]))
        one_image = a.metric("encdis_encoder_patches_total") - before
        grid = results[0].images[0].grid_thw
        assert one_image == grid[0] * grid[1] * grid[2]  # encoded exactly once for four uses
        embeds = [img.embeds for r in results for img in r.images]
        assert all(torch.equal(e, embeds[0]) for e in embeds)


async def test_bad_image_fails_naming_its_index_in_the_request(pair, tiny_ckpt) -> None:
    a, b, _ = pair
    good = png(100, 100, seed=11)
    truncated = png(150, 120, seed=12)
    truncated = truncated[: len(truncated) // 2]  # the header parses; the pixels do not
    async with coordinator(tiny_ckpt, [a.address, b.address]) as coord:
        with pytest.raises(InvalidArgument) as info:
            await coord.encode([good, good, b"not an image at all"])
        assert info.value.message.startswith("image 2: "), info.value.message
        await coord.encode([good])  # cached: not sent again below
        with pytest.raises(InvalidArgument) as info:
            await coord.encode([good, png(90, 90, seed=13), truncated])
        assert info.value.message.startswith("image 2: "), info.value.message
        # Found by the encoder (the header parsed), renumbered from its details, not its text.
        assert (info.value.image_index, info.value.reason) == (2, IMAGE_INVALID)
        assert "decode" in info.value.image_reason
        # The node keeps serving other requests.
        assert len((await coord.encode([png(70, 70, seed=14)])).images) == 1


async def test_a_cancelled_request_hands_its_in_flight_image_to_the_next(pair, tiny_ckpt) -> None:
    _, b, _ = pair
    image = png(180, 120, seed=150)
    async with coordinator(tiny_ckpt, [b.address]) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 1, what="b serving")
        os.kill(b.pid, signal.SIGSTOP)  # b holds the image until the test lets it go
        try:
            owner = asyncio.ensure_future(coord.encode([image]))
            digest = content_digest(image, MIN_PIXELS, MAX_PIXELS, coord.weights_fingerprint)
            await wait_for(lambda: coord.pool.backlog_patches(coord.pool.encoders()[0]) > 0, what="the image in flight")
            assert coord.cache.pending(digest) is not None
            waiter = asyncio.ensure_future(coord.encode([image]))
            # The waiter counts a cache hit when it finds the owner's in-flight encode, then awaits
            # it: from then on, cancelling the owner hands the image over to the waiter.
            await wait_for(lambda: metric(coord.registry, "encdis_coordinator_cache_hits_total") == 1,
                           what="the waiter joining the owner's in-flight encode")
            owner.cancel()  # e.g. the client went away
            with pytest.raises(asyncio.CancelledError):
                await owner
        finally:
            os.kill(b.pid, signal.SIGCONT)
        result = await asyncio.wait_for(waiter, 60)  # the waiter encoded it itself
        assert len(result.images) == 1 and result.cached == [False]
        assert coord.encoders()[0].backlog_patches == 0
        assert (await coord.encode([image])).cached == [True]


async def test_kill_9_of_an_encoder_mid_request_retries_elsewhere(pair, victim, tiny_ckpt) -> None:
    a, _, _ = pair
    images = [png(100 + 20 * i, 140, seed=200 + i) for i in range(8)]
    async with coordinator(tiny_ckpt, [a.address, victim.address]) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        # Freeze the victim so its share is surely still in flight, then kill it once that share
        # has reached it (image bytes wait unread in its sockets): a kill mid-request.
        os.kill(victim.pid, signal.SIGSTOP)
        task = asyncio.ensure_future(coord.encode(images))
        victim_handle = next(h for h in coord.pool.encoders() if h.address == victim.address)
        await wait_for(lambda: victim_handle.active_calls > 0, what="work assigned to the victim")
        await wait_for(lambda: unread_tcp_bytes(victim.pid) >= 16 * 1024, what="the victim's share reaching it")
        victim.kill()
        result = await asyncio.wait_for(task, 60)
        assert result.retries > 0
        assert metric(coord.registry, "encdis_coordinator_retries_total") == result.retries
        assert states(coord)[victim.address] == "unhealthy"
        # A later request goes straight to the survivor.
        later = await coord.encode([png(60, 60, seed=300)])
        assert len(later.images) == 1
    with EncoderClient(a.address) as direct:
        expected = direct.encode(images, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    for got, want in zip(result.images, expected, strict=True):
        assert got.digest == want.digest and got.grid_thw == want.grid_thw
        torch.testing.assert_close(got.embeds, torch.from_numpy(want.array().copy()))


async def test_draining_encoder_leaves_the_rotation(pair, victim, tiny_ckpt, caplog) -> None:
    a, _, _ = pair
    caplog.set_level(logging.INFO, logger="encdis.llm_node.coordinator.pool")
    async with coordinator(tiny_ckpt, [a.address, victim.address]) as coord:
        await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
        victim.terminate()  # SIGTERM: NOT_SERVING first, then it exits
        await wait_for(lambda: states(coord)[victim.address] in ("draining", "unhealthy"), what="victim leaving")
        assert any(f"encoder {victim.address}: serving -> draining" in r.getMessage() for r in caplog.records)
        result = await coord.encode([png(80 + 10 * i, 80, seed=400 + i) for i in range(4)])
        assert len(result.images) == 4
        assert next(e for e in coord.encoders() if e.address == victim.address).assigned_images == 0


# -- DNS -------------------------------------------------------------------------------------


@pytest.fixture
def dns_server():
    server = LoopbackDNS()
    yield server
    server.close()


async def test_resolver_asks_the_given_dns_server(dns_server) -> None:
    dns_server.set_addresses("encoders.test", ["127.0.0.3", "127.0.0.2"])
    dns_server.set_addresses("empty.test", [])
    resolver = Resolver(dns_server.address)
    assert await resolver.resolve("encoders.test") == ["127.0.0.2", "127.0.0.3"]
    assert await resolver.resolve("empty.test") == []
    assert await resolver.resolve("missing.test") == []  # NXDOMAIN: the encoders are gone
    assert await resolver.resolve("127.0.0.9") == ["127.0.0.9"]  # literals never hit DNS
    dns_server.close()
    assert await Resolver(dns_server.address, timeout=0.3).resolve("encoders.test") is None  # keep what we had


async def test_an_address_added_to_dns_joins_and_a_removed_one_leaves(pair, tiny_ckpt, dns_server) -> None:
    a, b, _ = pair
    port = a.grpc_port
    dns_server.set_addresses("encoders.test", ["127.0.0.2"])
    async with coordinator(tiny_ckpt, [f"encoders.test:{port}"], dns_server=dns_server.address,
                           dns_refresh_seconds=0.3) as coord:
        await wait_for(lambda: states(coord) == {a.address: "serving"}, what="a serving via DNS")
        assert coord.encoders()[0].name == f"encoders.test:{port}"
        dns_server.set_addresses("encoders.test", ["127.0.0.2", "127.0.0.3"])
        t0 = time.monotonic()
        await wait_for(lambda: states(coord) == {a.address: "serving", b.address: "serving"}, timeout=10,
                       what="b joining after its address appeared in DNS")
        joined_after = time.monotonic() - t0
        assert joined_after < 5
        await coord.encode([png(90 + 30 * i, 120, seed=500 + i) for i in range(6)])
        assert all(e.assigned_images > 0 for e in coord.encoders())
        dns_server.set_addresses("encoders.test", ["127.0.0.3"])
        await wait_for(lambda: set(states(coord)) == {b.address}, timeout=10, what="a leaving the pool")
        assigned = "encdis_coordinator_assignments_total"
        assert coord.registry.get_sample_value(assigned, {"encoder": a.address}) is None  # its series is gone
        assert metric(coord.registry, assigned, encoder=b.address) > 0
        result = await coord.encode([png(64, 64, seed=600)])
        assert len(result.images) == 1
        dns_server.set_addresses("encoders.test", [])  # scaled to zero
        await wait_for(lambda: not coord.encoders(), timeout=10, what="the pool emptying")
        with pytest.raises(Unavailable) as info:
            await coord.encode([png(64, 64, seed=601)])
        assert "the configured encoder names resolve to no address" in info.value.message
        assert "encoders.test" not in info.value.message  # names and addresses stay in the node's log
