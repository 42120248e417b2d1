"""Property-based fuzzing (hypothesis) of the wire codec and a real encoder node's servicer:
every input gets a status, never a crash, a hang or INTERNAL; the node serves after."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encdis.client import EncdisError, EncoderClient
from encdis.client.errors import WireError
from encdis.client.pb import encoder_pb2
from encdis.client.wire import StreamDecoder
from encdis.encoder_node.settings import EncoderSettings
from tests import encoder_images as images
from tests.encoder_inproc import InProcessEncoder

ALLOWED = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

headers = st.builds(
    encoder_pb2.EmbeddingHeader,
    image_index=st.integers(0, 3), grid_thw=st.lists(st.integers(-2, 40), max_size=4),
    num_tokens=st.integers(0, 64), hidden_size=st.integers(0, 64),
    datatype=st.sampled_from(["FP32", "FP16", "BF16", "INT8", ""]), total_bytes=st.integers(0, 1 << 40),
    num_chunks=st.integers(0, 5),
)
chunks = st.builds(encoder_pb2.EmbeddingChunk, image_index=st.integers(0, 3), chunk_index=st.integers(0, 5),
                   data=st.binary(max_size=512))
messages = st.one_of(headers.map(lambda h: encoder_pb2.EncodeResponse(header=h)),
                     chunks.map(lambda c: encoder_pb2.EncodeResponse(chunk=c)),
                     st.just(encoder_pb2.EncodeResponse()))


@FUZZ
@given(st.integers(1, 3), st.lists(messages, max_size=12))
def test_stream_decoder_answers_every_stream_with_embeddings_or_a_wire_error(num_images, stream) -> None:
    dec = StreamDecoder(num_images)
    try:
        for msg in stream:
            emb = dec.feed(msg)
            if emb is not None:
                assert len(emb.data) == emb.shape[0] * emb.shape[1] * {"FP32": 4}.get(emb.datatype, 2)
        dec.close()
    except WireError:
        pass


@pytest.fixture(scope="module")
def node(tiny_ckpt):
    with InProcessEncoder(EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, max_image_bytes=1 << 16)) as n:
        yield n


image_bytes = st.one_of(
    st.binary(max_size=2048),
    st.sampled_from([images.rgb_jpeg(64, 48), images.palette_trns_png(), images.smallest()]).flatmap(
        lambda good: st.integers(0, len(good)).map(lambda cut: good[:cut])),  # truncated real images
    st.builds(images.png_claiming, st.integers(0, 200000), st.integers(0, 200000)),
)


@FUZZ
@given(st.lists(image_bytes, max_size=4), st.integers(0, 1 << 26), st.integers(0, 1 << 26), st.integers(0, 1 << 24))
def test_encoder_answers_every_request_with_a_status(node, imgs, min_pixels, max_pixels, max_chunk) -> None:
    with EncoderClient(node.address, timeout=60) as c:
        try:
            c.encode(imgs, min_pixels=min_pixels, max_pixels=max_pixels, max_chunk_bytes=max_chunk)
        except EncdisError as e:
            assert e.code.name in ALLOWED, e


def test_garbage_that_is_not_a_protobuf_is_invalid_argument(node) -> None:
    with grpc.insecure_channel(node.address) as ch:
        for method in ("/encdis.encoder.v1.EncoderService/Encode", "/encdis.encoder.v1.EncoderService/Describe"):
            call = (ch.unary_stream if method.endswith("Encode") else ch.unary_unary)(method)
            with pytest.raises(grpc.RpcError) as err:
                out = call(b"\xff\xff\xff\xff garbage", timeout=30)
                list(out) if method.endswith("Encode") else out
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "not a valid protobuf" in err.value.details()
    with EncoderClient(node.address, timeout=60) as c:
        assert len(c.encode([images.rgb_jpeg(64, 48)])) == 1
