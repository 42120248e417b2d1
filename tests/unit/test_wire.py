"""The tensor wire codec: what a receiver of an Encode stream can rely on."""

from __future__ import annotations

import numpy as np
import pytest

from encdis.client.errors import WireError
from encdis.client.pb import encoder_pb2
from encdis.client.wire import (
    BatchInfo,
    StreamDecoder,
    content_digest,
    decode_array,
    decode_stream,
    embedding_messages,
)


def _bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 by truncation (exactly representable inputs round-trip bit for bit)."""
    return (a.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()


def _messages(index=0, rows=5, cols=8, datatype="FP32", max_chunk_bytes=64, seed=0, **kw):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    if datatype == "FP32":
        data, expected = a.tobytes(), a
    elif datatype == "FP16":
        data, expected = a.astype("<f2").tobytes(), a.astype(np.float16)
    else:
        a = decode_array("BF16", (rows, cols), _bf16_bytes(a))  # values bf16 can hold exactly
        data, expected = _bf16_bytes(a), a
    msgs = list(embedding_messages(image_index=index, grid_thw=(1, 2, 2 * rows), datatype=datatype,
                                   shape=(rows, cols), data=data, digest=f"d{index}",
                                   max_chunk_bytes=max_chunk_bytes, **kw))
    return msgs, expected


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
def test_round_trip_keeps_values_shape_and_metadata(datatype):
    msgs, expected = _messages(datatype=datatype, batch=BatchInfo(0.25, (40, 12)), queue_seconds=0.5)
    (emb,) = decode_stream(msgs, 1)
    assert emb.shape == (5, 8) and emb.datatype == datatype and emb.digest == "d0"
    assert emb.grid_thw == (1, 2, 10)
    assert emb.batch == BatchInfo(0.25, (40, 12)) and emb.queue_seconds == 0.5
    np.testing.assert_array_equal(emb.array(), expected)


def test_chunks_never_exceed_the_limit_and_cover_every_byte():
    msgs, _ = _messages(rows=7, cols=9, max_chunk_bytes=50)  # 252 bytes -> 6 chunks (5x50 + 2)
    header, chunks = msgs[0].header, [m.chunk for m in msgs[1:]]
    assert header.num_chunks == len(chunks) == 6
    assert all(len(c.data) <= 50 for c in chunks)
    assert sum(len(c.data) for c in chunks) == header.total_bytes == 7 * 9 * 4
    assert [c.chunk_index for c in chunks] == list(range(6))


def test_several_images_decode_in_order():
    msgs = _messages(index=0, seed=1)[0] + _messages(index=1, rows=3, seed=2)[0]
    embs = decode_stream(msgs, 2)
    assert [e.image_index for e in embs] == [0, 1]
    assert embs[1].shape == (3, 8)


def test_stream_decoder_yields_each_image_when_its_last_chunk_arrives():
    msgs, _ = _messages(max_chunk_bytes=40)
    dec = StreamDecoder(1)
    results = [dec.feed(m) for m in msgs]
    assert all(r is None for r in results[:-1]) and results[-1] is not None
    dec.close()


def _header_msg(**fields):
    base = dict(image_index=0, grid_thw=[1, 2, 2], num_tokens=1, hidden_size=4, datatype="FP32",
                total_bytes=16, num_chunks=1)
    base.update(fields)
    return encoder_pb2.EncodeResponse(header=encoder_pb2.EmbeddingHeader(**base))


def _chunk_msg(data=b"\0" * 16, image_index=0, chunk_index=0):
    return encoder_pb2.EncodeResponse(
        chunk=encoder_pb2.EmbeddingChunk(image_index=image_index, chunk_index=chunk_index, data=data))


@pytest.mark.parametrize(
    "stream, match",
    [
        ([_header_msg(total_bytes=20), _chunk_msg()], "total_bytes"),  # size disagrees with shape
        ([_header_msg(), _chunk_msg(b"\0" * 12)], "got 12 bytes|of 1 chunks|12"),  # short chunk data
        ([_header_msg(), _chunk_msg(b"\0" * 20)], "exceed"),  # too many bytes
        ([_header_msg(grid_thw=[1, 2])], "grid_thw"),  # wrong grid shape
        ([_header_msg(num_tokens=0, total_bytes=0)], "empty"),  # empty shape
        ([_header_msg(datatype="FP64")], "unknown datatype"),  # unsupported datatype
        ([_header_msg(num_chunks=2, total_bytes=16), _chunk_msg(b"\0" * 8, chunk_index=1)], "out of order"),
        ([_header_msg(num_chunks=2), _chunk_msg(b"\0" * 8)], "inside image 0|1 of 2"),  # missing chunk
        ([_header_msg(), _chunk_msg(), _chunk_msg(chunk_index=1)], "before its header"),  # extra chunk
        ([_chunk_msg()], "before its header"),  # chunk first
        ([_header_msg(), _chunk_msg(image_index=1)], "chunk for image 1"),  # chunk of another image
        ([_header_msg(image_index=1), _chunk_msg(image_index=1)], "expected image 0"),  # images out of order
        ([_header_msg(), _header_msg()], "before image 0 was complete"),  # header inside an image
        ([], "after 0 of 1"),  # short stream: nothing
        ([encoder_pb2.EncodeResponse()], "empty EncodeResponse"),
    ],
)
def test_malformed_streams_are_rejected(stream, match):
    with pytest.raises(WireError, match=match):
        decode_stream(stream, 1)


def test_stream_with_fewer_images_than_requested_is_rejected():
    msgs, _ = _messages()
    with pytest.raises(WireError, match="after 1 of 2"):
        decode_stream(msgs, 2)


def test_stream_with_more_images_than_requested_is_rejected():
    msgs = _messages(index=0)[0] + _messages(index=1)[0]
    with pytest.raises(WireError, match="more images|expected image"):
        decode_stream(msgs, 1)


def test_decode_array_rejects_wrong_sizes():
    with pytest.raises(WireError, match="needs 32 bytes"):
        decode_array("FP32", (2, 4), b"\0" * 31)


def test_encoder_refuses_data_that_does_not_match_its_shape():
    with pytest.raises(ValueError):
        list(embedding_messages(image_index=0, grid_thw=(1, 2, 2), datatype="FP32", shape=(1, 4),
                                data=b"\0" * 15, digest=""))


def test_max_total_bytes_limits_what_a_receiver_accepts():
    msgs, _ = _messages(rows=4, cols=8)
    dec = StreamDecoder(1, max_total_bytes=100)
    with pytest.raises(WireError, match="exceeds the limit"):
        dec.feed(msgs[0])


def test_content_digest_depends_on_bytes_bounds_and_weights():
    base = content_digest(b"img", 3136, 200704, "fp")
    assert base == content_digest(b"img", 3136, 200704, "fp")
    assert len({base, content_digest(b"img2", 3136, 200704, "fp"), content_digest(b"img", 3136, 100352, "fp"),
                content_digest(b"img", 6272, 200704, "fp"), content_digest(b"img", 3136, 200704, "fp2")}) == 5
