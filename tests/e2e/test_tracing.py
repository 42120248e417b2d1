"""One trace per request across the LLM node, both encoders and vLLM, received by a real OTLP
TraceService server on loopback (tests/otlp_receiver.py).

The caller sends a W3C traceparent in the Generate call's metadata. The LLM node's request span
must join the caller's trace; the coordinator's spans hang under it, one call per encoder (the
encoder chosen recorded); each encoder node's Encode span hangs under the call that reached it;
and vLLM's own request span (given the context as its trace_headers) hangs under the request's.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from encdis.client.generate_client import generate_request
from encdis.client.pb import llm_pb2_grpc
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.demo import synthetic_photo
from tests.e2e.conftest import encoder_processes, encoders_by_address, wait_until
from tests.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def traced(tiny_ckpt: Path) -> Iterator[tuple[OtlpReceiver, NodeProcess, list[NodeProcess]]]:
    rx = OtlpReceiver()
    try:
        flags = ["--otlp-traces-endpoint", rx.address]
        with encoder_processes(tiny_ckpt, *flags) as encoders:
            llm = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0", *flags,
                              "--encoders", ",".join(n.address for n in encoders)], timeout=900)
            try:
                wait_until(lambda: {e.state for e in encoders_by_address(llm).values()} == {"serving"}, 60,
                           "both encoders serving")
                yield rx, llm, encoders
            finally:
                llm.stop()
    finally:
        rx.close()


def test_one_trace_holds_the_llm_node_both_encoders_and_vllm(traced) -> None:
    rx, llm, encoders = traced
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    request = generate_request("Describe the pictures.", [synthetic_photo(224, 224, 5), synthetic_photo(168, 112, 6)],
                               max_tokens=4)
    with grpc.insecure_channel(llm.address) as channel:
        replies = list(llm_pb2_grpc.GenerateServiceStub(channel).Generate(
            request, metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")], timeout=120))
    assert replies[-1].finished

    def complete(spans) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return (sum(s.name == "encdis.encoder.Encode" for s in mine) == 2
                and any(s.name == "encdis.generate" for s in mine)
                and any(not s.service.startswith("encdis") for s in mine))

    spans = [s for s in rx.wait_for(complete, timeout=90) if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in spans}
    [generate] = [s for s in spans if s.name == "encdis.generate"]
    assert generate.service == "encdis-llm" and generate.parent_span_id == parent_id
    assert generate.attributes["encdis.images"] == 2 and generate.attributes["rpc.grpc.status_code"] == "OK"
    [encode] = [s for s in spans if s.name == "encdis.coordinator.encode"]
    assert encode.parent_span_id == generate.span_id
    calls = [s for s in spans if s.name == "encdis.coordinator.encode_call"]
    assert {c.attributes["encdis.encoder"] for c in calls} == {n.address for n in encoders}
    assert all(c.parent_span_id == encode.span_id for c in calls)
    for enc in (s for s in spans if s.name == "encdis.encoder.Encode"):
        assert by_id[enc.parent_span_id].name == "encdis.coordinator.encode_call"
    vllm_spans = [s for s in spans if not s.service.startswith("encdis")]
    assert any(s.parent_span_id == generate.span_id for s in vllm_spans), \
        f"vLLM's spans are not children of the request's: {[(s.service, s.name, s.parent_span_id) for s in vllm_spans]}"
