"""Receiving an Encode stream whose bytes may come over a co-located group (no torch here).

An Encode call that names a co-located session gets, per image, a header marked `colocated`
(no chunks follow) and the bytes over the pair's group. `ColocatedStreamDecoder` checks such
a header exactly as a chunked one (rows, hidden size, datatype, patches, size limit: a
disagreeing header is refused before anything is allocated) and leaves it pending; the
caller's `ColocatedReceiver` then receives the bytes (llm_node/coordinator/colocated_link.py
holds the torch side). Headers not marked `colocated` are decoded as ever: an encoder that
no longer holds the session answers over gRPC.

While the bytes are outstanding the gRPC stream is still watched (`receive_pending`): if it
fails first (the encoder died, its send failed), the receive is abandoned at once rather
than left to its timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, Protocol

from encdis.client.embedding import Embedding, embedding_of
from encdis.client.errors import WireError
from encdis.client.pb import encoder_pb2
from encdis.client.wire import StreamDecoder, check_header


class ColocatedReceiver(Protocol):
    """The receiving end of one pair, as an Encode call uses it."""

    session_id: str

    def tag_base(self, num_images: int) -> int:
        """The first of `num_images` tags no other call on this pair uses."""
        ...

    async def receive(self, header: encoder_pb2.EmbeddingHeader, deadline: float | None) -> memoryview:
        """The image's `header.total_bytes` bytes, received with `header.colocated_tag`; raises
        (and closes the pair) on a timeout, at `deadline` (time.monotonic()) or a lost peer."""
        ...


class ColocatedStreamDecoder(StreamDecoder):
    """A StreamDecoder that also accepts co-located headers (`colocated_pending`, `take_colocated`)."""

    def __init__(self, num_images: int, **kwargs: Any) -> None:
        super().__init__(num_images, **kwargs)
        self._colocated: encoder_pb2.EmbeddingHeader | None = None

    def accept(self, msg: encoder_pb2.EncodeResponse | bytes):
        if self._colocated is not None:
            raise RuntimeError("take_colocated() the pending image before feeding more messages")
        return super().accept(msg)

    def _open_image(self, header: encoder_pb2.EmbeddingHeader) -> None:
        if not header.colocated:
            super()._open_image(header)
            return
        i = header.image_index
        # The same order checks as a chunked header (StreamDecoder._open_image), then the size checks.
        if self._open is not None:
            raise WireError(f"header for image {i} before image {self._open.header.image_index} was complete")
        if i != self._done or self._done >= self.num_images:
            raise WireError(f"co-located header for image {i}, expected image {self._done} of {self.num_images}")
        if header.num_chunks != 0:
            raise WireError(f"image {i}: a co-located header announcing {header.num_chunks} chunks")
        expected = self.expected[self._done] if self.expected is not None else None
        check_header(header, max_total_bytes=self.max_total_bytes, expected=expected)
        self._colocated = header

    @property
    def colocated_pending(self) -> encoder_pb2.EmbeddingHeader | None:
        """The checked header of the image whose bytes the caller must now receive."""
        return self._colocated

    def _chunk(self, image_index: int, chunk_index: int, data: bytes | memoryview):
        if self._colocated is not None:  # a first_chunk riding in a co-located header
            raise WireError(f"image {image_index}: a chunk for a co-located image")
        return super()._chunk(image_index, chunk_index, data)

    def take_colocated(self, data: memoryview, receive_seconds: float = 0.0) -> Embedding:
        h = self._colocated
        if h is None:
            raise RuntimeError("no co-located image pending")
        if data.nbytes != h.total_bytes:
            raise WireError(f"image {h.image_index}: received {data.nbytes} bytes, announced {h.total_bytes}")
        self._colocated = None
        self._done += 1
        return embedding_of(h, data, receive_seconds)

    def close(self) -> None:
        if self._colocated is not None:
            raise WireError(f"stream ended inside co-located image {self._colocated.image_index}")
        super().close()


class Lookahead:
    """An async iterator over a call's messages whose next message can be awaited in the background."""

    def __init__(self, messages: AsyncIterable[Any]) -> None:
        self._it: AsyncIterator[Any] = messages.__aiter__()
        self._next: asyncio.Task | None = None

    def __aiter__(self) -> Lookahead:
        return self

    async def _one(self) -> tuple[bool, Any]:
        try:
            return True, await self._it.__anext__()
        except StopAsyncIteration:
            return False, None

    def fetch(self) -> asyncio.Task:
        """The task reading the next message (started now unless it already runs)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._one())
        return self._next

    async def __anext__(self) -> Any:
        if self._next is None:  # the usual case: no task per message on the chunked path
            return await self._it.__anext__()
        task, self._next = self._next, None
        more, msg = await task
        if not more:
            raise StopAsyncIteration
        return msg

    def cancel(self) -> None:
        if self._next is not None:
            self._next.cancel()


async def receive_pending(dec: ColocatedStreamDecoder, receiver: ColocatedReceiver, messages: Lookahead,
                          deadline: float | None) -> Embedding:
    """The pending co-located image, its bytes received while the stream is watched.

    The encoder sends the next header only after this image's bytes, but the two paths race:
    a message (or the stream's end) arriving first is kept for the caller. A stream that fails
    first abandons the receive (the receiver closes the pair) and raises the stream's error.
    """
    header = dec.colocated_pending
    assert header is not None
    t0 = time.perf_counter()
    recv = asyncio.ensure_future(receiver.receive(header, deadline))
    try:
        nxt = messages.fetch()
        await asyncio.wait({recv, nxt}, return_when=asyncio.FIRST_COMPLETED)
        if not recv.done() and (nxt.cancelled() or nxt.exception() is not None):
            recv.cancel()
            await asyncio.gather(recv, return_exceptions=True)
            raise nxt.exception() if not nxt.cancelled() else asyncio.CancelledError()
        # A message or the stream's normal end: the encoder's send returned, the bytes are landing.
        data = await recv
    except BaseException:
        if not recv.done():
            recv.cancel()
            await asyncio.gather(recv, return_exceptions=True)
        raise
    return dec.take_colocated(data, time.perf_counter() - t0)
