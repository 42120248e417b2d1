"""Admission control: requests and embedding bytes in flight are bounded, so load is refused, never OOM.

A request is admitted before any expensive work with the embedding bytes its images will
take (rows predicted from their headers x hidden size x 4 bytes: the widest datatype, so
the bound holds whatever the encoders send); beyond either limit it gets
RESOURCE_EXHAUSTED (HTTP 429 with Retry-After) at once. Both are released when the request
ends, however it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from encdis.client.errors import InvalidArgument, ResourceExhausted


class Admission:
    def __init__(self, max_requests: int, max_embedding_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_embedding_bytes = max_embedding_bytes
        self.requests = 0
        self.embedding_bytes = 0

    @contextlib.contextmanager
    def admit(self, embedding_bytes: int) -> Iterator[None]:
        if self.requests >= self.max_requests:
            raise ResourceExhausted(f"{self.requests} requests in flight, the limit is {self.max_requests}; "
                                    "retry later", reason="ADMISSION_REQUESTS",
                                    metadata={"limit": str(self.max_requests)})
        if embedding_bytes > self.max_embedding_bytes:  # could never be admitted: the request's fault
            raise InvalidArgument(f"the request's images need {embedding_bytes} embedding bytes, more than the "
                                  f"node's limit of {self.max_embedding_bytes}", reason="EMBEDDING_BYTES_OVER_LIMIT",
                                  metadata={"limit": str(self.max_embedding_bytes)})
        if self.embedding_bytes + embedding_bytes > self.max_embedding_bytes:
            raise ResourceExhausted(f"{self.embedding_bytes} embedding bytes in flight; this request needs "
                                    f"{embedding_bytes} more, the limit is {self.max_embedding_bytes}; retry later",
                                    reason="ADMISSION_EMBEDDING_BYTES",
                                    metadata={"limit": str(self.max_embedding_bytes)})
        self.requests += 1
        self.embedding_bytes += embedding_bytes
        try:
            yield
        finally:
            self.requests -= 1
            self.embedding_bytes -= embedding_bytes
