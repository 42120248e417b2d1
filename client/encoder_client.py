"""Clients for an encoder node's EncoderService, sync and asyncio.

    with EncoderClient("127.0.0.1:50051") as enc:
        for e in enc.encode([open("cat.jpg", "rb").read()]):
            print(e.grid_thw, e.array().shape, e.digest)

TLS and API keys (encdis.client.channels): `root_certificates=` (PEM bytes; `tls=True`
alone uses the system's roots), `certificate_chain=` + `private_key=` for a node that
requires client certificates, `api_key=` (sent as `authorization: Bearer KEY`),
`server_name=` to verify the node's certificate against another name than the target's.
Failed calls raise the typed exceptions of `encdis.client.errors` (Unauthenticated
without a valid key).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from encdis.client.client_base import AsyncClient, SyncClient
from encdis.client.colocated import ColocatedReceiver, ColocatedStreamDecoder, Lookahead, receive_pending
from encdis.client.errors import EncdisError, from_rpc_error
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.client.wire import Allocate, ChunkCopy, Embedding, ExpectedEmbedding, StreamDecoder

# Encode's replies are read as the bytes gRPC received (no deserializer): StreamDecoder finds
# each chunk's data in place instead of protobuf copying it twice.
ENCODE_METHOD = "/encdis.encoder.v1.EncoderService/Encode"
# What the asyncio client asks for (bench/data_plane/transport.py): gRPC turns each message into bytes on
# the event loop (about 0.3 ms per MiB), so 1 MiB keeps each of those callbacks short, and moved
# as much per second as 4 MiB on loopback.
RECEIVE_CHUNK_BYTES = 1024 * 1024
# Smaller chunk copies run on the event loop: a thread handoff costs more than copying them.
INLINE_COPY_BYTES = 256 * 1024
# Chunks received but not yet copied into place, per call: bounds the memory they hold.
MAX_PENDING_COPIES = 8
RECEIVE_COPY_THREADS = 1
# How long close() waits for calls whose images are all in to end before cancelling them.
TAIL_GRACE_SECONDS = 1.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderDescription:
    """An encoder node's model identity, limits and host (its Describe reply)."""

    vision_config: dict[str, Any]
    out_hidden_size: int
    weights_fingerprint: str
    device: str
    datatype: str
    max_batch_patches: int
    max_images_per_request: int
    max_image_bytes: int
    max_image_pixels: int
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    boot_id: str
    hostname: str
    version: str
    max_chunk_bytes: int
    image_loader: str = ""
    tower_impl: str = ""  # "vllm" or "transformers" ("" from an encoder that does not report it)
    net_namespace: str = ""  # with boot_id: equal both ways means one loopback
    cache_bytes: int = 0  # the node's embedding cache budget (0: no cache)

    @classmethod
    def from_proto(cls, r: encoder_pb2.DescribeResponse) -> EncoderDescription:
        return cls(
            vision_config=json.loads(r.vision_config_json or "{}"),
            out_hidden_size=r.out_hidden_size,
            weights_fingerprint=r.weights_fingerprint,
            device=r.device,
            datatype=r.datatype,
            max_batch_patches=r.max_batch_patches,
            max_images_per_request=r.max_images_per_request,
            max_image_bytes=r.max_image_bytes,
            max_image_pixels=r.max_image_pixels,
            min_pixels=r.min_pixels,
            max_pixels=r.max_pixels,
            patch_size=r.patch_size,
            merge_size=r.merge_size,
            temporal_patch_size=r.temporal_patch_size,
            boot_id=r.boot_id,
            hostname=r.hostname,
            version=r.version,
            max_chunk_bytes=r.max_chunk_bytes,
            image_loader=r.image_loader,
            tower_impl=r.tower_impl,
            net_namespace=r.net_namespace,
            cache_bytes=r.cache_bytes,
        )


def encode_request(
    images: Sequence[bytes], min_pixels: int = 0, max_pixels: int = 0, max_chunk_bytes: int = 0
) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(
        images=list(images), min_pixels=min_pixels, max_pixels=max_pixels, max_chunk_bytes=max_chunk_bytes
    )


