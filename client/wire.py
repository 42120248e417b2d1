"""Tensor wire codec: one image's embedding as a header plus raw byte chunks.

The format follows the Open Inference Protocol's tensor representation: a `datatype`
string (BF16, FP16, FP32), a shape, and raw little-endian row-major bytes. Chunks are
at most a configurable size (default 4 MiB) so no gRPC message limit is ever hit.
Nothing here unpickles: the receiver only reinterprets bytes whose size it checked.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from encdis.client.errors import WireError
from encdis.client.pb import encoder_pb2

DEFAULT_MAX_CHUNK_BYTES = 4 * 1024 * 1024



@dataclass(frozen=True)
class Datatype:
    """One wire datatype and its names elsewhere: the one table of embedding dtypes."""

    name: str  # on the wire (Open Inference Protocol)
    itemsize: int
    torch: str  # attribute of the torch module
    safetensors: str


DATATYPES = {d.name: d for d in (
    Datatype("FP32", 4, "float32", "F32"),
    Datatype("FP16", 2, "float16", "F16"),
    Datatype("BF16", 2, "bfloat16", "BF16"),
)}


def datatype_of_torch(torch_name: str) -> str:
    """The wire datatype of a torch dtype name ("bfloat16" -> "BF16")."""
    for d in DATATYPES.values():
        if d.torch == torch_name:
            return d.name
    raise ValueError(f"no wire datatype for torch dtype {torch_name!r}")


@dataclass(frozen=True)
class BatchInfo:
    """The forward pass that produced an embedding: its wall time and every image's patches."""

    seconds: float
    image_patches: tuple[int, ...]


@dataclass(frozen=True)
class Embedding:
    """One image's vision-tower output as received: raw bytes plus what they mean."""

    image_index: int
    grid_thw: tuple[int, int, int]
    datatype: str
    shape: tuple[int, int]  # (num_tokens, hidden_size)
    data: bytes
    digest: str
    batch: BatchInfo | None = None
    queue_seconds: float = 0.0
    # Measured by the receiver: from its header's arrival to its last chunk's.
    receive_seconds: float = 0.0

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def array(self) -> np.ndarray:
        """The embedding as numpy: FP32/FP16 as sent, BF16 widened exactly to float32."""
        return decode_array(self.datatype, self.shape, self.data)


def decode_array(datatype: str, shape: tuple[int, ...], data: bytes) -> np.ndarray:
    """Reinterpret raw little-endian bytes; BF16 (absent from numpy) becomes float32 exactly."""
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize(datatype)
    if len(data) != expected:
        raise WireError(f"{datatype} tensor of shape {list(shape)} needs {expected} bytes, got {len(data)}")
    if datatype == "FP32":
        return np.frombuffer(data, dtype="<f4").reshape(shape)
    if datatype == "FP16":
        return np.frombuffer(data, dtype="<f2").reshape(shape)
    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)


def datatype(name: str) -> Datatype:
    try:
        return DATATYPES[name]
    except KeyError:
        raise WireError(f"unknown datatype {name!r}; expected one of {sorted(DATATYPES)}") from None


def itemsize(name: str) -> int:
    return datatype(name).itemsize


def content_digest(image: bytes, min_pixels: int, max_pixels: int, weights_fingerprint: str,
                   image_loader: str = "vllm") -> str:
    """Key of an embedding: the image bytes, the resize bounds, the image loader and the tower's weights.

    Both the encoder node and the coordinator compute it, so a cached embedding is only
    reused when all of them match. It is also vLLM's multimodal uuid for the image.
    """
    h = hashlib.sha256()
    h.update(f"encdis-v2|{int(min_pixels)}|{int(max_pixels)}|{image_loader}|{weights_fingerprint}|".encode())
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
) -> Iterator[encoder_pb2.EncodeResponse]:
    """The header, then the chunks, of one image's embedding."""
    expected = shape[0] * shape[1] * itemsize(datatype)
    if len(memoryview(data).cast("B")) != expected:
        raise ValueError(f"data has {len(memoryview(data).cast('B'))} bytes, shape {shape} needs {expected}")
    chunks = list(chunk_bytes(data, max_chunk_bytes))
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
    )
    if batch is not None:
        header.batch.seconds = batch.seconds
        header.batch.image_patches.extend(batch.image_patches)
    yield encoder_pb2.EncodeResponse(header=header)
    for i, c in enumerate(chunks):
        yield encoder_pb2.EncodeResponse(
            chunk=encoder_pb2.EmbeddingChunk(image_index=image_index, chunk_index=i, data=bytes(c))
        )


