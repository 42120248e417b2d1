"""The tensor wire codec: what a receiver of an Encode stream can rely on."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from encdis.client.chunk_frames import parse_chunk_frame
from encdis.client.errors import WireError
from encdis.client.pb import encoder_pb2
from encdis.client.wire import (
    BatchInfo,
    ExpectedEmbedding,
    StreamDecoder,
    content_digest,
    decode_array,
    decode_stream,
    embedding_frames,
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
    msgs, expected = _messages(datatype=datatype, batch=BatchInfo(0.25, (40, 12)), queue_seconds=0.5,
                               preprocess_seconds=0.125)
    (emb,) = decode_stream(msgs, 1)
    assert emb.shape == (5, 8) and emb.datatype == datatype and emb.digest == "d0"
    assert emb.grid_thw == (1, 2, 10)
    assert emb.batch == BatchInfo(0.25, (40, 12)) and emb.queue_seconds == 0.5 and emb.preprocess_seconds == 0.125
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


def test_content_digest_depends_on_bytes_bounds_weights_and_datatype():
    base = content_digest(b"img", 3136, 200704, "fp")
    assert base == content_digest(b"img", 3136, 200704, "fp")
    assert len({base, content_digest(b"img2", 3136, 200704, "fp"), content_digest(b"img", 3136, 100352, "fp"),
                content_digest(b"img", 6272, 200704, "fp"), content_digest(b"img", 3136, 200704, "fp2"),
                content_digest(b"img", 3136, 200704, "fp", datatype="BF16")}) == 6
    with pytest.raises(ValueError, match="datatype 'F32'"):
        content_digest(b"img", 3136, 200704, "fp", datatype="F32")


# -- serialised frames: the encoder's send path and the receiver's fast path ----------------------


def _frames_and_messages(index=0, rows=300, cols=8, max_chunk_bytes=64):
    data = np.arange(rows * cols, dtype="<f4").tobytes()
    kw = dict(image_index=index, grid_thw=(1, 2, 2 * rows), datatype="FP32", shape=(rows, cols), data=data,
              digest="d", max_chunk_bytes=max_chunk_bytes, batch=BatchInfo(0.5, (4 * rows,)), queue_seconds=0.25,
              preprocess_seconds=0.0625)
    return list(embedding_frames(**kw)), list(embedding_messages(**kw)), data


@pytest.mark.parametrize("index", [0, 1, 300])  # 300: a two-byte varint
def test_frames_are_exactly_what_protobuf_writes_with_chunk_0_in_the_header_message(index):
    frames, msgs, _ = _frames_and_messages(index=index)  # 9600 bytes in 150 chunks: chunk indices past 127
    first = encoder_pb2.EncodeResponse(header=msgs[0].header, first_chunk=msgs[1].chunk)
    assert frames[0] == first.SerializeToString()
    assert frames[1:] == [m.SerializeToString() for m in msgs[2:]]
    assert len(frames) == msgs[0].header.num_chunks == 150


def test_frames_decode_in_place_to_the_same_embedding_as_messages():
    frames, msgs, data = _frames_and_messages()
    (from_frames,) = decode_stream(frames, 1)
    (from_messages,) = decode_stream(msgs, 1)
    assert bytes(from_frames.data) == bytes(from_messages.data) == data
    assert from_frames.batch == from_messages.batch and from_frames.queue_seconds == 0.25
    assert from_frames.preprocess_seconds == from_messages.preprocess_seconds == 0.0625
    assert isinstance(from_frames.data, memoryview) and not from_frames.data.readonly


def test_messages_the_fast_parser_does_not_know_read_the_same_through_protobuf():
    frames, _, data = _frames_and_messages(rows=4, cols=4, max_chunk_bytes=32)
    unknown = frames[1] + b"\x28\x07"  # an unknown top-level field 5 after the chunk
    reordered = encoder_pb2.EncodeResponse.FromString(frames[1])
    # data first, then chunk_index: valid protobuf in another field order
    inner = b"\x1a\x20" + bytes(reordered.chunk.data) + b"\x10\x01"
    reordered_raw = b"\x12" + bytes([len(inner)]) + inner
    assert parse_chunk_frame(unknown) is None
    assert parse_chunk_frame(reordered_raw) is not None
    for second in (unknown, reordered_raw):
        (emb,) = decode_stream([frames[0], second], 1)
        assert bytes(emb.data) == data


def test_the_receivers_copy_can_run_elsewhere_and_the_image_is_taken_after():
    frames, _, data = _frames_and_messages(rows=4, cols=4, max_chunk_bytes=32)
    dec = StreamDecoder(1)
    copies = [dec.accept(f) for f in frames]
    assert dec.image_complete
    for c in copies:
        c.run()
    emb = dec.take()
    assert bytes(emb.data) == data
    dec.close()


def _expected(rows=1, hidden=4, datatype="FP32", patches=4):
    return ExpectedEmbedding(num_tokens=rows, hidden_size=hidden, datatype=datatype, patches=patches)


@pytest.mark.parametrize("expected, match", [
    (_expected(rows=2), r"image 0: the encoder announced 1x4 rows x hidden, expected 2x4"),
    (_expected(hidden=8), "expected 1x8"),
    (_expected(datatype="BF16"), "announced datatype 'FP32', expected 'BF16'"),
    (_expected(patches=8), r"grid_thw \[1, 2, 2\] \(4 patches\), expected 8 patches"),
])
def test_a_header_that_disagrees_with_what_the_caller_expects_is_refused(expected, match):
    with pytest.raises(WireError, match=match):
        decode_stream([_header_msg(), _chunk_msg()], 1, expected=[expected])


def test_a_header_that_agrees_with_the_expectation_passes():
    (emb,) = decode_stream([_header_msg(), _chunk_msg()], 1, expected=[_expected(datatype="")])
    assert emb.shape == (1, 4)


def test_two_gib_announced_for_a_64_token_image_is_refused_without_allocating():
    rows = (1 << 31) // (8192 * 2)
    header = _header_msg(grid_thw=[1, 2, 2 * rows], num_tokens=rows, hidden_size=8192, datatype="BF16",
                         total_bytes=1 << 31, num_chunks=512)
    for kw in ({"expected": [ExpectedEmbedding(64, 8192, "BF16", 256)]}, {"max_total_bytes": 64 * 8192 * 2}):
        tracemalloc.start()
        try:
            with pytest.raises(WireError, match="image 0"):
                StreamDecoder(1, **kw).feed(header.SerializeToString())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"{peak} bytes allocated for a refused header"


@pytest.mark.parametrize("stream, match", [
    ([_header_msg(num_chunks=2), _chunk_msg(b"\0" * 8), _chunk_msg(b"\0" * 4, chunk_index=1)],
     "got 12 bytes in the announced 2 chunks"),  # the last chunk leaves the image short
    ([_header_msg(num_chunks=2), _chunk_msg(b""), _chunk_msg(chunk_index=1)], "chunk 0 is empty"),
    ([_header_msg(num_chunks=17)], "num_chunks 17 for 16 bytes"),
    ([encoder_pb2.EncodeResponse(chunk=encoder_pb2.EmbeddingChunk(data=b"\0"),
                                 first_chunk=encoder_pb2.EmbeddingChunk(data=b"\0"))], "first_chunk in a message"),
    ([b"\x0a\xff\xff"], "undecodable"),  # a header field longer than the message
    ([_header_msg().SerializeToString() + b"\x1a\x16\x1a\x14" + b"\0" * 20], "exceed"),  # first chunk overruns
])
def test_broken_serialised_and_chunk_rules_are_refused(stream, match):
    with pytest.raises(WireError, match=match):
        decode_stream([m.SerializeToString() if not isinstance(m, bytes) else m for m in stream], 1)


def test_a_cached_embedding_says_so_and_carries_no_batch_and_a_forward_one_does_not():
    data = np.arange(16, dtype="<f4").tobytes()
    kw = dict(image_index=0, grid_thw=(1, 2, 8), datatype="FP32", shape=(4, 4), data=data, digest="d")
    (hit,) = decode_stream(list(embedding_frames(**kw, cached=True)), 1)
    (miss,) = decode_stream(list(embedding_frames(**kw, batch=BatchInfo(0.5, (16,)), queue_seconds=0.1)), 1)
    assert hit.cached and hit.batch is None and hit.queue_seconds == 0.0 and bytes(hit.data) == data
    assert not miss.cached and miss.batch == BatchInfo(0.5, (16,))


def test_encoder_description_reads_the_cache_budget():
    from encdis.client.encoder_client import EncoderDescription

    assert EncoderDescription.from_proto(encoder_pb2.DescribeResponse(cache_bytes=12345)).cache_bytes == 12345
    assert EncoderDescription.from_proto(encoder_pb2.DescribeResponse()).cache_bytes == 0
