"""The coordinator's embedding cache: vision-tower outputs by content digest.

Keys are `encdis.client.wire.content_digest(image, min_pixels, max_pixels,
weights_fingerprint, image_loader, datatype)`, so an entry is reused only for the same
image bytes, resize bounds, tower weights, image loader and embedding datatype. Entries are evicted least recently used
first once their total size passes a byte budget (0 disables storing; in-flight
sharing still works).

Identical images that arrive while one is being encoded are encoded once: the first
request `claim`s the digest and gets a future; later requests find that future with
`pending` and await it (shielded, so one waiter's cancellation never cancels it for the
others). The claimant must end every claim with `fulfil` or `fail`.

Cached tensors are shared by every request that hits them: treat them as read-only.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from .records import ImageEmbedding


class ClaimAbandoned(Exception):
    """The request that was encoding an image went away before finishing it.

    Waiters on its future should encode the image themselves.
    """


class EmbeddingCache:
    """LRU of embeddings bounded in bytes, plus the futures of images being encoded."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, ImageEmbedding] = OrderedDict()
        self._bytes = 0
        self._pending: dict[str, asyncio.Future[ImageEmbedding]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, digest: str) -> ImageEmbedding | None:
        """The stored embedding (now the most recently used), or None."""
        entry = self._entries.get(digest)
        if entry is not None:
            self._entries.move_to_end(digest)
        return entry

    def put(self, entry: ImageEmbedding) -> bool:
        """Store `entry`, evicting the least recently used; False if it alone exceeds the budget."""
        size = entry.nbytes
        if size > self.max_bytes:
            return False
        old = self._entries.pop(entry.digest, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._entries[entry.digest] = entry
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
        return True

    def pending(self, digest: str) -> asyncio.Future[ImageEmbedding] | None:
        """The future of an encode of this digest already in flight, or None."""
        return self._pending.get(digest)

    def claim(self, digest: str) -> asyncio.Future[ImageEmbedding]:
        """Mark `digest` as being encoded by the caller; others will wait on the returned future."""
        if digest in self._pending:
            raise RuntimeError(f"digest {digest[:12]} is already being encoded")
        fut: asyncio.Future[ImageEmbedding] = asyncio.get_running_loop().create_future()
        # A failed claim nobody waited on must not log "exception was never retrieved".
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._pending[digest] = fut
        return fut

    def fulfil(self, entry: ImageEmbedding) -> None:
        """The claimed image is encoded: store it and wake its waiters."""
        self.put(entry)
        fut = self._pending.pop(entry.digest, None)
        if fut is not None and not fut.done():
            fut.set_result(entry)

    def fail(self, digest: str, exc: BaseException) -> None:
        """The claimed image could not be encoded: waiters get `exc`; nothing is stored."""
        fut = self._pending.pop(digest, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)
