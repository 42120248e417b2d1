"""Traces from real encoder nodes and a real coordinator to a real OTLP receiver (tests/otlp_receiver.py).

The caller's W3C trace context travels in the Encode call's gRPC metadata: the node's Encode
span joins that trace as a child of the caller's span, and its steps (preprocess, queue,
forward with the batch's size, send) are children of the Encode span. With no endpoint the
node creates no exporter at all. A coordinator (in this process, as in the LLM node) traces
each request, each encoder call (the encoder chosen, predicted and actual seconds) and each
image (cache hit or miss), and passes its call's context on, so one trace holds both encoders'
spans, correctly parented.
"""

from __future__ import annotations

import secrets

import pytest

from encdis.client.encoder_client import AsyncEncoderClient
from encdis.launcher import NodeProcess
from encdis.tracing import Tracing, trace_metadata
from tests.integration.test_coordinator import NODE_TIMEOUT, coordinator, encoder_args, png, wait_for
from tests.otlp_receiver import OtlpReceiver


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def traced_nodes(tiny_ckpt, receiver):
    args = [*encoder_args(tiny_ckpt, "127.0.0.1"), "--otlp-traces-endpoint", receiver.address]
    nodes = [NodeProcess(args, host="127.0.0.1") for _ in range(2)]
    try:
        yield [n.wait_ready(NODE_TIMEOUT) for n in nodes]
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture
def traced_node(traced_nodes):
    return traced_nodes[0]


async def test_encode_spans_join_the_callers_trace(traced_node, receiver) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    metadata = [("traceparent", f"00-{trace_id}-{parent_id}-01")]
    async with AsyncEncoderClient(traced_node.address, timeout=120) as client:
        out = [e async for e in client.encode_iter([png(224, 224, 1), png(112, 168, 2)], metadata=metadata)]
    assert len(out) == 2

    def complete(spans) -> bool:
        # Encode, preprocess, 2 x (decode, queue, forward, send)
        return sum(s.trace_id == trace_id for s in spans) >= 10

    spans = [s for s in receiver.wait_for(complete, timeout=60) if s.trace_id == trace_id]
    [encode] = [s for s in spans if s.name == "encdis.encoder.Encode"]
    assert encode.service == "encdis-encoder" and encode.parent_span_id == parent_id
    assert encode.attributes["encdis.images"] == 2 and encode.attributes["rpc.grpc.status_code"] == "OK"
    [preprocess] = [s for s in spans if s.name == "encdis.encoder.preprocess"]
    # Each image's decoding (bytes to pixels), within the call's preprocessing.
    decodes = [s for s in spans if s.name == "encdis.encoder.decode"]
    assert sorted(s.attributes["encdis.image_index"] for s in decodes) == [0, 1]
    assert all(s.parent_span_id == preprocess.span_id for s in decodes)
    assert all(preprocess.start_ns <= s.start_ns <= s.end_ns <= preprocess.end_ns for s in decodes)
    children = [s for s in spans if s is not encode and s not in decodes]
    assert all(s.parent_span_id == encode.span_id for s in children)
    names = sorted(s.name for s in children)
    steps = [f"encdis.encoder.{n}" for n in ("queue", "forward", "send")]
    assert names == sorted(["encdis.encoder.preprocess", *steps, *steps])
    forwards = [s for s in children if s.name == "encdis.encoder.forward"]
    assert sorted(s.attributes["encdis.image_index"] for s in forwards) == [0, 1]
    # An image's queue is its wait in the batcher, after its preprocessing (0.2 ms: the span's
    # start is measured on the monotonic clock, the preprocess span's end on the wall clock).
    queues = [s for s in children if s.name == "encdis.encoder.queue"]
    assert all(s.start_ns >= preprocess.end_ns - 200_000 for s in queues), (preprocess, queues)
    assert all(s.attributes["encdis.batch_images"] >= 1 and s.attributes["encdis.batch_patches"] > 0 for s in forwards)


async def test_a_call_without_trace_context_starts_its_own_trace(traced_node, receiver) -> None:
    before = {s.trace_id for s in receiver.spans}
    async with AsyncEncoderClient(traced_node.address, timeout=120) as client:
        [_ async for _ in client.encode_iter([png(140, 140, 3)])]
    spans = receiver.wait_for(lambda spans: any(s.name == "encdis.encoder.Encode" and s.trace_id not in before
                                                 for s in spans), timeout=60)
    [root] = [s for s in spans if s.name == "encdis.encoder.Encode" and s.trace_id not in before]
    assert root.parent_span_id == ""


def test_tracing_off_creates_no_provider_or_exporter() -> None:
    off = Tracing.configured("", "encdis-encoder")
    assert not off.enabled and off.provider is None
    with off.tracer.start_as_current_span("x") as span:
        assert not span.is_recording()
        assert trace_metadata() == []  # nothing to propagate either


async def test_one_trace_spans_the_coordinator_and_both_encoders(traced_nodes, receiver, tiny_ckpt) -> None:
    tracing = Tracing.configured(receiver.address, "encdis-llm")
    addresses = {n.address for n in traced_nodes}
    try:
        async with coordinator(tiny_ckpt, [n.address for n in traced_nodes]) as coord:
            coord.tracing = coord._dispatcher.tracing = tracing  # as the LLM node sets it before start()
            await wait_for(lambda: len(coord.pool.serving()) == 2, what="both encoders serving")
            images = [png(224, 224, 11), png(168, 112, 12)]  # two idle encoders: one image each
            with tracing.tracer.start_as_current_span("front door") as door:
                await coord.encode(images)
                await coord.encode(images)  # the same again: cache hits
            trace_id = format(door.get_span_context().trace_id, "032x")
    finally:
        await tracing.shutdown()

    def complete(spans) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return sum(s.name == "encdis.encoder.Encode" for s in mine) == 2 and any(s.name == "front door" for s in mine)

    spans = [s for s in receiver.wait_for(complete, timeout=60) if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in spans}
    [root] = [s for s in spans if s.name == "front door"]
    encodes = [s for s in spans if s.name == "encdis.coordinator.encode"]
    assert len(encodes) == 2 and all(s.parent_span_id == root.span_id for s in encodes)
    assert sorted(s.attributes["encdis.cached_images"] for s in encodes) == [0, 2]
    calls = [s for s in spans if s.name == "encdis.coordinator.encode_call"]
    assert {c.attributes["encdis.encoder"] for c in calls} == addresses  # the encoder chosen, each
    assert all(by_id[c.parent_span_id].name == "encdis.coordinator.encode" for c in calls)
    assert all(c.attributes["encdis.predicted_seconds"] > 0 and c.attributes["encdis.actual_seconds"] > 0
               for c in calls)
    for enc in (s for s in spans if s.name == "encdis.encoder.Encode"):
        call = by_id[enc.parent_span_id]  # the encoder's span hangs under the call that reached it
        assert call.name == "encdis.coordinator.encode_call" and enc.service == "encdis-encoder"
    images_ = [s for s in spans if s.name == "encdis.coordinator.image"]
    misses = [s for s in images_ if s.attributes["encdis.cache"] == "miss"]
    hits = [s for s in images_ if s.attributes["encdis.cache"] == "hit"]
    assert sorted(s.attributes["encdis.image_index"] for s in misses) == [0, 1]
    assert {s.attributes["encdis.encoder"] for s in misses} == addresses
    assert sorted(s.attributes["encdis.image_index"] for s in hits) == [0, 1]
    assert {s.service for s in spans} == {"encdis-llm", "encdis-encoder"}
