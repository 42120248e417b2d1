"""What an encoder must send back for an image, known before it answers; and the check.

Role: the coordinator trusts no encoder. From an image's header alone it knows the patch
grid the processor will give it (patches.grid_for_image with the checkpoint's resize
bounds), hence the embedding's rows (t*h*w / merge_size**2); the hidden size is the LLM's,
the datatype the pool's (identity.py), the digest the coordinator's own. An embedding
that differs in any of them is refused (`embedding_mismatch`): fewer rows would break the
engine's split of the concatenated embeddings, more rows or another image's bytes would
silently change answers. An encoder's error about an image of its call is renumbered to the
request's image (`request_numbering`).
"""

from __future__ import annotations

from dataclasses import dataclass

from encdis.client.errors import InvalidArgument
from encdis.client.wire import DATATYPES, Embedding


@dataclass(frozen=True)
class PendingImage:
    """An image this request must have encoded: its place in the request, key, and the
    embedding it must come back as."""

    index: int  # in the request's numbering
    digest: str
    grid: tuple[int, int, int]  # (t, h, w) patches after the processor's resize
    rows: int  # embedding rows: t*h*w / merge_size**2

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


def embedding_mismatch(emb: Embedding, job: PendingImage, hidden_size: int, datatype: str | None) -> str | None:
    """How `emb` differs from what `job` must come back as, or None when it is the one."""
    if tuple(emb.grid_thw) != job.grid:
        return f"encoder sent grid_thw {list(emb.grid_thw)}, the image's header gives {list(job.grid)}"
    if tuple(emb.shape) != (job.rows, hidden_size):
        return (f"encoder sent {emb.shape[0]} rows x {emb.shape[1]} hidden, the image needs "
                f"{job.rows} x {hidden_size}")
    allowed = [datatype] if datatype is not None else sorted(DATATYPES)
    if emb.datatype not in allowed:
        return f"encoder sent datatype {emb.datatype!r}, expected {' or '.join(allowed)}"
    if emb.digest != job.digest:
        return (f"encoder's digest {emb.digest[:16] or '(none)'}... differs from ours {job.digest[:16]}... "
                f"(other weights, resize bounds or image loader)")
    return None


def request_numbering(e: InvalidArgument, jobs: list[PendingImage]) -> InvalidArgument:
    """The encoder's error about image <call index> (its BadRequest details) renumbered to the
    request's image index; an encoder that names no image is taken at its word only for a
    one-image call."""
    local = e.image_index
    if local is not None and local < len(jobs):
        return InvalidArgument.for_image(jobs[local].index, e.image_reason or e.message, reason=e.reason)
    if len(jobs) == 1:
        return InvalidArgument.for_image(jobs[0].index, e.message, reason=e.reason)
    return InvalidArgument(f"one of images {[j.index for j in jobs]}: {e.message}", reason=e.reason)
