"""The hand parser of chunk frames against protobuf's own parse, on raw bytes.

`parse_chunk_frame` and `parse_header_frame` may decline any message (None: protobuf reads
it instead), but whatever they do return must be exactly what protobuf reads from the same
bytes, and they must never accept bytes protobuf refuses (the header's own body is left to
protobuf: where protobuf refuses the message for it, it refuses that body too). Inputs are built field by field from
wire-level pieces (tags, varints of any length including non-canonical ones, unknown fields,
repeated and reordered fields, truncations), so the fuzz reaches the corners protobuf's own
serialiser never writes.
"""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from encdis.client.chunk_frames import parse_chunk_frame, parse_header_frame
from encdis.client.pb import encoder_pb2


def padded_varint(n: int, pad: int) -> bytes:
    """n as a base-128 varint with `pad` redundant continuation bytes (non-canonical if pad > 0)."""
    groups = []
    while True:
        groups.append(n & 0x7F)
        n >>= 7
        if not n:
            break
    groups += [0] * pad
    return bytes(g | 0x80 for g in groups[:-1]) + bytes((groups[-1],))


varints = st.builds(padded_varint,
                    st.one_of(st.integers(0, 300), st.integers(0, 2**32 + 5), st.integers(0, 2**64 - 1)),
                    st.integers(0, 6))


def tag(field: int, wire_type: int, pad: int = 0) -> bytes:
    return padded_varint(field << 3 | wire_type, pad)


@st.composite
def chunk_fields(draw) -> bytes:
    """An EmbeddingChunk's body: its three fields in any order and number, maybe unknown ones."""
    out = b""
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["image_index", "chunk_index", "data", "unknown_varint",
                                     "unknown_bytes", "odd_tag"]))
        pad = draw(st.sampled_from([0, 0, 0, 1]))
        if kind in ("image_index", "chunk_index"):
            out += tag(1 if kind == "image_index" else 2, 0, pad) + draw(varints)
        elif kind == "data":
            data = draw(st.binary(max_size=12))
            out += tag(3, 2, pad) + padded_varint(len(data), draw(st.integers(0, 6))) + data
        elif kind == "unknown_varint":
            out += tag(draw(st.integers(4, 40)), 0) + draw(varints)
        elif kind == "unknown_bytes":
            data = draw(st.binary(max_size=6))
            out += tag(draw(st.integers(4, 40)), 2) + padded_varint(len(data), 0) + data
        else:  # a known field number with the wrong wire type
            out += tag(draw(st.integers(1, 3)), draw(st.sampled_from([1, 5]))) + draw(st.binary(min_size=4,
                                                                                                max_size=8))
    return out


def header_body() -> st.SearchStrategy[bytes]:
    return st.builds(lambda i, rows: encoder_pb2.EmbeddingHeader(image_index=i, num_tokens=rows,
                                                                 datatype="BF16").SerializeToString(),
                     st.integers(0, 5), st.integers(0, 100))


@st.composite
def responses(draw) -> bytes:
    """A serialised EncodeResponse as raw bytes: header, chunk, first_chunk, unknown fields."""
    out = b""
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from([1, 2, 3, 3, 2, 9]))
        body = draw(header_body()) if field == 1 else draw(chunk_fields())
        out += tag(field, 2, draw(st.sampled_from([0, 0, 0, 1]))) + padded_varint(
            len(body), draw(st.sampled_from([0, 0, 1, 4, 5]))) + body
    cut = draw(st.sampled_from([None, None, None, 1, 2]))
    return out[:-cut] if cut and len(out) > cut else out


def protobuf_parse(raw: bytes) -> encoder_pb2.EncodeResponse | None:
    msg = encoder_pb2.EncodeResponse()
    try:
        msg.ParseFromString(raw)
    except DecodeError:
        return None
    return msg


def same_chunk(view, chunk: encoder_pb2.EmbeddingChunk) -> bool:
    return (view.image_index, view.chunk_index, bytes(view.data)) == (chunk.image_index, chunk.chunk_index,
                                                                     chunk.data)


FUZZ = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(responses())
# A length written as a 6-byte varint: protobuf allows at most 5 bytes for a length.
@example(b"\x12\x85\x80\x80\x80\x80\x00\x1a\x03abc")
@example(b"\x1a\x02\x10\x01")  # first_chunk without a header
@example(b"\x12\x02\x08\x01\x12\x02\x10\x02")  # two chunk fields, which protobuf merges
@example(b"\n\t" + bytes(9))  # a header whose body protobuf refuses (field number 0)
def test_the_fast_parsers_agree_with_protobuf_on_every_input(raw: bytes) -> None:
    parsed = protobuf_parse(raw)
    view = parse_chunk_frame(raw)
    if view is not None:
        assert parsed is not None, "the fast parser accepted bytes protobuf refuses"
        assert parsed.WhichOneof("kind") == "chunk" and not parsed.HasField("first_chunk")
        assert same_chunk(view, parsed.chunk)
    head = parse_header_frame(raw)
    if head is not None:
        if parsed is None:
            # The header's own bytes are left to protobuf (the receiver parses them next): then
            # they are what protobuf refused, and the receiver refuses them too.
            with pytest.raises(DecodeError):
                encoder_pb2.EmbeddingHeader.FromString(bytes(head.header))
            return
        assert parsed.WhichOneof("kind") == "header"
        assert encoder_pb2.EmbeddingHeader.FromString(bytes(head.header)) == parsed.header
        if head.first_chunk is None:
            assert not parsed.HasField("first_chunk")
        else:
            assert same_chunk(head.first_chunk, parsed.first_chunk)


@FUZZ
@given(st.binary(max_size=40))
def test_the_fast_parsers_never_accept_random_bytes_protobuf_refuses_or_reads_otherwise(raw: bytes) -> None:
    test_the_fast_parsers_agree_with_protobuf_on_every_input.hypothesis.inner_test(raw)
