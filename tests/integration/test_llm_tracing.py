"""The LLM node's request span, from the gRPC front door to the engine, against a real OTLP
receiver: a real GenerateService server over the real GenerationService and Coordinator, with
one real (traced) encoder node, and a FakeEngine in vLLM's place.

A fake engine, because what is checked at that boundary is what the node hands vLLM: the
request's W3C context as `trace_headers`, which vLLM reads for its own request span (that
vLLM then joins the trace is tests/e2e/test_tracing.py, with the real engine). Through the HTTP
door the boundary is vLLM's serving app, which reads the request's `traceparent` header; a fake
app stands in for it here and records the headers it is handed.
"""

from __future__ import annotations

import base64
import secrets

import aiohttp
import grpc
import pytest
from prometheus_client import CollectorRegistry

from encdis import serving
from encdis.client.generate_client import generate_request
from encdis.client.pb import llm_pb2_grpc
from encdis.launcher import NodeProcess
from encdis.llm_node.engine import GenerationDelta, SamplingSpec
from encdis.llm_node.generation import GenerationRequest, GenerationService
from encdis.llm_node.grpc_front import GenerateServicer
from encdis.llm_node.http_front import HttpFront, build_app
from encdis.llm_node.metrics import LLMNodeMetrics
from encdis.llm_node.prompt import PromptRenderer, user_message
from encdis.llm_node.settings import LLMSettings
from encdis.tracing import Tracing
from tests.integration.test_coordinator import NODE_TIMEOUT, coordinator, encoder_args, png, wait_for
from tests.otlp_receiver import OtlpReceiver


class FakeEngine:
    """Stands in for vLLM: records each request's trace_headers and answers one token."""

    def __init__(self) -> None:
        self.trace_headers: list[dict | None] = []
        self.handoff = FakeHandoff()

    async def generate(self, prompt, sampling, *, images=(), request_id=None, trace_headers=None):
        self.trace_headers.append(dict(trace_headers) if trace_headers else None)
        yield GenerationDelta(text="x", token_ids=[7], finished=True, finish_reason="length", prompt_tokens=3)


class FakeHandoff:
    """Stands in for the shared region: holds nothing."""

    async def mm_data(self, images):
        return {}, {}

    def done(self, images) -> None:
        pass


class FakeVllmApp:
    """Stands in for vLLM's OpenAI serving app: records the headers of each request and answers 200."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        await receive()
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def encoder(tiny_ckpt, receiver):
    node = NodeProcess([*encoder_args(tiny_ckpt, "127.0.0.1"), "--otlp-traces-endpoint", receiver.address],
                       host="127.0.0.1").wait_ready(NODE_TIMEOUT)
    try:
        yield node
    finally:
        node.stop()


async def test_the_request_span_joins_the_callers_trace_and_reaches_the_engine(encoder, receiver, tiny_ckpt) -> None:
    tracing = Tracing.configured(receiver.address, "encdis-llm")
    engine = FakeEngine()
    settings = LLMSettings(model=str(tiny_ckpt))
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    try:
        async with coordinator(tiny_ckpt, [encoder.address]) as coord:
            coord.tracing = coord._dispatcher.tracing = tracing  # as the LLM node sets it before start()
            await wait_for(lambda: len(coord.pool.serving()) == 1, what="the encoder serving")
            service = GenerationService(settings, engine, coord, PromptRenderer(str(tiny_ckpt)),
                                        LLMNodeMetrics(CollectorRegistry()))
            server = grpc.aio.server(interceptors=[serving.ErrorMappingInterceptor()])
            llm_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(settings, service, coord), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = llm_pb2_grpc.GenerateServiceStub(channel).Generate(
                        generate_request("Describe.", [png(224, 224, 21)], max_tokens=1),
                        metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")], timeout=60)
                    replies = [r async for r in call]
                assert replies[-1].finished
            finally:
                await server.stop(None)
    finally:
        await tracing.shutdown()

    spans = [s for s in receiver.wait_for(
        lambda spans: any(s.trace_id == trace_id and s.name == "encdis.encoder.Encode" for s in spans)
        and any(s.trace_id == trace_id and s.name == "encdis.generate" for s in spans), timeout=60)
        if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in spans}
    [generate] = [s for s in spans if s.name == "encdis.generate"]
    assert generate.parent_span_id == parent_id and generate.service == "encdis-llm"
    assert generate.attributes["rpc.grpc.status_code"] == "OK"
    [encode] = [s for s in spans if s.name == "encdis.coordinator.encode"]
    assert encode.parent_span_id == generate.span_id
    [enc] = [s for s in spans if s.name == "encdis.encoder.Encode"]
    assert by_id[by_id[enc.parent_span_id].parent_span_id] is encode  # encoder <- call <- request's encode
    # vLLM gets the request span as its parent, in the W3C form it reads.
    [headers] = engine.trace_headers
    assert headers["traceparent"] == f"00-{trace_id}-{generate.span_id}-01"


async def test_without_an_endpoint_nothing_is_recorded_and_the_engine_gets_no_headers(tiny_ckpt, encoder) -> None:
    engine = FakeEngine()
    settings = LLMSettings(model=str(tiny_ckpt))
    async with coordinator(tiny_ckpt, [encoder.address]) as coord:
        assert not coord.tracing.enabled
        await wait_for(lambda: len(coord.pool.serving()) == 1, what="the encoder serving")
        service = GenerationService(settings, engine, coord, PromptRenderer(str(tiny_ckpt)),
                                    LLMNodeMetrics(CollectorRegistry()))
        callers = {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}
        req = GenerationRequest(messages=user_message("Describe.", 1), images=[png(112, 112, 22)],
                                sampling=SamplingSpec(max_tokens=1), request_id="r1", trace_context=callers)
        steps = [s async for s in service.generate(req)]
    assert steps[-1].finished
    assert coord.tracing.provider is None and service.tracing.provider is None  # no exporter anywhere
    # vLLM traces only when the node does: it is handed nothing (not even the caller's context).
    assert engine.trace_headers == [None]


async def test_the_openai_door_honours_a_callers_traceparent(encoder, receiver, tiny_ckpt) -> None:
    tracing = Tracing.configured(receiver.address, "encdis-llm")
    engine = FakeEngine()
    settings = LLMSettings(model=str(tiny_ckpt))
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    image = "data:image/png;base64," + base64.b64encode(png(168, 168, 23)).decode()
    body = {"model": str(tiny_ckpt), "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Describe."}]}]}
    try:
        async with coordinator(tiny_ckpt, [encoder.address]) as coord:
            coord.tracing = coord._dispatcher.tracing = tracing
            await wait_for(lambda: len(coord.pool.serving()) == 1, what="the encoder serving")
            service = GenerationService(settings, engine, coord, PromptRenderer(str(tiny_ckpt)),
                                        LLMNodeMetrics(CollectorRegistry()))
            vllm_app = FakeVllmApp()
            http = HttpFront(build_app(settings, service, lambda: True, inner=vllm_app), "127.0.0.1", 0)
            port = await http.start()
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                            headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}) as r:
                        assert r.status == 200, await r.text()
            finally:
                await http.stop()
    finally:
        await tracing.shutdown()
    spans = receiver.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == "encdis.generate"
                                                for s in spans), timeout=60)
    [generate] = [s for s in spans if s.trace_id == trace_id and s.name == "encdis.generate"]
    assert generate.parent_span_id == parent_id
    [headers] = vllm_app.headers
    assert headers["traceparent"] == f"00-{trace_id}-{generate.span_id}-01"
