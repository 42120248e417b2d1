"""Tensor wire codec: one image's embedding as a header plus raw byte chunks.

The format follows the Open Inference Protocol's tensor representation: a `datatype`
string (BF16, FP16, FP32), a shape, and raw little-endian row-major bytes. Chunks are
at most a configurable size (default 4 MiB) so no gRPC message limit is ever hit.
Nothing here unpickles: the receiver only reinterprets bytes whose size it checked.

Sending: `embedding_frames` (serialised messages, chunk 0 inside the header's, one copy of the bytes, for a server
whose Encode serializer passes bytes through: `serialize_response`) or `embedding_messages`
(protobuf objects). Receiving: `StreamDecoder` trusts nothing beyond what was announced. Given
what the caller expects of each image (`ExpectedEmbedding`: rows, hidden size, datatype,
patches), a header that disagrees is refused before any buffer exists; otherwise the buffer
is sized from the header (and a caller's maximum), allocated uncommitted, and each chunk is
checked against it before it is copied into place. `accept` hands back the copy so an asyncio
caller can run it off the event loop (the copy releases the GIL).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from encdis.client.chunk_frames import chunk_frame, header_frame, parse_chunk_frame, parse_header_frame
from encdis.client.embedding import (
    DATATYPES,
    TOWER_IMPLS,
    AcceptedBacklog,
    BatchInfo,
    Datatype,
    Embedding,
    datatype,
    datatype_of_torch,
    decode_array,
    embedding_of,
    itemsize,
    set_accepted_backlog,
)
from encdis.client.errors import WireError
from encdis.client.pb import encoder_pb2
from encdis.client.receive_buffer import Allocate, ChunkCopy, ReceiveBuffer

# The embedding types are part of this module's interface (encdis.client.embedding holds them).
__all__ = [
    "DATATYPES", "DEFAULT_MAX_CHUNK_BYTES", "AcceptedBacklog", "BatchInfo", "ChunkCopy", "Datatype", "Embedding",
    "EmbeddingAssembler", "ExpectedEmbedding", "StreamDecoder", "check_header", "chunk_bytes", "content_digest",
    "datatype", "datatype_of_torch", "decode_array", "decode_stream", "embedding_frames", "embedding_messages",
    "embedding_of", "itemsize", "serialize_response", "set_accepted_backlog", "TOWER_IMPLS"]

DEFAULT_MAX_CHUNK_BYTES = 4 * 1024 * 1024


def content_digest(image: bytes, min_pixels: int, max_pixels: int, weights_fingerprint: str,
                   image_loader: str = "vllm", datatype: str = "FP32", tower_impl: str = "transformers") -> str:
    """Key of an embedding: the image bytes, the resize bounds, the image loader, the tower's
    weights, the embedding's datatype (a BF16 tower gives other numbers than an FP32 one) and
    the tower's implementation (vLLM's and transformers' round differently in bf16).

    Both the encoder node and the coordinator compute it, so a cached embedding is only
    reused when all of them match. It is also vLLM's multimodal uuid for the image.
    """
    if datatype not in DATATYPES:
        raise ValueError(f"unknown embedding datatype {datatype!r} (one of {', '.join(DATATYPES)})")
    h = hashlib.sha256()
    if tower_impl not in TOWER_IMPLS:
        raise ValueError(f"unknown tower implementation {tower_impl!r} (one of {', '.join(TOWER_IMPLS)})")
    h.update(f"encdis-v4|{int(min_pixels)}|{int(max_pixels)}|{image_loader}|{datatype}|{tower_impl}|"
             f"{weights_fingerprint}|".encode())
    h.update(image)
    return h.hexdigest()


def chunk_bytes(data: bytes | memoryview, max_chunk_bytes: int) -> Iterator[memoryview]:
    """Split into consecutive views of at most `max_chunk_bytes` (at least one, even if empty)."""
    if max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
    view = memoryview(data).cast("B")
    if len(view) == 0:
        yield view
        return
    for start in range(0, len(view), max_chunk_bytes):
        yield view[start : start + max_chunk_bytes]


def _embedding_header(*, image_index: int, grid_thw: tuple[int, int, int], datatype: str, shape: tuple[int, int],
                      data: bytes | memoryview, digest: str, max_chunk_bytes: int, batch: BatchInfo | None,
                      queue_seconds: float, preprocess_seconds: float = 0.0,
                      accepted_backlog: AcceptedBacklog | None = None, cached: bool = False,
                      ) -> tuple[encoder_pb2.EmbeddingHeader, list[memoryview]]:
    """The header of one image's embedding and the views its chunks carry (no bytes copied)."""
    expected = shape[0] * shape[1] * itemsize(datatype)
    view = memoryview(data).cast("B")
    if len(view) != expected:
        raise ValueError(f"data has {len(view)} bytes, shape {shape} needs {expected}")
    chunks = list(chunk_bytes(view, max_chunk_bytes))
    header = encoder_pb2.EmbeddingHeader(
        image_index=image_index,
        grid_thw=list(grid_thw),
        num_tokens=shape[0],
        hidden_size=shape[1],
        datatype=datatype,
        digest=digest,
        total_bytes=expected,
        num_chunks=len(chunks),
        queue_seconds=queue_seconds,
        preprocess_seconds=preprocess_seconds,
        cached=cached,
    )
    if batch is not None:
        header.batch.seconds = batch.seconds
        header.batch.image_patches.extend(batch.image_patches)
    set_accepted_backlog(header, accepted_backlog)
    return header, chunks


