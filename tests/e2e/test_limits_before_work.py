"""Limits before work, on a real LLM node: requests that would cost seconds are refused from
cheap checks while the node keeps answering, and the gRPC door caps calls and message sizes
before any handler runs. (The HTTP door's limits: tests/integration/test_http_limits.py.)"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from encdis.client import AsyncGenerateClient, InvalidArgument, ResourceExhausted
from encdis.launcher import NodeProcess, start_node

pytestmark = pytest.mark.vllm

MAX_IMAGE_BYTES = 256 * 1024  # an 8000x8000 one-colour PNG is 200 KB
MAX_REQUEST_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_CONCURRENT_RPCS = 6
BAD_REQUESTS = 5  # each kind, one after another


@pytest.fixture(scope="module")
def node(tiny_ckpt: Path, encoder_nodes: list[NodeProcess]) -> Iterator[NodeProcess]:
    proc = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0", "--http-port", "0", "--max-image-bytes", str(MAX_IMAGE_BYTES),
                       "--max-request-message-bytes", str(MAX_REQUEST_MESSAGE_BYTES),
                       "--max-concurrent-rpcs", str(MAX_CONCURRENT_RPCS),
                       "--encoders", ",".join(n.address for n in encoder_nodes)], timeout=900)
    try:
        yield proc
    finally:
        proc.stop()


def huge_canvas_png() -> bytes:
    """A small file whose header declares 8000x8000 pixels (one colour: it compresses 1000:1)."""
    buf = io.BytesIO()
    Image.new("RGB", (8000, 8000), (40, 90, 160)).save(buf, "PNG")
    assert len(buf.getvalue()) < MAX_IMAGE_BYTES
    return buf.getvalue()


async def refused_while_health_answers(address: str, bad) -> tuple[list[Exception], list[int]]:
    """Run `bad(client)` BAD_REQUESTS times, one after another, while a health check runs in a loop;
    the errors, and how many health answers came while each bad request was in flight."""
    in_flight = False
    answered_during: list[int] = []
    stop = asyncio.Event()

    async def health_loop() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                if in_flight:
                    answered_during[-1] += 1

    errors: list[Exception] = []
    checker = asyncio.ensure_future(health_loop())
    async with AsyncGenerateClient(address, timeout=120) as client:
        await asyncio.sleep(0)  # the checker's first call is on its way
        for _ in range(BAD_REQUESTS):
            answered_during.append(0)
            in_flight = True
            try:
                await bad(client)
            except Exception as e:  # what the node refused it with: checked by the caller
                errors.append(e)
            finally:
                in_flight = False
    stop.set()
    await checker
    return errors, answered_during


def assert_refused_and_health_answered(errors: list[Exception], answered: list[int], match: str) -> None:
    assert len(errors) == BAD_REQUESTS, f"{BAD_REQUESTS - len(errors)} bad requests were not refused"
    for e in errors:
        assert isinstance(e, InvalidArgument), repr(e)
        assert match in e.message, e.message
    # Health kept answering while they were in flight: the refusals never held the event loop.
    assert sum(answered) >= BAD_REQUESTS, f"health answered {answered} times during the bad requests"


def test_a_5mb_prompt_is_refused_from_its_length_while_health_keeps_answering(node: NodeProcess) -> None:
    prompt = "lorem ipsum " * (5_000_000 // 12)

    async def bad(client: AsyncGenerateClient) -> None:
        await client.generate(prompt, max_tokens=4)

    errors, answered = asyncio.run(refused_while_health_answers(node.address, bad))
    assert_refused_and_health_answered(errors, answered, "the prompt is at least")
    assert all(e.reason == "PROMPT_TOO_LONG" for e in errors)


def test_16_pngs_declaring_8000x8000_are_refused_while_health_keeps_answering(node: NodeProcess,
                                                                               encoder_nodes) -> None:
    images = [huge_canvas_png()] * 16
    before = [n.metric("encdis_encoder_patches_total") for n in encoder_nodes]

    async def bad(client: AsyncGenerateClient) -> None:
        await client.generate("Describe them.", images, max_tokens=4)

    errors, answered = asyncio.run(refused_while_health_answers(node.address, bad))
    assert_refused_and_health_answered(errors, answered, "tokens with its images")
    assert [n.metric("encdis_encoder_patches_total") for n in encoder_nodes] == before  # no encoder worked


def test_a_grpc_request_over_the_message_limit_is_refused_unread(node: NodeProcess) -> None:
    async def run() -> None:
        async with AsyncGenerateClient(node.address, timeout=60) as client:
            with pytest.raises(ResourceExhausted, match="larger than max"):
                await client.generate("x" * (MAX_REQUEST_MESSAGE_BYTES + 1), max_tokens=4)
            assert (await client.generate("Count.", max_tokens=2)).token_ids  # still serving

    asyncio.run(run())


def test_grpc_calls_beyond_the_cap_are_refused_by_grpc_itself(node: NodeProcess) -> None:
    async def run() -> None:
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(MAX_CONCURRENT_RPCS)]
            for w in watches:  # each is in progress once it has sent its first status
                assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            watches.pop().cancel()
            # One call's room back: answered again (the cancellation reaches the server first).
            for _ in range(100):
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.05)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            for w in watches:
                w.cancel()

    asyncio.run(run())
