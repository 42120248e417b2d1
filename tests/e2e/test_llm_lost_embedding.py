"""A request whose embedding never arrives is refused with a clear status and leaves nothing behind.

Real processes on loopback: an LLM node of this module (vLLM, tower not loaded) whose only
encoder is a FakeEncoder (tests/fake_encoder.py) serving from its own thread: for each image it
sends the header, waits a second and hangs up UNAVAILABLE, as a call to an encoder killed
mid-stream ends, on every retry. The request is refused UNAVAILABLE, saying no encoder could
serve it, and leaves nothing behind: admission's counters (requests holding a slot, embedding
bytes reserved; they were up while it waited, so "back" means released), the requests in
flight and the embedding cache are back where they were; and once the fake behaves, the node
serves the next image request.

(A node of its own: tests/e2e/test_llm_drain.py's node has the same one-fake pool, but its SIGTERM
test times short streams against a cold engine, which a test before it would warm.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from encdis.client import AsyncGenerateClient, GenerateClient, Unavailable
from encdis.launcher import NodeProcess, start_node
from tests.e2e.conftest import wait_until
from tests.fake_encoder import FakeEncoderThread
from tests.integration.test_coordinator import png

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPT = "Describe the picture."
# What the request holds while it waits for its embedding, and what it must give back.
HELD = ("encdis_admission_requests", "encdis_admission_embedding_bytes", "encdis_requests_in_flight")
REGION = ("encdis_region_embeddings", "encdis_region_bytes")  # the shared region the engine's workers read
MAX_RETRIES = 3  # the node's default --max-retries
HANG_UP_AFTER = 1.0  # seconds each attempt waits after the header: long enough to read the gauges


@pytest.fixture(scope="module")
def fake_encoder(tiny_ckpt: Path) -> Iterator[FakeEncoderThread]:
    with FakeEncoderThread(tiny_ckpt) as fake:
        yield fake


@pytest.fixture(scope="module")
def node(tiny_ckpt: Path, fake_encoder: FakeEncoderThread) -> Iterator[NodeProcess]:
    n = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                    "--metrics-port", "0", "--encoders", fake_encoder.address], timeout=900, name="llm-lost")
    try:
        yield n
    finally:
        n.stop()


async def refused_while_held(node: NodeProcess) -> tuple[BaseException | None, list[dict[str, float]]]:
    """A one-image request that the fake never completes: its error, and the held gauges while it waited."""
    seen: list[dict[str, float]] = []
    async with AsyncGenerateClient(node.address, timeout=120) as client:
        call = asyncio.ensure_future(client.generate(PROMPT, [png(112, 112, seed=2)], max_tokens=4))
        while not call.done():
            seen.append({name: await asyncio.to_thread(node.metric, name) for name in HELD})
            await asyncio.sleep(0.1)
        return call.exception(), seen


def test_a_request_whose_embedding_never_arrives_is_refused_and_leaves_nothing_behind(
        node: NodeProcess, fake_encoder: FakeEncoderThread) -> None:
    fake = fake_encoder.fake
    before = {name: node.metric(name) for name in (*HELD, *REGION, "encdis_coordinator_cache_bytes")}
    calls = fake.calls
    fake.stall_after_header, fake.hang_up_after_header = HANG_UP_AFTER, True
    try:
        error, seen = asyncio.run(refused_while_held(node))
    finally:
        fake.stall_after_header, fake.hang_up_after_header = 0.0, False

    assert isinstance(error, Unavailable), repr(error)
    assert error.message.startswith("no encoder can serve this request: image 0 failed"), error.message
    assert fake.calls - calls == 1 + MAX_RETRIES
    assert any(s["encdis_admission_requests"] == before["encdis_admission_requests"] + 1
               and s["encdis_admission_embedding_bytes"] > before["encdis_admission_embedding_bytes"]
               for s in seen), seen
    wait_until(lambda: {name: node.metric(name) for name in before} == before, 10,
               f"the node's counters back to {before}")

    # The fake behaves again (back in rotation once its health watch says so): the node serves.
    with GenerateClient(node.address, timeout=120) as client:
        wait_until(lambda: {e.state for e in client.list_encoders()} == {"serving"}, 60, "the fake serving")
        result = client.generate(PROMPT, [png(112, 112, seed=3)], max_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4 and result.usage.images == 1
    assert {name: node.metric(name) for name in REGION} == dict.fromkeys(REGION, 0)
