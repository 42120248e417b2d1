"""EncoderService: proto <-> domain and request validation; no model code and no wiring.

Encode: check the call (node state, image count, resize bounds), check every image from
its header, reserve its patches in the batcher's queue, preprocess all images (worker
threads), then queue them and stream each embedding back in request order as soon as it
is ready. A bad image fails the call before anything is streamed. Errors are raised as
encdis.client.errors exceptions; the shared interceptor turns them into status codes.

Embeddings go out as pre-serialised frames (wire.embedding_frames: each chunk is one copy of
a slice of the tower's output, made as it is sent), so Encode is registered with a response
serializer that passes them through (`add_encoder_service`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc
import torch
from opentelemetry.trace import Span, SpanKind

import encdis
from encdis.client.embedding import MAX_DIGEST_CHARS, MAX_HAS_DIGESTS
from encdis.client.errors import EncdisError, FieldViolation, InvalidArgument, ResourceExhausted, Unavailable
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.client.wire import AcceptedBacklog, BatchInfo, embedding_frames, serialize_response
from encdis.encoder_node.batcher import Batcher
from encdis.encoder_node.colocated import ColocatedSessions
from encdis.encoder_node.decode_budget import DecodeBudget
from encdis.encoder_node.embedding_cache import CachedEmbedding, EmbeddingCache
from encdis.encoder_node.metrics import EncoderMetrics
from encdis.encoder_node.preprocess import ImagePreprocessor
from encdis.encoder_node.settings import EncoderSettings
from encdis.encoder_node.tower import VisionTower
from encdis.pair_group import read_boot_id, read_net_namespace
from encdis.serving import InFlight
from encdis.tracing import Tracing, context_from_metadata, record_span

# Smallest chunk a caller may ask for: tiny chunks would only multiply messages.
MIN_CHUNK_BYTES = 1024


@dataclass(frozen=True)
class LoadedModel:
    """What a node serves once loading is done."""

    tower: VisionTower
    preprocessor: ImagePreprocessor
    weights_fingerprint: str
    batcher: Batcher
    preprocess_pool: Executor


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian row-major bytes of a CPU tensor, without a copy (unless it is not contiguous)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def reply_frames(index: int, grid_thw: tuple[int, int, int], digest: str, embedding: torch.Tensor, datatype: str,
                 max_chunk_bytes: int, *, batch: BatchInfo | None = None,
                 queue_seconds: float = 0.0, preprocess_seconds: float = 0.0,
                 accepted_backlog: AcceptedBacklog | None = None, cached: bool = False) -> Iterator[bytes]:
    """One image's embedding as Encode sends it: its header, then chunks sliced from the tensor in place."""
    return embedding_frames(
        image_index=index, grid_thw=grid_thw, datatype=datatype,
        shape=(int(embedding.shape[0]), int(embedding.shape[1])), data=tensor_bytes(embedding),
        digest=digest, max_chunk_bytes=max_chunk_bytes, batch=batch, queue_seconds=queue_seconds,
        preprocess_seconds=preprocess_seconds, accepted_backlog=accepted_backlog, cached=cached,
    )


