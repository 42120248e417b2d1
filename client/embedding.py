"""The embedding as a receiver holds it, and the one table of wire datatypes.

Wire datatypes follow the Open Inference Protocol (BF16, FP16, FP32: raw little-endian
row-major bytes); `decode_array` reinterprets such bytes for numpy, never unpickling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from encdis.client.errors import WireError

if TYPE_CHECKING:
    from encdis.client.pb import encoder_pb2


# Implementations of the vision tower an encoder may run (encoder_node/tower.py, vllm_tower.py):
# part of the model identity, as the datatype is.
TOWER_IMPLS = ("vllm", "transformers")

# EncoderService.Has: digests per call and characters per digest the node accepts.
MAX_HAS_DIGESTS = 1024
MAX_DIGEST_CHARS = 128


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
class AcceptedBacklog:
    """The encoder's load when it accepted the call: predicted seconds to drain, patches queued."""

    seconds: float
    queued_patches: int


def set_accepted_backlog(header: encoder_pb2.EmbeddingHeader, backlog: AcceptedBacklog | None) -> None:
    """Write `backlog` into an EmbeddingHeader (embedding_of reads it back); None: not sent."""
    if backlog is not None:
        header.has_accepted_backlog = True
        header.accepted_backlog_seconds = backlog.seconds
        header.accepted_queued_patches = backlog.queued_patches


@dataclass(frozen=True)
class Embedding:
    """One image's vision-tower output as received: raw bytes plus what they mean."""

    image_index: int
    grid_thw: tuple[int, int, int]
    datatype: str
    shape: tuple[int, int]  # (num_tokens, hidden_size)
    data: bytes | memoryview  # as received: a writable view of the buffer the chunks were copied into
    digest: str
    batch: BatchInfo | None = None
    queue_seconds: float = 0.0  # the encoder's, accept to the batch's start
    preprocess_seconds: float = 0.0  # of that, decoding and preprocessing the image
    accepted_backlog: AcceptedBacklog | None = None  # the node's load when it took the call
    # Measured by the receiver: from its header's arrival to its last chunk's.
    receive_seconds: float = 0.0
    cached: bool = False  # served from the encoder's embedding cache: no forward ran (batch is None)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def array(self) -> np.ndarray:
        """The embedding as numpy: FP32/FP16 as sent, BF16 widened exactly to float32."""
        return decode_array(self.datatype, self.shape, self.data)


def decode_array(datatype: str, shape: tuple[int, ...], data: bytes | memoryview) -> np.ndarray:
    """Reinterpret raw little-endian bytes; BF16 (absent from numpy) becomes float32 exactly."""
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize(datatype)
    if memoryview(data).nbytes != expected:
        raise WireError(f"{datatype} tensor of shape {list(shape)} needs {expected} bytes, "
                        f"got {memoryview(data).nbytes}")
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


def embedding_of(h: encoder_pb2.EmbeddingHeader, data: memoryview, receive_seconds: float) -> Embedding:
    """The Embedding a checked header and its received bytes make."""
    batch = None
    if h.HasField("batch"):
        batch = BatchInfo(seconds=h.batch.seconds, image_patches=tuple(h.batch.image_patches))
    t, hh, w = h.grid_thw
    return Embedding(
        image_index=h.image_index,
        grid_thw=(int(t), int(hh), int(w)),
        datatype=h.datatype,
        shape=(h.num_tokens, h.hidden_size),
        data=data,
        digest=h.digest,
        batch=batch,
        queue_seconds=h.queue_seconds,
        preprocess_seconds=h.preprocess_seconds,
        accepted_backlog=(AcceptedBacklog(h.accepted_backlog_seconds, h.accepted_queued_patches)
                          if h.has_accepted_backlog else None),
        receive_seconds=receive_seconds,
        cached=h.cached,
    )
