"""The coordinator: turns a request's images into embeddings using the encoder pool.

Interface (what the LLM node's front doors call):

    coord = Coordinator(settings, registry, weights_fingerprint=fp, hidden_size=h, processor=cfg)
    # or Coordinator.from_checkpoint(settings, registry, model_dir)
    await coord.start()
    grids = coord.image_grids(images)        # from headers: the checks before any work (no decode)
    result = await coord.encode(images, deadline=None, grids=grids)  # EncodeResult; .images[i].embeds
                                             # deadline: time.monotonic() seconds the caller waits until
    coord.encoders()                         # list[EncoderStatus], for ListEncoders
    await coord.stop()

Flow of one request:
  1. size from each image's header (encdis.image_header) -> patch grid (patches.py:
     transformers' smart_resize) and so the embedding rows an encoder must send, and its
     content digest (image bytes + the checkpoint's
     resize bounds + the LLM checkpoint's weights fingerprint); a bad image fails the request
     here, before any encoding: InvalidArgument naming its index;
  2. cached images are done; images another request is already encoding are awaited
     (encoded once); the rest are claimed by this request;
  3. the claimed ones are dispatched (dispatch.py: assignment, one Encode stream per
     encoder, checks against what step 1 predicts, per-attempt bounds, quarantine of
     encoders that misbehave, retries on other encoders); the request fails only when no
     encoder can serve it: Unavailable("no encoder can serve this request: ..."), or when
     the caller's deadline passes: DeadlineExceeded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from encdis.client.channels import ChannelSecurity
from encdis.client.errors import DeadlineExceeded, InvalidArgument, Unavailable
from encdis.client.wire import Allocate, content_digest
from encdis.image_header import ImageHeader
from encdis.tracing import Tracing, record_span

from .colocated import ColocatedTransport
from .dispatch import Dispatcher
from .embedding_cache import ClaimAbandoned, EmbeddingCache
from .expectation import PendingImage
from .handle import EncoderHandle, keepalive_options
from .identity import ModelIdentity, expected_tower_impl
from .metrics import CoordinatorMetrics
from .penalty import BackoffSchedule
from .pool import EncoderPool, states_count
from .records import EncodeResult, EncoderStatus, ImageEmbedding, RequestTiming
from .settings import CoordinatorSettings

log = logging.getLogger(__name__)

# Requests with more image bytes than this hash and probe them off the event loop.
OFFLOAD_BYTES = 1 << 20


class Coordinator:
    """Images -> embeddings over the encoder pool, with cache, assignment and retries."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        registry: CollectorRegistry | None = None,
        *,
        weights_fingerprint: str,
        hidden_size: int,
        processor: Mapping[str, Any],
        channel_security: ChannelSecurity | None = None,  # TLS / API key to encoders
    ) -> None:
        if settings.encoder_datatype == "auto":
            raise ValueError("the coordinator needs a concrete encoder datatype (the LLM node resolves auto to "
                             "its engine's)")
        self.settings = settings
        self.channel_security = channel_security
        self.weights_fingerprint = weights_fingerprint
        self.hidden_size = int(hidden_size)
        self.identity = ModelIdentity.from_processor(
            weights_fingerprint, self.hidden_size, processor, self.settings.image_loader,
            self.settings.encoder_datatype,
            expected_tower_impl(self.settings.encoder_tower_impl, self.settings.encoder_datatype))
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = CoordinatorMetrics(self.registry)
        self.cache = EmbeddingCache(self.settings.cache_bytes)
        self.pool: EncoderPool | None = None
        self._dispatcher: Dispatcher | None = None
        self.colocated: ColocatedTransport | None = None
        self.tracing = Tracing()  # off; the node sets its own before start()
        # Where embeddings are received (the node's shared region; None: the heap); set before start().
        self.receive_buffers: Allocate | None = None

    @classmethod
    def from_checkpoint(cls, settings: CoordinatorSettings, registry: CollectorRegistry | None,
                        model_dir: str | os.PathLike, channel_security: ChannelSecurity | None = None) -> Coordinator:
        """A coordinator for the checkpoint in `model_dir` (fingerprint, hidden size, processor)."""
        from encdis.checkpoint import read_processor_config, text_hidden_size, weights_fingerprint

        return cls(settings, registry, weights_fingerprint=weights_fingerprint(model_dir),
                   hidden_size=text_hidden_size(model_dir), processor=read_processor_config(model_dir),
                   channel_security=channel_security)

    async def start(self) -> None:
        from .cost_model import CostModel
        from .discovery import Resolver

        s = self.settings
        if not s.encoders:
            log.warning("no encoders configured: every request with images will fail with UNAVAILABLE")
        self.colocated = ColocatedTransport(s.colocated, s.colocated_timeout_seconds, self.registry)
        self.colocated.receive_buffers = self.receive_buffers
        self.pool = EncoderPool(
            s.encoders,
            self.identity,
            cost_model_factory=CostModel.prior,
            resolver=Resolver(s.dns_server),
            refresh_seconds=s.dns_refresh_seconds,
            describe_timeout=s.describe_timeout_seconds,
            on_change=self._update_state_gauge,
            on_remove=self._forget_encoder,
            quarantine=BackoffSchedule(s.quarantine_seconds, s.quarantine_max_seconds),
            slow=BackoffSchedule(s.slow_seconds, s.slow_max_seconds),
            busy_seconds=s.busy_seconds,
            channel_options=keepalive_options(s.keepalive_time_seconds, s.keepalive_timeout_seconds),
            channel_security=self.channel_security,
            on_described=self.colocated.on_described if s.colocated != "off" else None,
            load_reports=s.load_reports == "on",
            report_interval=s.load_report_interval_seconds,
            report_max_age=s.load_report_max_age_seconds,
        )
        self._dispatcher = Dispatcher(s, self.pool, self.cache, self.metrics, hidden_size=self.hidden_size,
                                      min_pixels=self.identity.min_pixels, max_pixels=self.identity.max_pixels,
                                      colocated=self.colocated)
        self._dispatcher.tracing = self.tracing
        self._dispatcher.receive_buffers = self.receive_buffers
        # Import transformers' smart_resize now, not inside the first request.
        await asyncio.to_thread(self._grid, 448, 448)
        await self.pool.start()

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.stop()
        if self.colocated is not None:
            await self.colocated.close()
        if self._dispatcher is not None:
            self._dispatcher.close()

    def _forget_encoder(self, address: str) -> None:
        self.metrics.forget_encoder(address)
        if self._dispatcher is not None:
            self._dispatcher.affinity.held.forget(address)
        if self.colocated is not None:
            self.colocated.forget(address)

    def encoders(self) -> list[EncoderStatus]:
        if self.pool is None:
            return []
        now = time.monotonic()
        return [self._status(h, now) for h in self.pool.encoders()]

    def _status(self, h: EncoderHandle, now: float) -> EncoderStatus:
        assert self.pool is not None
        report = h.reports.latest if h.reports is not None else None
        return EncoderStatus(
            address=h.address, name=h.name, state=h.state.value, reason=h.reason,
            backlog_seconds=self.pool.backlog_seconds(h), backlog_patches=self.pool.backlog_patches(h),
            patches_per_second=h.cost_model.patches_per_second, assigned_patches=h.assigned_patches,
            assigned_images=h.assigned_images,
            backoff_seconds=h.penalty.seconds if h.penalty else 0.0,
            faults=h.penalty.faults if h.penalty else 0,
            backoff_remaining_seconds=max(0.0, h.penalty.until - now) if h.penalty else 0.0,
            has_report=report is not None,
            report_age_seconds=report.age(now) if report else 0.0,
            report_queued_patches=report.queued_patches if report else 0.0,
            report_images_in_flight=report.images_in_flight if report else 0.0,
            report_drain_seconds=report.drain_seconds if report else 0.0,
            report_utilization=report.utilization if report else 0.0,
            lateness_seconds=h.lateness.seconds(now),
        )

    # -- one request -----------------------------------------------------------------

    async def encode(self, images: Sequence[bytes], *, deadline: float | None = None,
                     grids: Sequence[tuple[int, int, int]] | None = None,
                     digests: Sequence[str] | None = None) -> EncodeResult:
        """Embeddings of `images`, in order. Raises InvalidArgument (names the image), Unavailable,
        or DeadlineExceeded once `deadline` (time.monotonic() seconds; None: none) has passed.
        `grids`, `digests`: what image_grids(images) and digests(images) already gave (a caller
        that probes the images off the loop hashes them there too), so no image is probed twice.
        One span per request (a child of the caller's current span), one per image."""
        tracer = self.tracing.tracer
        attributes = {"encdis.images": len(images)}
        with tracer.start_as_current_span("encdis.coordinator.encode", attributes=attributes) as span:
            result = await self._encode(images, deadline, grids, digests)
            span.set_attributes({"encdis.cached_images": sum(result.cached), "encdis.retries": result.retries})
            if span.is_recording():
                for i, hit in enumerate(result.cached):
                    if hit:  # the misses' spans come from the encoder calls (dispatch.py)
                        record_span(tracer, span, "encdis.coordinator.image", span.start_time, time.time_ns(),
                                    **{"encdis.image_index": i, "encdis.cache": "hit"})
            return result

    async def _encode(self, images: Sequence[bytes], deadline: float | None,
                      grids: Sequence[tuple[int, int, int]] | None, digests: Sequence[str] | None) -> EncodeResult:
        if self._dispatcher is None:
            raise Unavailable("the coordinator is not started")
        t0 = time.perf_counter()
        if grids is None:
            grids = self.image_grids(images)
        elif len(grids) != len(images):
            raise ValueError(f"{len(grids)} grids for {len(images)} images")
        if digests is None:
            # Hashing megabytes takes milliseconds: off the event loop beyond a small total.
            if sum(len(img) for img in images) > OFFLOAD_BYTES:
                digests = await asyncio.to_thread(self.digests, images)
            else:
                digests = self.digests(images)
        elif len(digests) != len(images):
            raise ValueError(f"{len(digests)} digests for {len(images)} images")
        timing = RequestTiming()
        results: list[ImageEmbedding | None] = [None] * len(images)
        cached = [True] * len(images)
        todo = list(range(len(images)))
        while todo:
            owned: list[PendingImage] = []
            waits: dict[int, asyncio.Future[ImageEmbedding]] = {}
            for i in todo:
                d = digests[i]
                entry = self.cache.get(d)
                if entry is not None:
                    results[i] = entry
                    self.metrics.cache_hits.inc()
                    continue
                fut = self.cache.pending(d)
                if fut is None:
                    fut = self.cache.claim(d)
                    owned.append(PendingImage(i, d, grids[i], self.grid_tokens(grids[i])))
                    cached[i] = False
                    self.metrics.cache_misses.inc()
                else:
                    self.metrics.cache_hits.inc()
                waits[i] = fut
            todo = []
            if owned:
                await self._encode_owned(images, owned, timing, deadline)
            for i, fut in waits.items():
                try:
                    results[i] = await _await_shared(fut, deadline, i)
                except ClaimAbandoned:
                    todo.append(i)  # its encoder request went away: encode it ourselves
                except InvalidArgument as e:
                    raise InvalidArgument.for_image(i, e.message, reason=e.reason) from None
        self.metrics.cache_bytes.set(self.cache.size_bytes)
        wall = time.perf_counter() - t0
        self.metrics.request_embeddings_seconds.observe(wall)
        return EncodeResult(
            images=[r for r in results if r is not None],
            cached=cached,
            queue_seconds=timing.wait + timing.queue - timing.preprocess,
            preprocess_seconds=timing.preprocess,
            encode_seconds=timing.encode,
            transfer_seconds=timing.transfer,
            wall_seconds=wall,
            retries=timing.retries,
        )

    def image_grids(self, images: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """The patch grid (t, h, w) each image will have, from its header alone (no pixel decoded,
        no encoder); InvalidArgument naming the first bad image. For checks before any encoding;
        pass the result to encode()."""
        from encdis.image_header import read_header

        grids = []
        for i, img in enumerate(images):
            try:
                grids.append(self._header_grid(read_header(bytes(img))))
            except ValueError as e:
                raise InvalidArgument.for_image(i, str(e)) from None
        return grids

    def grid_tokens(self, grid: tuple[int, int, int]) -> int:
        """Embedding rows of an image with this patch grid."""
        t, h, w = grid
        return t * h * w // self.identity.merge_size ** 2

    def _header_grid(self, header: ImageHeader) -> tuple[int, int, int]:
        """The grid the encoder will give: vLLM's loader turns EXIF-rotated images upright first."""
        if self.identity.image_loader == "vllm":
            return self._grid(*header.upright_size)
        return self._grid(header.width, header.height)

    def _grid(self, width: int, height: int) -> tuple[int, int, int]:
        from .patches import grid_for_image

        ident = self.identity
        return grid_for_image(width, height, min_pixels=ident.min_pixels, max_pixels=ident.max_pixels,
                              patch_size=ident.patch_size, merge_size=ident.merge_size,
                              temporal_patch_size=ident.temporal_patch_size)

    def digests(self, images: Sequence[bytes]) -> list[str]:
        """Content digest of every image (the cache key and vLLM's multimodal uuid)."""
        ident = self.identity
        return [content_digest(bytes(img), ident.min_pixels, ident.max_pixels, self.weights_fingerprint,
                               ident.image_loader, ident.datatype, ident.tower_impl) for img in images]

    async def _encode_owned(self, images: Sequence[bytes], jobs: list[PendingImage], timing: RequestTiming,
                            deadline: float | None) -> None:
        """Encode the images this request claimed; every claim ends fulfilled or failed."""
        assert self._dispatcher is not None
        remaining: dict[int, PendingImage] = {j.index: j for j in jobs}
        try:
            await self._dispatcher.run(images, remaining, timing, deadline)
        except BaseException as e:
            for job in remaining.values():
                # The image that was bad is bad for everyone; the others are not: waiters retry them.
                if isinstance(e, InvalidArgument) and e.image_index == job.index:
                    self.cache.fail(job.digest, InvalidArgument(e.image_reason or e.message, reason=e.reason))
                else:
                    self.cache.fail(job.digest, ClaimAbandoned())
            raise

    def _update_state_gauge(self) -> None:
        if self.pool is None:
            return
        for state, n in states_count(self.pool.encoders()).items():
            self.metrics.encoders.labels(state).set(n)


async def _await_shared(fut: asyncio.Future[ImageEmbedding], deadline: float | None, index: int) -> ImageEmbedding:
    """An image's embedding from the cache's future, waiting at most until `deadline`; the
    future is shielded: another request may own the encode and still want it."""
    if deadline is None:
        return await asyncio.shield(fut)
    try:
        return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - time.monotonic()))
    except (TimeoutError, asyncio.TimeoutError):
        raise DeadlineExceeded(f"the request's deadline passed waiting for image {index}, "
                               f"which another request is encoding") from None
