"""SIGTERM of a real LLM node as a rolling update sees it.

A node of its own (this test ends it). Its only encoder is a FakeEncoder
(tests/fake_encoder.py) with every coordinator bound set longer than an hour. At SIGTERM
four requests are in flight, each with an image at the encoder: three short ones (two gRPC,
one HTTP) whose embeddings the fake holds until the test lets them go, and one that would
run far past the grace period: the fake stalls its image for an hour. Holding the short ones
keeps them in flight at SIGTERM whatever the machine's speed (a text stream of a tiny model
can end before the signal is delivered). What an operator relies on, each checked as an
event:
- health turns NOT_SERVING first, while every request is still in flight;
- a new request is refused at once (gRPC UNAVAILABLE, HTTP 503 with Retry-After), while the
  requests still run: it never waits for the drain;
- the short requests, let go after the refusals, get their embeddings and stream every token
  they asked for during the drain;
- the long one is cut when --drain-grace-seconds is over (the node says so), and the node
  exits 0 then instead of waiting for it;
- nothing of vLLM's outlives the node;
- the shutdown is clean: no door cancelled halfway (a traceback in the log), and Python's
  resource tracker ends by itself rather than being killed (it warns when it is).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis.client import AsyncGenerateClient, EncdisError, GenerateResult, Unavailable
from encdis.launcher import NodeProcess, start_node
from tests.e2e.test_llm_engine_death import engine_processes, running
from tests.e2e.test_openai_front import image_part
from tests.fake_encoder import FakeEncoderThread
from tests.integration.test_coordinator import png, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

GRACE = 30
SHORT_TOKENS = 120
HOUR = 3600
PROMPT = "Tell me a long story about a lighthouse."
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def fake_encoder(tiny_ckpt: Path):
    with FakeEncoderThread(tiny_ckpt) as fake:
        yield fake


@pytest.fixture(scope="module")
def node(tiny_ckpt: Path, fake_encoder):
    n = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                    "--metrics-port", "0", "--http-port", "0", "--drain-grace-seconds", str(GRACE),
                    "--encoders", fake_encoder.address, "--encode-timeout-seconds", str(HOUR),
                    "--attempt-timeout-floor-seconds", str(HOUR), "--keepalive-time-seconds", str(HOUR)],
                   timeout=900, name="llm-drain")
    try:
        yield n
    finally:
        n.stop()


class HttpStream:
    """One streaming chat completion with an image over the node's HTTP door: its content pieces."""

    def __init__(self, base: str, model: str, max_tokens: int, image: bytes) -> None:
        self.base, self.model, self.max_tokens, self.image = base, model, max_tokens, image
        self.pieces: list[str] = []
        self.finish_reason: str | None = None

    async def run(self, client: httpx.AsyncClient) -> None:
        content = [image_part(self.image, "image/png"), {"type": "text", "text": PROMPT}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "stream": True,
                "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
        async with client.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: "):])["choices"][0]
                if choice["delta"].get("content"):
                    self.pieces.append(choice["delta"]["content"])
                self.finish_reason = choice.get("finish_reason") or self.finish_reason


async def image_stream(client: AsyncGenerateClient, image: bytes, max_tokens: int) -> GenerateResult:
    out = GenerateResult()
    async for chunk in client.generate_stream(PROMPT, [image], max_tokens=max_tokens, ignore_eos=True):
        out.add(chunk)
    return out


async def wait_until(condition, streams: dict[str, asyncio.Future], what: str) -> None:
    """wait_for `condition`, failing at once if a request ends meanwhile."""
    await wait_for(lambda: condition() or any(t.done() for t in streams.values()), timeout=300, what=what)
    ended = {name: t.exception() or t.result() for name, t in streams.items() if t.done()}
    assert not ended, f"ended early: {ended}"


async def drain_while_streaming(node: NodeProcess, fake) -> dict:
    base = f"http://127.0.0.1:{node.info['http_port']}"
    seen: dict = {}
    async with AsyncGenerateClient(node.address, timeout=600) as client, \
            httpx.AsyncClient(timeout=600) as http, grpc.aio.insecure_channel(node.address) as channel:
        fake.stall_after_header = HOUR
        endless = asyncio.ensure_future(image_stream(client, png(112, 112, seed=1), 8))
        await wait_until(lambda: fake.calls >= 1, {"the stalled request": endless}, "the stalled call at the encoder")
        # Later calls are held, not stalled; the first call keeps its hour.
        fake.stall_after_header, fake.hold = 0.0, (release := threading.Event())
        model = (await http.get(f"{base}/v1/models")).json()["data"][0]["id"]
        web = HttpStream(base, model, SHORT_TOKENS, png(112, 112, seed=4))
        streams = {"grpc request 1": asyncio.ensure_future(image_stream(client, png(112, 112, seed=2), SHORT_TOKENS)),
                   "grpc request 2": asyncio.ensure_future(image_stream(client, png(112, 112, seed=3), SHORT_TOKENS)),
                   "http request": asyncio.ensure_future(web.run(http)), "the stalled request": endless}
        await wait_until(lambda: fake.images_held >= 3, streams, "three images held at the encoder")

        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == SERVING
        node.terminate()
        seen["health"] = (await watch.read()).status
        seen["ended_at_not_serving"] = [name for name, task in streams.items() if task.done()]

        with pytest.raises(Unavailable, match="draining") as refused:
            await client.generate(PROMPT, max_tokens=4)
        seen["grpc_refusal"] = refused.value.code
        r = await http.post(f"{base}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4})
        seen["http_refusal"] = (r.status_code, r.headers.get("retry-after"), r.json()["error"]["message"])
        seen["ended_at_refusals"] = [name for name, task in streams.items() if task.done()]

        release.set()
        seen["short"] = await asyncio.gather(streams["grpc request 1"], streams["grpc request 2"])
        await streams["http request"]
        seen["web"] = web
        seen["endless"] = (await asyncio.gather(endless, return_exceptions=True))[0]
    return seen


def test_sigterm_drains_in_flight_streams_refuses_new_ones_and_exits_0_with_no_engine_left(
        node, fake_encoder) -> None:
    engines = engine_processes(node)
    assert any(p.name() == "VLLM::EngineCore" for p in engines), [p.name() for p in engines]

    seen = asyncio.run(drain_while_streaming(node, fake_encoder.fake))

    assert seen["health"] == NOT_SERVING
    assert seen["ended_at_not_serving"] == [], "ended before health said NOT_SERVING"
    assert seen["grpc_refusal"] == grpc.StatusCode.UNAVAILABLE
    status, retry_after, message = seen["http_refusal"]
    assert status == 503 and retry_after and "draining" in message
    assert seen["ended_at_refusals"] == [], "the refusals waited for the drain"

    for result in seen["short"]:
        assert len(result.token_ids) == SHORT_TOKENS and result.finish_reason == "length"
    web: HttpStream = seen["web"]
    assert web.finish_reason == "length" and web.pieces

    # The grace period, not the stalled request (an hour away from any bound), ended the drain.
    endless = seen["endless"]
    assert isinstance(endless, EncdisError | grpc.aio.AioRpcError), repr(endless)
    assert node.wait(GRACE + 300) == 0
    log = node.log_path.read_text()
    assert re.search(rf"drain grace period \({GRACE}s\) over with requests still in flight", log), log[-3000:]
    after_stop = log[log.index("encdis.llm_node.server: stopped"):]
    assert "Traceback" not in after_stop and "resource_tracker" not in after_stop, after_stop[-3000:]
    _, alive = psutil.wait_procs(running(engines), timeout=30)
    assert not alive, f"engine processes outlived the node: {alive}"