class EmbeddingAssembler:
    """Rebuilds one image's embedding from its header and chunks, checking every step."""

    def __init__(self, header: encoder_pb2.EmbeddingHeader, *, max_total_bytes: int | None = None) -> None:
        if len(header.grid_thw) != 3 or any(v <= 0 for v in header.grid_thw):
            raise WireError(
                f"image {header.image_index}: grid_thw must be 3 positive ints, got {list(header.grid_thw)}"
            )
        size = itemsize(header.datatype)
        expected = header.num_tokens * header.hidden_size * size
        if header.num_tokens == 0 or header.hidden_size == 0:
            raise WireError(f"image {header.image_index}: empty embedding shape")
        if header.total_bytes != expected:
            raise WireError(
                f"image {header.image_index}: total_bytes {header.total_bytes} does not match "
                f"{header.num_tokens}x{header.hidden_size} {header.datatype} ({expected} bytes)"
            )
        if max_total_bytes is not None and expected > max_total_bytes:
            raise WireError(f"image {header.image_index}: {expected} bytes exceeds the limit {max_total_bytes}")
        if header.num_chunks == 0:
            raise WireError(f"image {header.image_index}: num_chunks is 0")
        self.header = header
        self._started = time.perf_counter()
        self._buf = bytearray()
        self._next_chunk = 0

    def add(self, chunk: encoder_pb2.EmbeddingChunk) -> None:
        h = self.header
        if chunk.image_index != h.image_index:
            raise WireError(f"chunk for image {chunk.image_index} while image {h.image_index} is open")
        if chunk.chunk_index != self._next_chunk:
            raise WireError(
                f"image {h.image_index}: chunk {chunk.chunk_index} out of order (expected {self._next_chunk})"
            )
        if self._next_chunk >= h.num_chunks:
            raise WireError(f"image {h.image_index}: more than the announced {h.num_chunks} chunks")
        if len(self._buf) + len(chunk.data) > h.total_bytes:
            raise WireError(f"image {h.image_index}: chunks exceed the announced {h.total_bytes} bytes")
        self._buf += chunk.data
        self._next_chunk += 1

    @property
    def complete(self) -> bool:
        return self._next_chunk == self.header.num_chunks

    def finish(self) -> Embedding:
        h = self.header
        if not self.complete:
            raise WireError(f"image {h.image_index}: got {self._next_chunk} of {h.num_chunks} chunks")
        if len(self._buf) != h.total_bytes:
            raise WireError(f"image {h.image_index}: got {len(self._buf)} bytes, announced {h.total_bytes}")
        batch = None
        if h.HasField("batch"):
            batch = BatchInfo(seconds=h.batch.seconds, image_patches=tuple(h.batch.image_patches))
        t, hh, w = h.grid_thw
        return Embedding(
            image_index=h.image_index,
            grid_thw=(int(t), int(hh), int(w)),
            datatype=h.datatype,
            shape=(h.num_tokens, h.hidden_size),
            data=bytes(self._buf),
            digest=h.digest,
            batch=batch,
            queue_seconds=h.queue_seconds,
            receive_seconds=time.perf_counter() - self._started,
        )


class StreamDecoder:
    """Consumes an Encode reply stream message by message; yields each image when whole.

    Images must arrive in index order 0..num_images-1, each as a header followed by all
    its chunks; anything else (interleaving, gaps, duplicates, a short stream) is a
    WireError. Use `feed` per message and `close` at the end of the stream.
    """

    def __init__(self, num_images: int, *, max_total_bytes: int | None = None) -> None:
        self.num_images = num_images
        self.max_total_bytes = max_total_bytes
        self._open: EmbeddingAssembler | None = None
        self._done = 0

    def feed(self, msg: encoder_pb2.EncodeResponse) -> Embedding | None:
        kind = msg.WhichOneof("kind")
        if kind == "header":
            if self._open is not None:
                raise WireError(f"header for image {msg.header.image_index} before image "
                                f"{self._open.header.image_index} was complete")
            if msg.header.image_index != self._done:
                raise WireError(f"header for image {msg.header.image_index}, expected image {self._done}")
            if self._done >= self.num_images:
                raise WireError(f"more images than the {self.num_images} requested")
            self._open = EmbeddingAssembler(msg.header, max_total_bytes=self.max_total_bytes)
        elif kind == "chunk":
            if self._open is None:
                raise WireError(f"chunk for image {msg.chunk.image_index} before its header")
            self._open.add(msg.chunk)
        else:
            raise WireError("empty EncodeResponse message")
        if self._open is not None and self._open.complete:
            emb = self._open.finish()
            self._open = None
            self._done += 1
            return emb
        return None

    def close(self) -> None:
        if self._open is not None:
            raise WireError(f"stream ended inside image {self._open.header.image_index}")
        if self._done != self.num_images:
            raise WireError(f"stream ended after {self._done} of {self.num_images} images")


def decode_stream(messages: Iterable[encoder_pb2.EncodeResponse], num_images: int) -> list[Embedding]:
    """All embeddings of a finished reply stream, in image order."""
    dec = StreamDecoder(num_images)
    out = [e for e in (dec.feed(m) for m in messages) if e is not None]
    dec.close()
    return out
