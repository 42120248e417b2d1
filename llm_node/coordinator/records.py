"""What the coordinator hands out: embeddings (and the tensor over a received one's buffer), a
request's result, an encoder's status."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from encdis.client.errors import WireError
from encdis.client.wire import DATATYPES, Embedding

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ImageEmbedding:
    """One image's embedding as vLLM takes it: (tokens, hidden) rows, its patch grid, its uuid.

    The same object is cached and shared by every request that hits it: read-only.
    """

    embeds: torch.Tensor = field(repr=False)  # (num_tokens, hidden_size)
    grid_thw: tuple[int, int, int]
    digest: str  # content digest; also vLLM's multimodal uuid

    @property
    def nbytes(self) -> int:
        return self.embeds.numel() * self.embeds.element_size()


@dataclass
class RequestTiming:
    """Where one request's encode time went, each part measured on its own."""

    wait: float = 0.0  # for a SERVING encoder, in the coordinator
    queue: float = 0.0  # longest time from an encoder accepting an image to its batch's start
    preprocess: float = 0.0  # of that image's queue, its decoding and preprocessing
    encode: float = 0.0  # longest forward among the request's batches
    transfer: float = 0.0  # longest receive of one embedding (header to last byte, as a tensor)
    retries: int = 0

    def observe_queue(self, queue: float, preprocess: float) -> None:
        """An image's queue as its encoder reports it; the longest one counts. The encoder is not
        trusted: its preprocessing is taken as at most its queue, and at least 0 (NaN too)."""
        if queue > self.queue:
            self.queue, self.preprocess = queue, min(max(0.0, preprocess), queue)


@dataclass(frozen=True)
class EncodeResult:
    """A request's embeddings in image order, and where its encode time went.

    queue_seconds: waiting for a usable encoder and in the encoders' queues;
    preprocess_seconds: the encoders' decoding and preprocessing of the image waited for
    longest (reported apart from queue_seconds);
    encode_seconds: the longest tower forward among the request's batches;
    transfer_seconds: from the first header of an embedding to its last byte as a tensor,
    the longest over the request's calls (the wire and the receiver's work);
    wall_seconds: the whole of Coordinator.encode. Each is measured on its own, so they need
    not add up to the wall time (calls overlap; hashing and probing are in none of them).
    """

    images: list[ImageEmbedding]
    cached: list[bool]  # per image: True when no encode was done for it in this request
    queue_seconds: float = 0.0
    preprocess_seconds: float = 0.0
    encode_seconds: float = 0.0
    transfer_seconds: float = 0.0
    wall_seconds: float = 0.0
    retries: int = 0


@dataclass(frozen=True)
class EncoderStatus:
    """One encoder as ListEncoders reports it."""

    address: str
    name: str
    state: str
    reason: str
    backlog_seconds: float
    backlog_patches: int
    patches_per_second: float
    assigned_patches: int
    assigned_images: int
    backoff_seconds: float = 0.0  # length of its current penalty (quarantined, slow); 0 when none
    faults: int = 0  # consecutive faults behind that penalty
    backoff_remaining_seconds: float = 0.0  # until it is probed again; 0 when none or probing
    has_report: bool = False  # an ORCA load report has been received (load_reports.py)
    report_age_seconds: float = 0.0
    report_queued_patches: float = 0.0
    report_images_in_flight: float = 0.0
    report_drain_seconds: float = 0.0
    report_utilization: float = 0.0
    lateness_seconds: float = 0.0  # how late its calls recently finished past their prediction


def embedding_tensor(emb: Embedding) -> torch.Tensor:
    """A (tokens, hidden) tensor over the buffer the receiver filled in place: no copy, never unpickled."""
    import torch

    if emb.datatype not in DATATYPES:
        raise WireError(f"image {emb.image_index}: unknown datatype {emb.datatype!r}")
    t = torch.frombuffer(emb.data, dtype=getattr(torch, DATATYPES[emb.datatype].torch))
    return t.view(emb.shape[0], emb.shape[1])
