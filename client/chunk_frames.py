"""EncodeResponse chunk messages written and read by hand, so embedding bytes are not copied on the way.

The protobuf runtime copies a bytes field at every step: building the message, serialising it,
parsing it and reading the field each make a copy of the data. An EncodeResponse{chunk} is a
few bytes of framing around that data, so the sender writes the framing itself and joins it
to a view of the tensor (one copy, into the message gRPC sends), and the receiver finds the
data inside the received message and takes a view of it (no copy).

An image's first chunk rides in its header's message (EncodeResponse.first_chunk), which
saves one message per image. The frames are exactly what protobuf would write (fields in
number order, zero values left out), and a received message the fast parser does not
recognise (other field order, unknown fields, out-of-range values) is left to the protobuf
runtime, so every valid message reads the same either way.
"""

from __future__ import annotations

from typing import NamedTuple

# EncodeResponse's header, chunk and first_chunk are fields 1, 2 and 3; EmbeddingChunk's are 1, 2
# (varints) and 3 (bytes): tag = field number << 3 | wire type (0 varint, 2 length-delimited).
RESPONSE_HEADER_TAG = 0x0A
RESPONSE_CHUNK_TAG = 0x12
RESPONSE_FIRST_CHUNK_TAG = 0x1A
_IMAGE_INDEX_TAG = 0x08
_CHUNK_INDEX_TAG = 0x10
_DATA_TAG = 0x1A
_UINT32_MAX = 0xFFFFFFFF


class ChunkView(NamedTuple):
    """One received chunk: its indices and a view of its bytes inside the received message."""

    image_index: int
    chunk_index: int
    data: memoryview


class HeaderView(NamedTuple):
    """A received header message: the serialised EmbeddingHeader, and the first chunk if it came along."""

    header: memoryview
    first_chunk: ChunkView | None


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _chunk_prefix(tag: int, image_index: int, chunk_index: int, n: int) -> bytes:
    """Everything of field `tag` = EmbeddingChunk(image_index, chunk_index, data) before data's n bytes."""
    inner = b""
    if image_index:
        inner += bytes((_IMAGE_INDEX_TAG,)) + varint(image_index)
    if chunk_index:
        inner += bytes((_CHUNK_INDEX_TAG,)) + varint(chunk_index)
    if n:
        inner += bytes((_DATA_TAG,)) + varint(n)
    return bytes((tag,)) + varint(len(inner) + n) + inner


def chunk_frame(image_index: int, chunk_index: int, data: memoryview) -> bytes:
    """The serialised EncodeResponse{chunk: EmbeddingChunk(image_index, chunk_index, data)}."""
    return b"".join((_chunk_prefix(RESPONSE_CHUNK_TAG, image_index, chunk_index, len(data)), data))


def header_frame(header_message: bytes, image_index: int, first_chunk: memoryview) -> bytes:
    """`header_message` (a serialised EncodeResponse{header}) with chunk 0 as its first_chunk."""
    prefix = _chunk_prefix(RESPONSE_FIRST_CHUNK_TAG, image_index, 0, len(first_chunk))
    return b"".join((header_message, prefix, first_chunk))


# Protobuf reads a varint of at most 10 bytes, and a length prefix of at most 5 (a length is
# below 2**31): a longer one, however small its value, makes the whole message malformed.
_VARINT_MAX_BYTES = 10
_LENGTH_MAX_BYTES = 5


def _read_varint(buf: memoryview, pos: int, end: int,
                 max_bytes: int = _VARINT_MAX_BYTES) -> tuple[int, int] | None:
    """(value, position after it) of the varint at `pos`, or None if it is cut or too long."""
    value = shift = 0
    while pos < end and shift < 7 * max_bytes:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    return None


def _field(buf: memoryview, pos: int, end: int, tag: int) -> tuple[int, int] | None:
    """(start, end) of the length-delimited field `tag` at `pos`, or None."""
    if pos >= end or buf[pos] != tag:
        return None
    r = _read_varint(buf, pos + 1, end, _LENGTH_MAX_BYTES)
    if r is None or r[1] + r[0] > end:
        return None
    return r[1], r[1] + r[0]


def parse_chunk_frame(raw: bytes) -> ChunkView | None:
    """The chunk in a serialised EncodeResponse{chunk}, or None when it is anything else (or not plain)."""
    buf = memoryview(raw)
    field = _field(buf, 0, len(buf), RESPONSE_CHUNK_TAG)
    if field is None or field[1] != len(buf):
        return None  # more than one field at the top level: let protobuf merge them
    return _chunk_fields(buf, *field)


def parse_header_frame(raw: bytes) -> HeaderView | None:
    """The header (and first chunk) in a serialised EncodeResponse{header[, first_chunk]}, or None."""
    buf = memoryview(raw)
    end = len(buf)
    header = _field(buf, 0, end, RESPONSE_HEADER_TAG)
    if header is None:
        return None
    if header[1] == end:
        return HeaderView(buf[header[0]:header[1]], None)
    first = _field(buf, header[1], end, RESPONSE_FIRST_CHUNK_TAG)
    if first is None or first[1] != end:
        return None
    chunk = _chunk_fields(buf, *first)
    return None if chunk is None else HeaderView(buf[header[0]:header[1]], chunk)


def _chunk_fields(buf: memoryview, pos: int, end: int) -> ChunkView | None:
    """An EmbeddingChunk's fields in buf[pos:end] (last one wins, as in protobuf), or None."""
    image_index = chunk_index = 0
    data = buf[0:0]
    while pos < end:
        tag = buf[pos]
        r = _read_varint(buf, pos + 1, end, _LENGTH_MAX_BYTES if tag == _DATA_TAG else _VARINT_MAX_BYTES)
        if r is None:
            return None
        value, pos = r
        if tag == _DATA_TAG:
            if pos + value > end:
                return None
            data = buf[pos:pos + value]
            pos += value
        elif tag in (_IMAGE_INDEX_TAG, _CHUNK_INDEX_TAG) and value <= _UINT32_MAX:
            if tag == _IMAGE_INDEX_TAG:
                image_index = value
            else:
                chunk_index = value
        else:
            return None
    return ChunkView(image_index, chunk_index, data)