def embedding_messages(
    *,
    image_index: int,
    grid_thw: tuple[int, int, int],
    datatype: str,
    shape: tuple[int, int],
    data: bytes | memoryview,
    digest: str,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    batch: BatchInfo | None = None,
    queue_seconds: float = 0.0,
    preprocess_seconds: float = 0.0,
    accepted_backlog: AcceptedBacklog | None = None,
) -> Iterator[encoder_pb2.EncodeResponse]:
    """The header, then the chunks, of one image's embedding, as protobuf messages."""
    header, chunks = _embedding_header(image_index=image_index, grid_thw=grid_thw, datatype=datatype, shape=shape,
                                       data=data, digest=digest, max_chunk_bytes=max_chunk_bytes, batch=batch,
                                       queue_seconds=queue_seconds, preprocess_seconds=preprocess_seconds,
                                       accepted_backlog=accepted_backlog)
    yield encoder_pb2.EncodeResponse(header=header)
    for i, c in enumerate(chunks):
        yield encoder_pb2.EncodeResponse(
            chunk=encoder_pb2.EmbeddingChunk(image_index=image_index, chunk_index=i, data=bytes(c))
        )


def embedding_frames(
    *,
    image_index: int,
    grid_thw: tuple[int, int, int],
    datatype: str,
    shape: tuple[int, int],
    data: bytes | memoryview,
    digest: str,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    batch: BatchInfo | None = None,
    queue_seconds: float = 0.0,
    preprocess_seconds: float = 0.0,
    accepted_backlog: AcceptedBacklog | None = None, cached: bool = False,  # cached: no forward ran
) -> Iterator[bytes]:
    """The embedding as serialised messages, chunk 0 in the header's; each chunk is one copy of its bytes.

    For a server whose Encode response serializer is `serialize_response`. Each chunk's bytes
    are read when its frame is made, so `data` must not change until the last one is sent.
    """
    header, chunks = _embedding_header(image_index=image_index, grid_thw=grid_thw, datatype=datatype, shape=shape,
                                       data=data, digest=digest, max_chunk_bytes=max_chunk_bytes, batch=batch,
                                       queue_seconds=queue_seconds, preprocess_seconds=preprocess_seconds,
                                       accepted_backlog=accepted_backlog, cached=cached)
    yield header_frame(encoder_pb2.EncodeResponse(header=header).SerializeToString(), image_index, chunks[0])
    for i in range(1, len(chunks)):
        yield chunk_frame(image_index, i, chunks[i])


