"""The coordinator: turns a request's images into embeddings using the encoder pool.

Interface (what the LLM node's front doors call):

    coord = Coordinator(settings, registry, weights_fingerprint=fp, hidden_size=h, processor=cfg)
    # or Coordinator.from_checkpoint(settings, registry, model_dir)
    await coord.start()
    result = await coord.encode(images)      # EncodeResult; result.images[i].embeds (tokens, hidden)
    coord.encoders()                         # list[EncoderStatus], for ListEncoders
    await coord.stop()

Flow of one request:
  1. size from each image's header (encdis.image_header) -> patch count (patches.py:
     transformers' smart_resize), and its content digest (image bytes + the checkpoint's
     resize bounds + the LLM checkpoint's weights fingerprint); a bad image fails the request
     here, before any encoding: InvalidArgument naming its index;
  2. cached images are done; images another request is already encoding are awaited
     (encoded once); the rest are claimed by this request;
  3. the claimed ones are dispatched (dispatch.py: assignment, one Encode stream per
     encoder, checks, retries on other encoders); the request fails only when no encoder
     can serve it: Unavailable("no encoder can serve this request: ...").
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from encdis.client.errors import InvalidArgument, Unavailable
from encdis.client.wire import content_digest

from .dispatch import Dispatcher, PendingImage, RequestTiming
from .embedding_cache import ClaimAbandoned, EmbeddingCache
from .identity import ModelIdentity
from .metrics import CoordinatorMetrics
from .pool import EncoderPool, states_count
from .records import EncodeResult, EncoderStatus, ImageEmbedding

log = logging.getLogger(__name__)

# Requests with more image bytes than this hash and probe them off the event loop.
OFFLOAD_BYTES = 1 << 20


@dataclass(frozen=True)
class CoordinatorSettings:
    """The coordinator's knobs; `from_settings` reads them off the LLM node's settings by name."""

    encoders: tuple[str, ...] = ()
    dns_server: str | None = None
    dns_refresh_seconds: float = 10.0
    cache_bytes: int = 256 * 1024 * 1024
    max_retries: int = 3
    encode_timeout_seconds: float = 120.0
    # A request finding no SERVING encoder waits this long for encoders still connecting or
    # being re-checked after a failure, then fails with UNAVAILABLE.
    encoder_wait_seconds: float = 10.0
    describe_timeout_seconds: float = 10.0
    image_loader: str = "vllm"  # what encoders must use (encoder_node/image_loader.py); part of the digest

    @classmethod
    def from_settings(cls, settings: Any) -> CoordinatorSettings:
        if isinstance(settings, cls):
            return settings
        defaults = cls()
        values = {f: getattr(settings, f, getattr(defaults, f)) for f in cls.__dataclass_fields__}
        values["encoders"] = tuple(values["encoders"])
        return cls(**values)


class Coordinator:
    """Images -> embeddings over the encoder pool, with cache, assignment and retries."""

    def __init__(
        self,
        settings: Any,
        registry: CollectorRegistry | None = None,
        *,
        weights_fingerprint: str,
        hidden_size: int,
        processor: Mapping[str, Any],
    ) -> None:
        self.settings = CoordinatorSettings.from_settings(settings)
        self.weights_fingerprint = weights_fingerprint
        self.hidden_size = int(hidden_size)
        self.identity = ModelIdentity.from_processor(weights_fingerprint, self.hidden_size, processor,
                                                     self.settings.image_loader)
        self.metrics = CoordinatorMetrics(registry if registry is not None else CollectorRegistry())
        self.cache = EmbeddingCache(self.settings.cache_bytes)
        self.pool: EncoderPool | None = None
        self._dispatcher: Dispatcher | None = None

    @classmethod
    def from_checkpoint(cls, settings: Any, registry: CollectorRegistry | None,
                        model_dir: str | os.PathLike) -> Coordinator:
        """A coordinator for the checkpoint in `model_dir` (fingerprint, hidden size, processor)."""
        from encdis.checkpoint import read_processor_config, text_hidden_size, weights_fingerprint

        return cls(settings, registry, weights_fingerprint=weights_fingerprint(model_dir),
                   hidden_size=text_hidden_size(model_dir), processor=read_processor_config(model_dir))

    async def start(self) -> None:
        from .cost_model import CostModel
        from .discovery import Resolver

        s = self.settings
        if not s.encoders:
            log.warning("no encoders configured: every request with images will fail with UNAVAILABLE")
        self.pool = EncoderPool(
            s.encoders,
            self.identity,
            cost_model_factory=CostModel.prior,
            resolver=Resolver(s.dns_server),
            refresh_seconds=s.dns_refresh_seconds,
            describe_timeout=s.describe_timeout_seconds,
            on_change=self._update_state_gauge,
            on_remove=self.metrics.forget_encoder,
        )
        self._dispatcher = Dispatcher(s, self.pool, self.cache, self.metrics, hidden_size=self.hidden_size,
                                      min_pixels=self.identity.min_pixels, max_pixels=self.identity.max_pixels)
        # Import transformers' smart_resize now, not inside the first request.
        await asyncio.to_thread(self._patches, 448, 448)
        await self.pool.start()

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.stop()

    def encoders(self) -> list[EncoderStatus]:
        if self.pool is None:
            return []
        return [
            EncoderStatus(
                address=h.address, name=h.name, state=h.state.value, reason=h.reason,
                backlog_seconds=self.pool.backlog_seconds(h), backlog_patches=self.pool.backlog_patches(h),
                patches_per_second=h.cost_model.patches_per_second, assigned_patches=h.assigned_patches,
                assigned_images=h.assigned_images,
            )
            for h in self.pool.encoders()
        ]

    # -- one request -----------------------------------------------------------------

    async def encode(self, images: Sequence[bytes]) -> EncodeResult:
        """Embeddings of `images`, in order. Raises InvalidArgument (names the image) or Unavailable."""
        if self._dispatcher is None:
            raise Unavailable("the coordinator is not started")
        t0 = time.perf_counter()
        if sum(len(img) for img in images) > OFFLOAD_BYTES:
            digests, patches = await asyncio.to_thread(self._digest_and_probe, images)
        else:
            digests, patches = self._digest_and_probe(images)
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
                    owned.append(PendingImage(i, d, patches[i]))
                    cached[i] = False
                    self.metrics.cache_misses.inc()
                else:
                    self.metrics.cache_hits.inc()
                waits[i] = fut
            todo = []
            if owned:
                await self._encode_owned(images, owned, timing)
            for i, fut in waits.items():
                try:
                    results[i] = await asyncio.shield(fut)
                except ClaimAbandoned:
                    todo.append(i)  # its encoder request went away: encode it ourselves
                except InvalidArgument as e:
                    raise InvalidArgument(f"image {i}: {e.message}") from None
        self.metrics.cache_bytes.set(self.cache.size_bytes)
        return EncodeResult(
            images=[r for r in results if r is not None],
            cached=cached,
            queue_seconds=timing.wait + timing.queue,
            encode_seconds=timing.encode,
            transfer_seconds=timing.transfer,
            wall_seconds=time.perf_counter() - t0,
            retries=timing.retries,
        )

    def image_tokens(self, images: Sequence[bytes]) -> list[int]:
        """Embedding rows each image will have, from its header alone (cheap: no decoding, no
        encoder); InvalidArgument naming the first bad image. For checks before any encoding."""
        from encdis.image_header import read_header

        tokens = []
        for i, img in enumerate(images):
            try:
                header = read_header(bytes(img))
                tokens.append(self._patches(header.width, header.height) // self.identity.merge_size ** 2)
            except ValueError as e:
                raise InvalidArgument(f"image {i}: {e}") from None
        return tokens

    def _patches(self, width: int, height: int) -> int:
        from .patches import patches_for_image

        ident = self.identity
        return patches_for_image(width, height, min_pixels=ident.min_pixels, max_pixels=ident.max_pixels,
                                 patch_size=ident.patch_size, merge_size=ident.merge_size,
                                 temporal_patch_size=ident.temporal_patch_size)

    def _digest_and_probe(self, images: Sequence[bytes]) -> tuple[list[str], list[int]]:
        """Content digest and patch count of every image; InvalidArgument for the first bad one."""
        from encdis.image_header import read_header

        ident = self.identity
        digests, patches = [], []
        for i, img in enumerate(images):
            data = bytes(img)
            try:
                header = read_header(data)
                patches.append(self._patches(header.width, header.height))
            except ValueError as e:
                raise InvalidArgument(f"image {i}: {e}") from None
            digests.append(content_digest(data, ident.min_pixels, ident.max_pixels, self.weights_fingerprint,
                                          ident.image_loader))
        return digests, patches

    async def _encode_owned(self, images: Sequence[bytes], jobs: list[PendingImage], timing: RequestTiming) -> None:
        """Encode the images this request claimed; every claim ends fulfilled or failed."""
        assert self._dispatcher is not None
        remaining: dict[int, PendingImage] = {j.index: j for j in jobs}
        try:
            await self._dispatcher.run(images, remaining, timing)
        except BaseException as e:
            for job in remaining.values():
                # The image that was bad is bad for everyone; the others are not: waiters retry them.
                if isinstance(e, InvalidArgument) and getattr(e, "bad_index", None) == job.index:
                    self.cache.fail(job.digest, InvalidArgument(getattr(e, "bare_reason", e.message)))
                else:
                    self.cache.fail(job.digest, ClaimAbandoned())
            raise

    def _update_state_gauge(self) -> None:
        if self.pool is None:
            return
        for state, n in states_count(self.pool.encoders()).items():
            self.metrics.encoders.labels(state).set(n)
