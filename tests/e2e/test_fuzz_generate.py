"""Property-based fuzzing (hypothesis) of a real LLM node's GenerateService: every request gets
an answer or a client-side status, never INTERNAL, a crash or a hang; the node serves after."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encdis.client import EncdisError, GenerateClient
from tests import encoder_images as images

pytestmark = pytest.mark.vllm

ALLOWED = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(0, 2, width=32))
requests = st.fixed_dictionaries({
    "prompt": st.text(max_size=200),
    "images": st.lists(st.one_of(st.binary(max_size=256), st.just(images.smallest()),
                                 st.just(images.rgb_jpeg(64, 48)[:300])), max_size=3),
    "max_tokens": st.integers(0, 5000),
    "temperature": floats, "top_p": floats, "top_k": st.integers(-5, 100),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    "stop": st.lists(st.text(max_size=8), max_size=20),
    "request_id": st.one_of(st.just(""), st.text(max_size=140)),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests)
def test_every_generate_request_gets_an_answer_or_a_status(llm_node, req) -> None:
    req = {**req, "max_tokens": min(req["max_tokens"], 4) if req["max_tokens"] < 4096 else req["max_tokens"]}
    with GenerateClient(llm_node.address, timeout=120) as client:
        try:
            client.generate(req.pop("prompt"), req.pop("images"), **req)
        except EncdisError as e:
            assert e.code.name in ALLOWED, e


def test_garbage_that_is_not_a_protobuf_is_invalid_argument(llm_node) -> None:
    with grpc.insecure_channel(llm_node.address) as ch:
        call = ch.unary_stream("/encdis.llm.v1.GenerateService/Generate")
        with pytest.raises(grpc.RpcError) as err:
            list(call(b"\x0a\xff\xff\xff\xff\x0f", timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    with GenerateClient(llm_node.address, timeout=60) as client:
        assert client.generate("Count.", max_tokens=2).token_ids