def serialize_response(msg: encoder_pb2.EncodeResponse | bytes) -> bytes:
    """Encode's response serializer: a frame from `embedding_frames` as it is, a message serialised."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


@dataclass(frozen=True)
class ExpectedEmbedding:
    """What a receiver knows about one image before its header arrives; a header that disagrees is refused.

    The coordinator knows every image's grid from its file header (smart_resize), so its rows
    are t*h*w / merge_size**2; hidden size and datatype come from the model and the encoder.
    """

    num_tokens: int
    hidden_size: int
    datatype: str = ""  # "" accepts any wire datatype
    patches: int = 0  # t*h*w of grid_thw; 0 leaves the grid unchecked

    @classmethod
    def for_patches(cls, patches: int, *, merge_size: int, hidden_size: int, datatype: str = "") -> ExpectedEmbedding:
        return cls(num_tokens=patches // merge_size**2, hidden_size=hidden_size, datatype=datatype, patches=patches)

    def disagreement(self, header: encoder_pb2.EmbeddingHeader) -> str | None:
        """What in `header` differs from this expectation, or None."""
        if header.num_tokens != self.num_tokens or header.hidden_size != self.hidden_size:
            return (f"announced {header.num_tokens}x{header.hidden_size} rows x hidden, "
                    f"expected {self.num_tokens}x{self.hidden_size}")
        if self.datatype and header.datatype != self.datatype:
            return f"announced datatype {header.datatype!r}, expected {self.datatype!r}"
        t, h, w = header.grid_thw
        if self.patches and t * h * w != self.patches:
            return f"announced grid_thw {list(header.grid_thw)} ({t * h * w} patches), expected {self.patches} patches"
        return None


class EmbeddingAssembler:
    """Rebuilds one image's embedding in a buffer sized from its checked header, chunk by chunk."""

    def __init__(self, header: encoder_pb2.EmbeddingHeader, *, max_total_bytes: int | None = None,
                 expected: ExpectedEmbedding | None = None, allocate: Allocate | None = None) -> None:
        i = header.image_index
        total = check_header(header, max_total_bytes=max_total_bytes, expected=expected)
        if header.num_chunks == 0 or header.num_chunks > total:
            raise WireError(f"image {i}: num_chunks {header.num_chunks} for {total} bytes "
                            "(every chunk carries at least one byte)")
        self.header = header
        self._started = time.perf_counter()
        try:
            self._buf = ReceiveBuffer(total, allocate)
        except MemoryError:
            raise WireError(f"image {i}: cannot allocate the announced {total} bytes") from None
        self._filled = 0
        self._next_chunk = 0

    def place(self, image_index: int, chunk_index: int, data: bytes | memoryview) -> ChunkCopy:
        """Check the next chunk against the header; the copy that puts it in place (not run yet)."""
        h = self.header
        if image_index != h.image_index:
            raise WireError(f"chunk for image {image_index} while image {h.image_index} is open")
        if chunk_index != self._next_chunk:
            raise WireError(f"image {h.image_index}: chunk {chunk_index} out of order (expected {self._next_chunk})")
        if self._next_chunk >= h.num_chunks:
            raise WireError(f"image {h.image_index}: more than the announced {h.num_chunks} chunks")
        n = len(data)
        if n == 0:
            raise WireError(f"image {h.image_index}: chunk {chunk_index} is empty")
        if self._filled + n > h.total_bytes:
            raise WireError(f"image {h.image_index}: chunks exceed the announced {h.total_bytes} bytes")
        if self._next_chunk + 1 == h.num_chunks and self._filled + n != h.total_bytes:
            raise WireError(f"image {h.image_index}: got {self._filled + n} bytes in the announced "
                            f"{h.num_chunks} chunks, announced {h.total_bytes}")
        copy = ChunkCopy(self._buf, self._filled, data)
        self._filled += n
        self._next_chunk += 1
        return copy

    @property
    def complete(self) -> bool:
        return self._next_chunk == self.header.num_chunks

    def finish(self) -> Embedding:
        """The embedding over the buffer; every chunk's copy must have run."""
        h = self.header
        if not self.complete:
            raise WireError(f"image {h.image_index}: got {self._next_chunk} of {h.num_chunks} chunks")
        return embedding_of(h, memoryview(self._buf.array()), time.perf_counter() - self._started)


def check_header(header: encoder_pb2.EmbeddingHeader, *, max_total_bytes: int | None = None,
                 expected: ExpectedEmbedding | None = None) -> int:
    """The embedding's size in bytes, once `header` is consistent, within `max_total_bytes` and
    as `expected`; WireError naming the image otherwise. Nothing is allocated before this passes."""
    i = header.image_index
    if len(header.grid_thw) != 3 or any(v <= 0 for v in header.grid_thw):
        raise WireError(f"image {i}: grid_thw must be 3 positive ints, got {list(header.grid_thw)}")
    size = itemsize(header.datatype)
    if header.num_tokens == 0 or header.hidden_size == 0:
        raise WireError(f"image {i}: empty embedding shape")
    if expected is not None and (why := expected.disagreement(header)) is not None:
        raise WireError(f"image {i}: the encoder {why}")
    total = header.num_tokens * header.hidden_size * size
    if header.total_bytes != total:
        raise WireError(
            f"image {i}: total_bytes {header.total_bytes} does not match "
            f"{header.num_tokens}x{header.hidden_size} {header.datatype} ({total} bytes)"
        )
    if max_total_bytes is not None and total > max_total_bytes:
        raise WireError(f"image {i}: {total} bytes exceeds the limit {max_total_bytes}")
    return total


