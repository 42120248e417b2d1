"""Embeddings at real sizes over a real grpc.aio server on loopback: the encoder's send path
(servicer.reply_frames, registered by add_encoder_service) into the coordinator's receiver
(an EncoderHandle's AsyncEncoderClient.encode_iter with per-image expectations, then
records.embedding_tensor), byte for byte; and a misbehaving peer refused at the wire, with
nothing allocated beyond what the caller expects, while the receiver keeps working."""

from __future__ import annotations

import asyncio
import tracemalloc

import grpc
import pytest
import torch

from encdis.client.encoder_client import EncoderClient
from encdis.client.errors import WireError
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.client.wire import ExpectedEmbedding
from encdis.encoder_node.servicer import add_encoder_service, reply_frames
from encdis.llm_node.coordinator.handle import EncoderHandle
from encdis.llm_node.coordinator.records import embedding_tensor

HIDDEN = 8192  # Qwen2.5-VL-72B
ROWS_1080P = 2691  # 1920x1080 after smart_resize with Qwen2.5-VL's bounds: grid (1, 78, 138) / 4
GiB = 1 << 30


def grid_of(rows: int) -> tuple[int, int, int]:
    return (1, 2, 2 * rows)  # t*h*w / merge_size**2 == rows


def expectation(rows: int, hidden: int = HIDDEN) -> ExpectedEmbedding:
    t, h, w = grid_of(rows)
    return ExpectedEmbedding(rows, hidden, "BF16", t * h * w)


class TowerlessEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """The encoder's real send path over tensors made up front; images[i] = b"<tensor key>"."""

    def __init__(self, tensors: dict[bytes, torch.Tensor]) -> None:
        self.tensors = tensors

    async def Encode(self, request, context):
        for i, key in enumerate(request.images):
            t = self.tensors[bytes(key)]
            for frame in reply_frames(i, grid_of(t.shape[0]), f"d{i}", t, "BF16", request.max_chunk_bytes or 1 << 22):
                yield frame


class ScriptedPeer(encoder_pb2_grpc.EncoderServiceServicer):
    """A fake encoder that misbehaves on cue: Encode sends `script` (serialised messages) as it is."""

    def __init__(self) -> None:
        self.script: list[bytes] = []

    async def Encode(self, request, context):
        for frame in self.script:
            yield frame


async def _serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    add_encoder_service(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tensors() -> dict[bytes, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        b"1080p": torch.randn(ROWS_1080P, HIDDEN, generator=g).to(torch.bfloat16),
        b"448": torch.randn(256, HIDDEN, generator=g).to(torch.bfloat16),
    }


@pytest.fixture(scope="module")
async def sender(tensors):
    server, address = await _serve(TowerlessEncoder(tensors))
    yield address
    await server.stop(None)


@pytest.fixture(scope="module")
async def peer():
    fake = ScriptedPeer()
    server, address = await _serve(fake)
    fake.address = address
    yield fake
    await server.stop(None)


async def _receive(handle: EncoderHandle, keys: list[bytes], expected, **kw) -> list[torch.Tensor]:
    return [embedding_tensor(e) async for e in handle.client.encode_iter(keys, expected=expected, **kw)]


@pytest.mark.parametrize("chunk", [1 << 20, 4 << 20])
async def test_real_size_embedding_arrives_byte_identical_as_the_engine_gets_it(sender, tensors, chunk) -> None:
    handle = EncoderHandle(sender, "sender", cost_model=None)
    try:
        got = await _receive(handle, [b"1080p", b"448"], [expectation(ROWS_1080P), expectation(256)],
                             max_chunk_bytes=chunk)
    finally:
        await handle.channel.close()
    for out, key in zip(got, (b"1080p", b"448"), strict=True):
        want = tensors[key]
        assert out.dtype == torch.bfloat16 and out.shape == want.shape
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))  # every bit, NaN payloads included


async def test_blocking_client_receives_the_same_bytes(sender, tensors) -> None:
    def blocking() -> list:
        with EncoderClient(sender, timeout=60) as c:
            return c.encode([b"1080p"], expected=[expectation(ROWS_1080P)])

    (emb,) = await asyncio.to_thread(blocking)  # the server runs on this test's loop
    assert bytes(emb.data) == tensors[b"1080p"].view(torch.uint8).numpy().tobytes()


def _header(rows: int, hidden: int = HIDDEN, chunks: int = 1, **over) -> bytes:
    fields = dict(image_index=0, grid_thw=list(grid_of(rows)), num_tokens=rows, hidden_size=hidden, datatype="BF16",
                  total_bytes=rows * hidden * 2, num_chunks=chunks)
    fields.update(over)
    return encoder_pb2.EncodeResponse(header=encoder_pb2.EmbeddingHeader(**fields)).SerializeToString()


def _chunk(data: bytes, index: int = 0) -> bytes:
    chunk = encoder_pb2.EmbeddingChunk(chunk_index=index, data=data)
    return encoder_pb2.EncodeResponse(chunk=chunk).SerializeToString()


async def test_two_gib_announced_for_a_64_token_image_is_refused_before_any_allocation(peer) -> None:
    peer.script = [_header(GiB // HIDDEN), _chunk(b"\0" * (4 << 20))]  # 131072 rows x 8192 x 2 bytes = 2 GiB
    handle = EncoderHandle(peer.address, "peer", cost_model=None)
    try:
        tracemalloc.start()
        try:
            with pytest.raises(WireError, match=r"image 0: .*131072x8192.*expected 64x8192"):
                await _receive(handle, [b"img"], [expectation(64)])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, f"{peak} bytes allocated for a refused stream"
        # Without expectations a caller's maximum refuses it the same way.
        with pytest.raises(WireError, match="exceeds the limit"):
            await _receive(handle, [b"img"], None, max_total_bytes=64 * HIDDEN * 2)
        # The receiver is unharmed: the same channel takes a good stream next.
        good = b"\x01" * (64 * HIDDEN * 2)
        peer.script = [_header(64), _chunk(good)]
        (out,) = await _receive(handle, [b"img"], [expectation(64)])
        assert bytes(out.view(torch.uint8).numpy()) == good
    finally:
        await handle.channel.close()


@pytest.mark.parametrize("script, match", [
    ([_header(64, chunks=2), _chunk(b"\0" * (32 * HIDDEN * 2)), _chunk(b"\0" * 16, 1)], "in the announced 2 chunks"),
    ([_header(64), _chunk(b"\0" * (64 * HIDDEN * 2 + 2))], "exceed the announced"),
    ([_header(64, hidden=4096)], "64x4096 .*expected 64x8192"),
    ([_header(64, datatype="FP32", total_bytes=64 * HIDDEN * 4)], "datatype 'FP32', expected 'BF16'"),
    ([_header(64, grid_thw=[1, 16, 32])], r"grid_thw \[1, 16, 32\] \(512 patches\), expected 256 patches"),
])
async def test_a_peer_breaking_its_header_is_refused_naming_the_image(peer, script, match) -> None:
    peer.script = script
    handle = EncoderHandle(peer.address, "peer", cost_model=None)
    try:
        with pytest.raises(WireError, match=match):
            await _receive(handle, [b"img"], [expectation(64)])
    finally:
        await handle.channel.close()
