"""SIGTERM of a real LLM node as a rolling update sees it.

A node of its own (this test ends it). At SIGTERM it has three short text streams in flight
(two gRPC, one HTTP) and one request that would run far past the grace period: its image goes
to the node's only encoder, a FakeEncoder (tests/fake_encoder.py) that stalls after the
header for an hour, with every coordinator bound set longer than that. What an operator
relies on, each checked as an event:
- health turns NOT_SERVING first, while every stream is still running;
- a new request is refused at once (gRPC UNAVAILABLE, HTTP 503 with Retry-After), while the
  streams still run: it never waits for the drain;
- the short streams finish with every token they asked for;
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
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis.client import AsyncGenerateClient, EncdisError, GenerateResult, Unavailable
from encdis.launcher import NodeProcess, start_node
from tests.e2e.test_llm_engine_death import engine_processes, running
from tests.fake_encoder import FakeEncoderThread
from tests.integration.test_coordinator import png

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

GRACE = 30
SHORT_TOKENS = 120
HOUR = 3600
PROMPT = "Tell me a long story about a lighthouse."
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def stalling_encoder(tiny_ckpt: Path):
    with FakeEncoderThread(tiny_ckpt) as fake:
        fake.fake.stall_after_header = HOUR
        yield fake


@pytest.fixture(scope="module")
def node(tiny_ckpt: Path, stalling_encoder):
    n = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                    "--metrics-port", "0", "--http-port", "0", "--drain-grace-seconds", str(GRACE),
                    "--encoders", stalling_encoder.address, "--encode-timeout-seconds", str(HOUR),
                    "--attempt-timeout-floor-seconds", str(HOUR), "--keepalive-time-seconds", str(HOUR)],
                   timeout=900, name="llm-drain")
    try:
        yield n
    finally:
        n.stop()


class HttpStream:
    """One streaming chat completion over the node's HTTP door: its content pieces as they come."""

    def __init__(self, base: str, model: str, max_tokens: int) -> None:
        self.base, self.model, self.max_tokens = base, model, max_tokens
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.started = asyncio.Event()

    async def run(self, client: httpx.AsyncClient) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
        async with client.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: "):])["choices"][0]
                if choice["delta"].get("content"):
                    self.pieces.append(choice["delta"]["content"])
                    self.started.set()
                self.finish_reason = choice.get("finish_reason") or self.finish_reason


async def grpc_stream(client: AsyncGenerateClient, max_tokens: int, started: asyncio.Event) -> GenerateResult:
    out = GenerateResult()
    async for chunk in client.generate_stream(PROMPT, max_tokens=max_tokens, ignore_eos=True):
        out.add(chunk)
        started.set()
    return out


async def stalled_request(client: AsyncGenerateClient) -> GenerateResult:
    """A request whose image never arrives: in flight until something ends it."""
    out = GenerateResult()
    async for chunk in client.generate_stream(PROMPT, [png(112, 112, seed=1)], max_tokens=8):
        out.add(chunk)
    return out


async def drain_while_streaming(node: NodeProcess, fake) -> dict:
    base = f"http://127.0.0.1:{node.info['http_port']}"
    seen: dict = {}
    async with AsyncGenerateClient(node.address, timeout=600) as client, \
            httpx.AsyncClient(timeout=600) as http, grpc.aio.insecure_channel(node.address) as channel:
        started = [asyncio.Event() for _ in range(2)]
        short = [asyncio.ensure_future(grpc_stream(client, SHORT_TOKENS, e)) for e in started]
        model = (await http.get(f"{base}/v1/models")).json()["data"][0]["id"]
        web = HttpStream(base, model, SHORT_TOKENS)
        web_task = asyncio.ensure_future(web.run(http))
        endless = asyncio.ensure_future(stalled_request(client))
        streams = [*short, web_task, endless]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in [*started, web.started])), 300)
        while fake.fake.calls == 0:  # the stalled request is at the encoder
            assert not endless.done(), endless.exception()
            await asyncio.sleep(0.05)

        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == SERVING
        node.terminate()
        seen["health"] = (await watch.read()).status
        seen["streams_running_at_not_serving"] = sum(not t.done() for t in streams)

        with pytest.raises(Unavailable, match="draining") as refused:
            await client.generate(PROMPT, max_tokens=4)
        seen["grpc_refusal"] = refused.value.code
        r = await http.post(f"{base}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4})
        seen["http_refusal"] = (r.status_code, r.headers.get("retry-after"), r.json()["error"]["message"])
        seen["endless_running_at_refusals"] = not endless.done()

        seen["short"] = await asyncio.gather(*short)
        await web_task
        seen["web"] = web
        ended = (await asyncio.gather(endless, return_exceptions=True))[0]
        seen["endless"] = ended
    return seen


def test_sigterm_drains_in_flight_streams_refuses_new_ones_and_exits_0_with_no_engine_left(
        node, stalling_encoder) -> None:
    engines = engine_processes(node)
    assert any(p.name() == "VLLM::EngineCore" for p in engines), [p.name() for p in engines]

    seen = asyncio.run(drain_while_streaming(node, stalling_encoder))

    assert seen["health"] == NOT_SERVING
    assert seen["streams_running_at_not_serving"] == 4, "a stream ended before health said NOT_SERVING"
    assert seen["grpc_refusal"] == grpc.StatusCode.UNAVAILABLE
    status, retry_after, message = seen["http_refusal"]
    assert status == 503 and retry_after and "draining" in message
    assert seen["endless_running_at_refusals"], "the refusals waited for the drain"

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