class StreamDecoder:
    """Consumes an Encode reply stream message by message; yields each image when whole.

    Images must arrive in index order 0..num_images-1, each as a header followed by all
    its chunks; anything else (interleaving, gaps, duplicates, a short stream, a header that
    disagrees with `expected` or exceeds `max_total_bytes`) is a WireError. Messages are
    EncodeResponse objects or their serialised bytes (chunks are then read in place).

    `feed` per message copies inline and returns each finished image; `accept` checks a
    message and returns the copy to run, then, once `image_complete`, `take` gives the image
    (after its copies ran). `close` at the end of the stream.
    """

    def __init__(self, num_images: int, *, max_total_bytes: int | None = None,
                 expected: Sequence[ExpectedEmbedding] | None = None, allocate: Allocate | None = None) -> None:
        if expected is not None and len(expected) != num_images:
            raise ValueError(f"{len(expected)} expectations for {num_images} images")
        self.num_images = num_images
        self.allocate = allocate  # each image's receive buffer, by size (None: the heap)
        self.max_total_bytes = max_total_bytes
        self.expected = expected
        self._open: EmbeddingAssembler | None = None
        self._done = 0

    def accept(self, msg: encoder_pb2.EncodeResponse | bytes) -> ChunkCopy | None:
        """Check one message; for a chunk, the copy that puts its bytes in place."""
        if self.image_complete:
            raise RuntimeError("take() the finished image before feeding more messages")
        if isinstance(msg, bytes):
            view = parse_chunk_frame(msg)
            if view is not None:
                return self._chunk(view.image_index, view.chunk_index, view.data)
            head = parse_header_frame(msg)
            if head is not None:
                self._open_image(_parse(encoder_pb2.EmbeddingHeader, head.header))
                first = head.first_chunk
                return None if first is None else self._chunk(first.image_index, first.chunk_index, first.data)
            msg = _parse(encoder_pb2.EncodeResponse, msg)
        kind = msg.WhichOneof("kind")
        if kind != "header" and msg.HasField("first_chunk"):
            raise WireError("first_chunk in a message without a header")
        if kind == "header":
            self._open_image(msg.header)
            if msg.HasField("first_chunk"):
                c = msg.first_chunk
                return self._chunk(c.image_index, c.chunk_index, c.data)
            return None
        if kind == "chunk":
            return self._chunk(msg.chunk.image_index, msg.chunk.chunk_index, msg.chunk.data)
        raise WireError("empty EncodeResponse message")

    def _open_image(self, header: encoder_pb2.EmbeddingHeader) -> None:
        if self._open is not None:
            raise WireError(f"header for image {header.image_index} before image "
                            f"{self._open.header.image_index} was complete")
        if header.image_index != self._done:
            raise WireError(f"header for image {header.image_index}, expected image {self._done}")
        if self._done >= self.num_images:
            raise WireError(f"more images than the {self.num_images} requested")
        expected = self.expected[self._done] if self.expected is not None else None
        self._open = EmbeddingAssembler(header, max_total_bytes=self.max_total_bytes, expected=expected,
                                        allocate=self.allocate)

    def _chunk(self, image_index: int, chunk_index: int, data: bytes | memoryview) -> ChunkCopy:
        if self._open is None:
            raise WireError(f"chunk for image {image_index} before its header")
        return self._open.place(image_index, chunk_index, data)

    @property
    def image_complete(self) -> bool:
        """Every chunk of the open image is accepted: `take` it once their copies ran."""
        return self._open is not None and self._open.complete

    @property
    def all_taken(self) -> bool:
        """Every image the call asked for is taken: what follows is only the stream's end."""
        return self._done == self.num_images

    def take(self) -> Embedding:
        if self._open is None or not self._open.complete:
            raise RuntimeError("no finished image to take")
        emb = self._open.finish()
        self._open = None
        self._done += 1
        return emb

    def feed(self, msg: encoder_pb2.EncodeResponse | bytes) -> Embedding | None:
        copy = self.accept(msg)
        if copy is not None:
            copy.run()
        return self.take() if self.image_complete else None

    def close(self) -> None:
        if self._open is not None:
            raise WireError(f"stream ended inside image {self._open.header.image_index}")
        if self._done != self.num_images:
            raise WireError(f"stream ended after {self._done} of {self.num_images} images")


def _parse(message_type, raw: bytes | memoryview):
    try:
        return message_type.FromString(bytes(raw))
    except DecodeError as e:
        raise WireError(f"undecodable {message_type.__name__} message ({len(raw)} bytes): {e}") from None


def decode_stream(messages: Iterable[encoder_pb2.EncodeResponse | bytes], num_images: int, *,
                  max_total_bytes: int | None = None,
                  expected: Sequence[ExpectedEmbedding] | None = None) -> list[Embedding]:
    """All embeddings of a finished reply stream, in image order."""
    dec = StreamDecoder(num_images, max_total_bytes=max_total_bytes, expected=expected)
    out = [e for e in (dec.feed(m) for m in messages) if e is not None]
    dec.close()
    return out