def add_encoder_service(servicer: encoder_pb2_grpc.EncoderServiceServicer, server: grpc.aio.Server) -> None:
    """Register EncoderService as the generated code does, except that Encode's replies may be frames."""
    service = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name
    handlers = {
        "Encode": grpc.unary_stream_rpc_method_handler(
            servicer.Encode, request_deserializer=encoder_pb2.EncodeRequest.FromString,
            response_serializer=serialize_response),
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe, request_deserializer=encoder_pb2.DescribeRequest.FromString,
            response_serializer=encoder_pb2.DescribeResponse.SerializeToString),
        "OpenColocated": grpc.unary_unary_rpc_method_handler(
            servicer.OpenColocated, request_deserializer=encoder_pb2.OpenColocatedRequest.FromString,
            response_serializer=encoder_pb2.OpenColocatedResponse.SerializeToString),
        "CloseColocated": grpc.unary_unary_rpc_method_handler(
            servicer.CloseColocated, request_deserializer=encoder_pb2.CloseColocatedRequest.FromString,
            response_serializer=encoder_pb2.CloseColocatedResponse.SerializeToString),
        "Has": grpc.unary_unary_rpc_method_handler(
            servicer.Has, request_deserializer=encoder_pb2.HasRequest.FromString,
            response_serializer=encoder_pb2.HasResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, settings: EncoderSettings, metrics: EncoderMetrics, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.tracing = tracing or Tracing()  # off: a no-op tracer
        self._model: LoadedModel | None = None
        self._draining = False
        self._calls = InFlight(metrics.inflight_requests)
        self._decoding = DecodeBudget(settings.max_decoding_pixels)
        self.cache = EmbeddingCache(settings.resolved_cache_bytes, metrics)
        self.colocated = ColocatedSessions()  # co-located transport sessions (encoder_node/colocated.py)

    # ---- lifecycle (called by server.py)

    def attach(self, model: LoadedModel) -> None:
        self._model = model
        self.colocated.tower_device = model.tower.device

    def start_draining(self) -> None:
        """From now on new Encode calls get UNAVAILABLE; calls in progress go on."""
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """True once no Encode call is in progress, False if `timeout` passed first."""
        return await self._calls.wait_idle(timeout)

    @property
    def inflight(self) -> int:
        return self._calls.count

    def _ready_model(self) -> LoadedModel:
        if self._draining:
            raise Unavailable("encoder node is draining (shutting down); send to another encoder")
        if self._model is None:
            raise Unavailable("encoder node is still loading its model")
        return self._model

    # ---- RPCs

    async def Describe(self, request: encoder_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> encoder_pb2.DescribeResponse:
        if self._model is None:
            raise Unavailable("encoder node is still loading its model")
        m, s = self._model, self.settings
        pre = m.preprocessor
        return encoder_pb2.DescribeResponse(
            vision_config_json=json.dumps(m.tower.vision_config_dict, sort_keys=True),
            out_hidden_size=m.tower.out_hidden_size,
            weights_fingerprint=m.weights_fingerprint,
            device=str(m.tower.device),
            datatype=m.tower.datatype,
            max_batch_patches=s.max_batch_patches,
            max_images_per_request=s.max_images_per_request,
            max_image_bytes=s.max_image_bytes,
            max_image_pixels=s.max_image_pixels,
            min_pixels=pre.min_pixels,
            max_pixels=pre.max_pixels,
            patch_size=pre.patch_size,
            merge_size=pre.merge_size,
            temporal_patch_size=pre.temporal_patch_size,
            boot_id=read_boot_id(),
            net_namespace=read_net_namespace(),
            hostname=socket.gethostname(),
            version=encdis.__version__,
            max_chunk_bytes=s.max_chunk_bytes,
            image_loader=pre.image_loader,
            tower_impl=m.tower.impl,
            cache_bytes=self.cache.budget_bytes,
        )

    async def Has(self, request: encoder_pb2.HasRequest,
                  context: grpc.aio.ServicerContext) -> encoder_pb2.HasResponse:
        digests = request.digests
        if len(digests) > MAX_HAS_DIGESTS:
            raise InvalidArgument(f"{len(digests)} digests, the limit is {MAX_HAS_DIGESTS} per call",
                                  reason="TOO_MANY_DIGESTS", metadata={"limit": str(MAX_HAS_DIGESTS)})
        for i, d in enumerate(digests):
            if len(d) > MAX_DIGEST_CHARS:
                raise InvalidArgument(f"digest {i} has {len(d)} characters, the limit is {MAX_DIGEST_CHARS}",
                                      reason="DIGEST_TOO_LONG", metadata={"limit": str(MAX_DIGEST_CHARS)},
                                      violations=[FieldViolation(f"digests[{i}]", "longer than the limit")])
        return encoder_pb2.HasResponse(present=[self.cache.has(d) for d in digests])

    async def OpenColocated(self, request: encoder_pb2.OpenColocatedRequest,
                            context: grpc.aio.ServicerContext) -> encoder_pb2.OpenColocatedResponse:
        self._ready_model()
        return await self.colocated.open(request)

    async def CloseColocated(self, request: encoder_pb2.CloseColocatedRequest,
                             context: grpc.aio.ServicerContext) -> encoder_pb2.CloseColocatedResponse:
        self.colocated.close(request.session_id)
        return encoder_pb2.CloseColocatedResponse()

    async def Encode(self, request: encoder_pb2.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if self._calls.count >= self.settings.max_concurrent_rpcs:
            # Counted here rather than by gRPC's own limit, so health probes and watches are never refused.
            self.metrics.requests.labels(code="RESOURCE_EXHAUSTED").inc()
            raise ResourceExhausted(
                f"{self._calls.count} Encode calls in progress, the limit is {self.settings.max_concurrent_rpcs}",
                reason="ENCODER_CALLS_FULL", metadata={"limit": str(self.settings.max_concurrent_rpcs)})
        code = "OK"
        # Not made current: an async generator resumes in its caller's context between messages.
        span = self.tracing.tracer.start_span(
            "encdis.encoder.Encode", context=context_from_metadata(context.invocation_metadata()),
            kind=SpanKind.SERVER, attributes={"encdis.images": len(request.images)})
        with self._calls.track():
            try:
                async for msg in self._encode(request, span):
                    yield msg
            except EncdisError as e:
                code = e.code.name
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code = "CANCELLED"
                raise
            except Exception:
                code = "INTERNAL"
                raise
            finally:
                self.metrics.requests.labels(code=code).inc()
                span.set_attribute("rpc.grpc.status_code", code)
                span.end()

    async def _encode(self, request: encoder_pb2.EncodeRequest, span: Span) -> AsyncIterator[bytes]:
        model = self._ready_model()
        s, pre = self.settings, model.preprocessor
        images = request.images
        if not images:
            raise InvalidArgument("the request has no images")
        if len(images) > s.max_images_per_request:
            raise ResourceExhausted(
                f"image {s.max_images_per_request}: the request has {len(images)} images, "
                f"the limit is {s.max_images_per_request} per request",
                reason="TOO_MANY_IMAGES", metadata={"limit": str(s.max_images_per_request)})
        if 0 < request.max_chunk_bytes < MIN_CHUNK_BYTES:
            raise InvalidArgument(f"max_chunk_bytes {request.max_chunk_bytes} is below the minimum {MIN_CHUNK_BYTES}")
        # A caller's limit is a maximum: smaller chunks are always fine, larger ones than the node's are not sent.
        chunk_bytes = min(request.max_chunk_bytes or s.max_chunk_bytes, s.max_chunk_bytes)
        lo, hi = pre.resolve_bounds(request.min_pixels, request.max_pixels)
        for i, data in enumerate(images):  # every image checked before anything is streamed
            pre.inspect(i, data)
        accepted_at = time.monotonic()
        # The node's load as this call found it, reported with each of its embeddings.
        backlog = AcceptedBacklog(model.batcher.drain_seconds(accepted_at), model.batcher.queued_patches)
        session = self.colocated.get(request.colocated_session)  # None: the bytes go as chunks
        # A co-located call bypasses the cache: its sends take the tower's tensor.
        cache = self.cache if self.cache.enabled and session is None else None
        digests = [pre.digest(data, lo, hi) for data in images] if cache is not None else []
        # Per image: a CachedEmbedding (hit), a Future (another call computes it) or None (this call does).
        plan: list = [None] * len(images)
        claimed: set[int] = set()
        if cache is not None:
            for i, d in enumerate(digests):
                plan[i] = cache.get(d) or cache.claim(d)
                if plan[i] is None:
                    claimed.add(i)
        futures: dict[int, asyncio.Future] = {}
        prepared: dict = {}
        try:
            await self._submit(model, images, [i for i, x in enumerate(plan) if x is None], lo, hi, accepted_at,
                               span, futures, prepared)
            tracer = self.tracing.tracer
            for i in range(len(images)):
                t_send = time.time_ns()
                item = plan[i]
                while isinstance(item, asyncio.Future):
                    try:
                        item = await asyncio.shield(item)  # shielded: this call's cancel is not the other's
                    except LookupError:  # the other call's forward failed or was cancelled: do our own
                        item = cache.get(digests[i]) or cache.claim(digests[i])
                        if item is None:
                            claimed.add(i)
                            await self._submit(model, images, [i], lo, hi, accepted_at, span, futures, prepared)
                if isinstance(item, CachedEmbedding):
                    self.metrics.cache_hits.inc()
                    frames = reply_frames(i, item.grid_thw, digests[i], item.tensor(), item.datatype, chunk_bytes,
                                          accepted_backlog=backlog, cached=True)
                    for frame in frames:
                        yield frame
                    self.metrics.embedding_bytes.inc(item.nbytes)
                    continue
                p, enc = prepared[i], await futures[i]
                if i in claimed:
                    self.metrics.cache_misses.inc()
                    cache.finish(p.digest, CachedEmbedding.of(enc.embedding, p.grid_thw, model.tower.datatype))
                    claimed.discard(i)
                if span.is_recording():
                    # The batcher measured these; the spans end when this image's result arrived.
                    done = time.time_ns()
                    forward_ns = int(enc.batch.seconds * 1e9)
                    # The queue span is the wait in the batcher; the preprocess span holds the rest.
                    waited_ns = int((enc.queue_seconds - enc.preprocess_seconds) * 1e9)
                    record_span(tracer, span, "encdis.encoder.queue", done - forward_ns - waited_ns,
                                done - forward_ns, **{"encdis.image_index": p.index})
                    record_span(tracer, span, "encdis.encoder.forward", done - forward_ns, done,
                                **{"encdis.image_index": p.index, "encdis.batch_images": len(enc.batch.image_patches),
                                   "encdis.batch_patches": sum(enc.batch.image_patches)})
                if session is not None:
                    async for frame in self.colocated.frames(
                            session, p.index, p.grid_thw, p.digest, enc.embedding, model.tower.datatype,
                            request.colocated_tag_base + p.index, batch=enc.batch, queue_seconds=enc.queue_seconds,
                            preprocess_seconds=enc.preprocess_seconds, accepted_backlog=backlog):
                        yield frame
                else:
                    for frame in reply_frames(p.index, p.grid_thw, p.digest, enc.embedding, model.tower.datatype,
                                              chunk_bytes, batch=enc.batch, queue_seconds=enc.queue_seconds,
                                              preprocess_seconds=enc.preprocess_seconds, accepted_backlog=backlog):
                        yield frame
                self.metrics.embedding_bytes.inc(enc.embedding.numel() * enc.embedding.element_size())
                record_span(tracer, span, "encdis.encoder.send", t_send, time.time_ns(),
                            **{"encdis.image_index": p.index, "encdis.colocated": session is not None})
        finally:
            for i in claimed:  # not finished: waiting calls compute it themselves
                cache.abandon(digests[i])
            for fut in futures.values():  # a cancelled call: images still queued are skipped by the batcher
                fut.cancel()

    async def _submit(self, model: LoadedModel, images, indices: list[int], lo: int, hi: int, accepted_at: float,
                      span: Span, futures: dict, prepared: dict) -> None:
        """Reserve, preprocess and queue images[i] for i in `indices`; their futures go into `futures`."""
        if not indices:
            return
        pre = model.preprocessor
        headers = [pre.inspect(i, images[i]) for i in indices]
        reserved = sum(pre.num_patches(h, lo, hi) for h in headers)
        model.batcher.admit(reserved)  # patches this call holds that the batcher does not own yet
        try:
            loop = asyncio.get_running_loop()
            t_pre = time.time_ns()
            with self._decoding.hold(sum(h.width * h.height for h in headers)):
                done = await asyncio.gather(*(
                    loop.run_in_executor(model.preprocess_pool, self._timed_prepare, pre, i, images[i], lo, hi)
                    for i in indices
                ))
            pre_span = record_span(self.tracing.tracer, span, "encdis.encoder.preprocess", t_pre, time.time_ns(),
                                   **{"encdis.images": len(done)})
            for p in done:  # the rest of each image's preprocessing is the image processor's
                record_span(self.tracing.tracer, pre_span, "encdis.encoder.decode", *p.decode_ns,
                            **{"encdis.image_index": p.index})
            for p in done:
                prepared[p.index] = p
                futures[p.index] = model.batcher.submit(p, accepted_at)
            # The batcher now owns each submitted image's (actual) patches.
            model.batcher.release(reserved - sum(p.num_patches for p in done))
            reserved = 0
        finally:
            if reserved:
                model.batcher.release(reserved)

    def _timed_prepare(self, pre: ImagePreprocessor, index: int, data: bytes, lo: int, hi: int):
        t0 = time.monotonic()
        out = pre.prepare(index, data, lo, hi)
        self.metrics.preprocess_seconds.observe(time.monotonic() - t0)
        return out