class EncoderClient(SyncClient):
    """Blocking client for one encoder node."""

    def _bind(self) -> None:
        self._stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)
        self._encode_raw = self._channel.unary_stream(
            ENCODE_METHOD, request_serializer=encoder_pb2.EncodeRequest.SerializeToString, _registered_method=True)

    def encode(self, images: Sequence[bytes], *, min_pixels: int = 0, max_pixels: int = 0,
               max_chunk_bytes: int = 0, timeout: float | None = None,
               expected: Sequence[ExpectedEmbedding] | None = None,
               max_total_bytes: int | None = None) -> list[Embedding]:
        """Embeddings of `images`, in order. Raises InvalidArgument naming a bad image.

        `expected` (one per image) and `max_total_bytes` make the receiver refuse, with a
        WireError naming the image, a header that disagrees or announces more.
        """
        req = encode_request(images, min_pixels, max_pixels, max_chunk_bytes)
        dec = StreamDecoder(len(images), expected=expected, max_total_bytes=max_total_bytes)
        out: list[Embedding] = []
        try:
            for msg in self._encode_raw(req, timeout=timeout or self.timeout):
                emb = dec.feed(msg)
                if emb is not None:
                    out.append(emb)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        dec.close()
        return out

    def describe(self, *, timeout: float | None = None) -> EncoderDescription:
        try:
            r = self._stub.Describe(encoder_pb2.DescribeRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return EncoderDescription.from_proto(r)

    def has(self, digests: Sequence[str], *, timeout: float | None = None) -> list[bool]:
        """For each content digest, whether the node's cache holds its finished embedding."""
        try:
            r = self._stub.Has(encoder_pb2.HasRequest(digests=list(digests)), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return list(r.present)


class AsyncEncoderClient(AsyncClient):
    """asyncio client for one encoder node (grpc.aio)."""

    def _bind(self) -> None:
        self._stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)
        self._encode_raw = self._channel.unary_stream(
            ENCODE_METHOD, request_serializer=encoder_pb2.EncodeRequest.SerializeToString, _registered_method=True)
        self._copy_threads: ThreadPoolExecutor | None = None
        self._tails: set[asyncio.Task] = set()  # calls whose images are all in, read to their end

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    async def encode(self, images: Sequence[bytes], *, min_pixels: int = 0, max_pixels: int = 0,
                     max_chunk_bytes: int = RECEIVE_CHUNK_BYTES, timeout: float | None = None) -> list[Embedding]:
        out: list[Embedding] = []
        async for emb in self.encode_iter(images, min_pixels=min_pixels, max_pixels=max_pixels,
                                          max_chunk_bytes=max_chunk_bytes, timeout=timeout):
            out.append(emb)
        return out

    async def encode_iter(self, images: Sequence[bytes], *, min_pixels: int = 0, max_pixels: int = 0,
                          max_chunk_bytes: int = RECEIVE_CHUNK_BYTES, timeout: float | None = None,
                          expected: Sequence[ExpectedEmbedding] | None = None, max_total_bytes: int | None = None,
                          on_embedding_bytes: Callable[[int], object] | None = None,
                          colocated: ColocatedReceiver | None = None,
                          metadata: Sequence[tuple[str, str]] = (),
                          allocate: Allocate | None = None,
                          on_tail_error: Callable[[EncdisError], object] | None = None) -> AsyncIterator[Embedding]:
        """Yield each image's embedding as soon as its last chunk arrives (chunks of at most
        `max_chunk_bytes`; 0: the node's default). Once every image is in, the iteration ends
        without waiting for the call's end (its trailers take a loop round trip or more): the call
        is read to its end in the background, and anything wrong there (a message more, an error
        status) goes to `on_tail_error` (default: logged); the images given are checked whole.

        Each chunk is checked on the event loop (against the header, and the header against
        `expected` and `max_total_bytes`, as in EncoderClient.encode) and copied into place
        by a worker thread, so the loop never copies large embedding bytes.
        `on_embedding_bytes` is called with each embedding's size as it is yielded.
        `colocated`: a co-located pair's receiver (client/colocated.py); the call names its
        session and images whose header says so arrive over it, the others as chunks.
        `metadata`: extra gRPC metadata of the call (the caller's W3C trace context).
        `allocate`: each image's receive buffer, by size (None: the heap).
        """
        req = encode_request(images, min_pixels, max_pixels, max_chunk_bytes)
        dec: StreamDecoder = StreamDecoder(len(images), expected=expected, max_total_bytes=max_total_bytes,
                                           allocate=allocate)
        if colocated is not None:
            req.colocated_session, req.colocated_tag_base = colocated.session_id, colocated.tag_base(len(images))
            dec = ColocatedStreamDecoder(len(images), expected=expected, max_total_bytes=max_total_bytes,
                                         allocate=allocate)
        copies = _PendingCopies(self._copy_pool())
        call = self._encode_raw(req, timeout=timeout or self.timeout, metadata=tuple(metadata) or None)
        deadline = time.monotonic() + (timeout or self.timeout) if (timeout or self.timeout) else None
        messages = Lookahead(call)
        tail = False  # every image is in and the call's end is read in the background
        try:
            async for msg in messages:
                copy = dec.accept(msg)
                if copy is not None:
                    await copies.submit(copy)
                if isinstance(dec, ColocatedStreamDecoder) and dec.colocated_pending is not None:
                    emb = await receive_pending(dec, colocated, messages, deadline)
                    if on_embedding_bytes is not None:
                        on_embedding_bytes(emb.data.nbytes)
                    yield emb
                if dec.image_complete:
                    await copies.drain()
                    emb = dec.take()
                    if on_embedding_bytes is not None:
                        on_embedding_bytes(emb.data.nbytes)
                    yield emb
                if dec.all_taken:
                    tail = True
                    self._read_tail(messages, call, dec, on_tail_error)
                    return
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            if not tail:
                messages.cancel()
                call.cancel()
        dec.close()

    def _read_tail(self, messages: Lookahead, call: Any, dec: StreamDecoder,
                   on_error: Callable[[EncdisError], object] | None) -> None:
        """Read a call whose images are all in to its end (not cancelled: the encoder ends it as
        it always does), in a task this client holds until it is done."""

        async def read() -> None:
            try:
                async for msg in messages:
                    dec.accept(msg)  # nothing is due: a message more is the encoder's fault
                dec.close()
            except (grpc.RpcError, EncdisError) as e:
                error = from_rpc_error(e) if isinstance(e, grpc.RpcError) else e
                if on_error is not None:
                    on_error(error)
                else:
                    log.warning("an Encode call failed after all its images arrived: %s", error)
            finally:
                messages.cancel()
                call.cancel()

        task = asyncio.ensure_future(read())
        self._tails.add(task)
        task.add_done_callback(self._tails.discard)

    def _copy_pool(self) -> ThreadPoolExecutor:
        if self._copy_threads is None:
            self._copy_threads = ThreadPoolExecutor(RECEIVE_COPY_THREADS, thread_name_prefix="encdis-receive")
        return self._copy_threads

    async def describe(self, *, timeout: float | None = None) -> EncoderDescription:
        try:
            r = await self._stub.Describe(encoder_pb2.DescribeRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return EncoderDescription.from_proto(r)

    async def has(self, digests: Sequence[str], *, timeout: float | None = None) -> list[bool]:
        """For each content digest, whether the node's cache holds its finished embedding."""
        try:
            r = await self._stub.Has(encoder_pb2.HasRequest(digests=list(digests)), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return list(r.present)

    async def close(self) -> None:
        # A call whose images are all in ends on its own: its encoder sends the status right after
        # them. Given a moment, it ends as the encoder sent it (its last send recorded and
        # counted there) instead of cancelled; a call still open after that is cancelled.
        if self._tails:
            await asyncio.wait(list(self._tails), timeout=TAIL_GRACE_SECONDS)
        for task in list(self._tails):
            task.cancel()
        await super().close()
        if self._copy_threads is not None:
            self._copy_threads.shutdown(wait=False)


class _PendingCopies:
    """One call's chunk copies queued on a worker thread, at most MAX_PENDING_COPIES at a time.

    A copy wakes the event loop only when the loop waits for it (a full queue, or an image's
    last chunk), not once per chunk: each wake-up costs the loop more than a chunk's checks.
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._pending: deque[Future[None]] = deque()

    async def submit(self, copy: ChunkCopy) -> None:
        if copy.nbytes < INLINE_COPY_BYTES:
            copy.run()
            return
        self._pending.append(self._pool.submit(copy.run))
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()  # re-raises a failed copy
        if len(self._pending) > MAX_PENDING_COPIES:
            await asyncio.wrap_future(self._pending.popleft())

    async def drain(self) -> None:
        """Wait until every submitted copy has run: the image's buffer is then whole."""
        while self._pending:
            f = self._pending.popleft()
            if f.done():
                f.result()
            else:
                await asyncio.wrap_future(f)
