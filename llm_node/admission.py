"""Admission control: requests and embedding bytes in flight are bounded, so load is refused, never OOM.

A request takes a Slot first, before any work is spent on it (the HTTP door takes it before
reading the body; the gRPC door's message is bounded by the port's message limit and
concurrent calls): beyond --max-concurrent-requests it gets RESOURCE_EXHAUSTED (HTTP 429 with
Retry-After) at once. Once its image headers are read, the slot reserves the embedding bytes
its images will take (rows predicted from the headers x hidden size x 4 bytes: the widest
datatype, so the bound holds whatever the encoders send): beyond the node's budget it is
RESOURCE_EXHAUSTED too, or INVALID_ARGUMENT when it could never fit. The slot and its bytes
are released when the request ends, however it ends (release is idempotent, so the door
and the generation may both release it).
"""

from __future__ import annotations

from encdis.client.errors import InvalidArgument, ResourceExhausted


class Slot:
    """One admitted request: its place among the requests in flight and the bytes it reserved."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.embedding_bytes = 0
        self.released = False

    def reserve(self, embedding_bytes: int) -> None:
        """Add `embedding_bytes` to what this request holds, or refuse it (the slot stays taken)."""
        if self.released:
            raise RuntimeError("reserve on a released admission slot")
        self._admission._reserve(embedding_bytes)
        self.embedding_bytes += embedding_bytes

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._admission._release(self)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Admission:
    def __init__(self, max_requests: int, max_embedding_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_embedding_bytes = max_embedding_bytes
        self.requests = 0
        self.embedding_bytes = 0

    def take(self) -> Slot:
        """A slot for one request; ResourceExhausted when max_requests are in flight."""
        if self.requests >= self.max_requests:
            raise ResourceExhausted(f"{self.requests} requests in flight, the limit is {self.max_requests}; "
                                    "retry later", reason="ADMISSION_REQUESTS",
                                    metadata={"limit": str(self.max_requests)})
        self.requests += 1
        return Slot(self)

    def _reserve(self, embedding_bytes: int) -> None:
        if embedding_bytes > self.max_embedding_bytes:  # could never be admitted: the request's fault
            raise InvalidArgument(f"the request's images need {embedding_bytes} embedding bytes, more than the "
                                  f"node's limit of {self.max_embedding_bytes}", reason="EMBEDDING_BYTES_OVER_LIMIT",
                                  metadata={"limit": str(self.max_embedding_bytes)})
        if self.embedding_bytes + embedding_bytes > self.max_embedding_bytes:
            raise ResourceExhausted(f"{self.embedding_bytes} embedding bytes in flight; this request needs "
                                    f"{embedding_bytes} more, the limit is {self.max_embedding_bytes}; retry later",
                                    reason="ADMISSION_EMBEDDING_BYTES",
                                    metadata={"limit": str(self.max_embedding_bytes)})
        self.embedding_bytes += embedding_bytes

    def _release(self, slot: Slot) -> None:
        self.requests -= 1
        self.embedding_bytes -= slot.embedding_bytes
