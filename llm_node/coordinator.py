"""The coordinator: turns a request's images into embeddings using the encoder pool.

Interface (what the LLM node's servicer/engine code calls):

    coord = Coordinator(settings, registry, weights_fingerprint=fp, hidden_size=h, processor=cfg)
    # or Coordinator.from_checkpoint(settings, registry, model_dir)
    await coord.start()
    result = await coord.encode(images)      # EncodeResult; result.images[i].embeds (tokens, hidden)
    coord.encoders()                         # list[EncoderStatus], for ListEncoders
    await coord.stop()

Flow of one request:
  1. size from each image's header -> patch count (transformers' smart_resize via
     llm_node/patches.py), and its content digest (image bytes + the checkpoint's resize
     bounds + the LLM checkpoint's weights fingerprint); a bad image fails the request here,
     before any encoding: InvalidArgument naming its index;
  2. cached images are done; images another request is already encoding are awaited
     (encoded once); the rest are claimed by this request;
  3. assign (llm_node/assignment.py: decreasing cost, earliest predicted finish over the
     SERVING encoders' cost models and backlogs), one Encode stream per encoder;
  4. each embedding as it arrives -> torch tensor (torch.frombuffer, never pickle) -> cache;
     each distinct batch timing -> that encoder's cost model;
  5. a failed call (UNAVAILABLE, reset, DEADLINE_EXCEEDED, broken stream): the images not yet
     received go to other encoders, each at most `max_retries` times; INVALID_ARGUMENT is
     not retried and names the image in the request's numbering. The request fails only
     when no encoder can serve it: Unavailable("no encoder can serve this request: ...").

Timing of a request: queue_seconds (waiting for an encoder and in the encoders' queues),
encode_seconds (the longest tower forward among its batches) and transfer_seconds (the rest
of the wall time: the wire, decoding, bookkeeping); they add up to wall_seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from encdis.client.errors import (
    EncdisError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    WireError,
)
from encdis.client.wire import Embedding, content_digest

from .embedding_cache import CachedEmbedding, ClaimAbandoned, EmbeddingCache
from .pool import EncoderHandle, EncoderPool, EncoderState, ModelIdentity, states_count

log = logging.getLogger(__name__)

_IMAGE_INDEX = re.compile(r"\bimage (\d+)")
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

    @classmethod
    def from_settings(cls, settings: Any) -> CoordinatorSettings:
        if isinstance(settings, cls):
            return settings
        defaults = cls()
        values = {f: getattr(settings, f, getattr(defaults, f)) for f in cls.__dataclass_fields__}
        values["encoders"] = tuple(values["encoders"])
        return cls(**values)


@dataclass(frozen=True)
class EncodedImage:
    embeds: Any = field(repr=False)  # torch.Tensor (num_tokens, hidden_size); shared with the cache: read-only
    grid_thw: tuple[int, int, int]
    digest: str  # content digest; also vLLM's multimodal uuid
    cached: bool  # True when no encode was done for it in this request


@dataclass(frozen=True)
class EncodeResult:
    images: list[EncodedImage]
    queue_seconds: float = 0.0
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


@dataclass(frozen=True)
class _Job:
    index: int  # in the request's numbering
    digest: str
    patches: int


@dataclass
class _Timing:
    wait: float = 0.0  # for a SERVING encoder, in the coordinator
    queue: float = 0.0  # longest time an image sat in an encoder's queue
    encode: float = 0.0
    retries: int = 0


@dataclass
class _CallFailure:
    handle: EncoderHandle
    error: EncdisError
    jobs: list[_Job] = field(default_factory=list)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.assignments = Counter("encdis_coordinator_assignments_total", "Images assigned to an encoder",
                                   ["encoder"], registry=registry)
        self.assigned_patches = Counter("encdis_coordinator_assigned_patches_total",
                                        "Patches assigned to an encoder", ["encoder"], registry=registry)
        self.retries = Counter("encdis_coordinator_retries_total",
                               "Images re-sent to another encoder after a failed call", registry=registry)
        self.cache_hits = Counter("encdis_coordinator_cache_hits_total",
                                  "Images served from the embedding cache or an identical in-flight encode",
                                  registry=registry)
        self.cache_misses = Counter("encdis_coordinator_cache_misses_total", "Images that needed an encode",
                                    registry=registry)
        self.encoders = Gauge("encdis_coordinator_encoders", "Encoders in the pool by state", ["state"],
                              registry=registry)
        self.cache_bytes = Gauge("encdis_coordinator_cache_bytes", "Bytes held by the embedding cache",
                                 registry=registry)

    def forget_encoder(self, address: str) -> None:
        """Drop a departed encoder's series: DNS churn must not grow label cardinality forever."""
        for counter in (self.assignments, self.assigned_patches):
            with contextlib.suppress(KeyError):
                counter.remove(address)


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
        self.identity = _identity(weights_fingerprint, self.hidden_size, processor)
        self.metrics = _Metrics(registry if registry is not None else CollectorRegistry())
        self.cache = EmbeddingCache(self.settings.cache_bytes)
        self.pool: EncoderPool | None = None
        # Idle encoders tie on predicted finish and assign() then picks the first: rotating
        # the candidates' order per dispatch spreads ties instead of favouring one encoder.
        self._rotation = 0

    @classmethod
    def from_checkpoint(cls, settings: Any, registry: CollectorRegistry | None,
                        model_dir: str | os.PathLike) -> Coordinator:
        """A coordinator for the checkpoint in `model_dir` (fingerprint, hidden size, processor)."""
        from encdis.checkpoint import read_processor_config, text_hidden_size, weights_fingerprint

        return cls(settings, registry, weights_fingerprint=weights_fingerprint(model_dir),
                   hidden_size=text_hidden_size(model_dir), processor=read_processor_config(model_dir))

    async def start(self) -> None:
        from .cost_model import CostModel
        from .dns_resolver import Resolver

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
        # Import transformers' smart_resize now, not inside the first request.
        await asyncio.to_thread(self._warm_up)
        await self.pool.start()

    def _warm_up(self) -> None:
        from .patches import patches_for_image

        ident = self.identity
        patches_for_image(448, 448, min_pixels=ident.min_pixels, max_pixels=ident.max_pixels,
                          patch_size=ident.patch_size, merge_size=ident.merge_size,
                          temporal_patch_size=ident.temporal_patch_size)

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
                patches_per_second=_speed(h.cost_model), assigned_patches=h.assigned_patches,
                assigned_images=h.assigned_images,
            )
            for h in self.pool.encoders()
        ]

    # -- one request -----------------------------------------------------------------

    async def encode(self, images: Sequence[bytes]) -> EncodeResult:
        """Embeddings of `images`, in order. Raises InvalidArgument (names the image) or Unavailable."""
        if self.pool is None:
            raise Unavailable("the coordinator is not started")
        t0 = time.perf_counter()
        if sum(len(img) for img in images) > OFFLOAD_BYTES:
            digests, patches = await asyncio.to_thread(self._digest_and_probe, images)
        else:
            digests, patches = self._digest_and_probe(images)
        timing = _Timing()
        results: list[EncodedImage | None] = [None] * len(images)
        todo = list(range(len(images)))
        while todo:
            owned: list[_Job] = []
            waits: dict[int, asyncio.Future[CachedEmbedding]] = {}
            for i in todo:
                d = digests[i]
                entry = self.cache.get(d)
                if entry is not None:
                    results[i] = EncodedImage(entry.embeds, entry.grid_thw, d, cached=True)
                    self.metrics.cache_hits.inc()
                    continue
                fut = self.cache.pending(d)
                if fut is None:
                    fut = self.cache.claim(d)
                    owned.append(_Job(i, d, patches[i]))
                    self.metrics.cache_misses.inc()
                else:
                    self.metrics.cache_hits.inc()
                waits[i] = fut
            todo = []
            if owned:
                await self._encode_owned(images, owned, timing)
            owned_indices = {j.index for j in owned}
            for i, fut in waits.items():
                try:
                    entry = await asyncio.shield(fut)
                except ClaimAbandoned:
                    todo.append(i)  # its encoder request went away: encode it ourselves
                    continue
                except InvalidArgument as e:
                    raise InvalidArgument(f"image {i}: {e.message}") from None
                results[i] = EncodedImage(entry.embeds, entry.grid_thw, entry.digest, cached=i not in owned_indices)
        self.metrics.cache_bytes.set(self.cache.size_bytes)
        wall = time.perf_counter() - t0
        queue = min(timing.wait + timing.queue, wall)
        encode = min(timing.encode, wall - queue)
        return EncodeResult(
            images=[r for r in results if r is not None],
            queue_seconds=queue,
            encode_seconds=encode,
            transfer_seconds=max(0.0, wall - queue - encode),
            wall_seconds=wall,
            retries=timing.retries,
        )

    def _digest_and_probe(self, images: Sequence[bytes]) -> tuple[list[str], list[int]]:
        """Content digest and patch count of every image; InvalidArgument for the first bad one."""
        from .patches import image_size_from_header, patches_for_image

        ident = self.identity
        digests, patches = [], []
        for i, img in enumerate(images):
            data = bytes(img)
            try:
                w, h = image_size_from_header(data)
                patches.append(patches_for_image(
                    w, h, min_pixels=ident.min_pixels, max_pixels=ident.max_pixels, patch_size=ident.patch_size,
                    merge_size=ident.merge_size, temporal_patch_size=ident.temporal_patch_size,
                ))
            except ValueError as e:
                raise InvalidArgument(f"image {i}: {e}") from None
            digests.append(content_digest(data, ident.min_pixels, ident.max_pixels, self.weights_fingerprint))
        return digests, patches

    async def _encode_owned(self, images: Sequence[bytes], jobs: list[_Job], timing: _Timing) -> None:
        """Encode the images this request claimed; every claim ends fulfilled or failed."""
        remaining: dict[int, _Job] = {j.index: j for j in jobs}
        try:
            await self._dispatch(images, remaining, timing)
        except BaseException as e:
            for job in remaining.values():
                # The image that was bad is bad for everyone; the others are not: waiters retry them.
                if isinstance(e, InvalidArgument) and getattr(e, "bad_index", None) == job.index:
                    self.cache.fail(job.digest, InvalidArgument(getattr(e, "bare_reason", e.message)))
                else:
                    self.cache.fail(job.digest, ClaimAbandoned())
            raise

    async def _dispatch(self, images: Sequence[bytes], remaining: dict[int, _Job], timing: _Timing) -> None:
        from .assignment import assign

        attempts = dict.fromkeys(remaining, 0)
        excluded: set[str] = set()  # encoders that already failed this request
        failures: list[str] = []
        while remaining:
            routable = await self._routable(timing, failures)
            candidates = [h for h in routable if h.address not in excluded] or routable
            self._rotation += 1
            shift = self._rotation % len(candidates)
            candidates = candidates[shift:] + candidates[:shift]
            order = sorted(remaining.values(), key=lambda j: j.index)
            picks = assign([j.patches for j in order], self.pool.loads(candidates))
            groups: dict[int, list[_Job]] = {}
            for job, k in zip(order, picks, strict=True):
                groups.setdefault(k, []).append(job)
            calls = []
            for k, group in groups.items():
                h = candidates[k]
                limit = (h.description.max_images_per_request if h.description else 0) or len(group)
                for start in range(0, len(group), limit):
                    calls.append((h, group[start:start + limit]))
            # Held from now (no await since `_routable`), so a DNS refresh cannot close them under us.
            for h, _ in calls:
                self.pool.acquire(h)
            try:
                outcomes = await _run_all([self._call(h, images, group, remaining, timing) for h, group in calls])
            finally:
                for h, _ in calls:
                    self.pool.release(h)
            for failure in outcomes:
                if failure is None:
                    continue
                h, err = failure.handle, failure.error
                excluded.add(h.address)
                left = [j for j in failure.jobs if j.index in remaining]
                failures.append(f"{h.address}: {err}")
                log.warning("encoder %s failed %d image(s) of a request: %s", h.address, len(left), err)
                for job in left:
                    attempts[job.index] += 1
                    if attempts[job.index] > self.settings.max_retries:
                        # Busy encoders are a different answer from broken ones: clients back off.
                        cls = ResourceExhausted if isinstance(err, ResourceExhausted) else Unavailable
                        what = "encoders are busy" if cls is ResourceExhausted else "no encoder can serve this request"
                        raise cls(
                            f"{what}: image {job.index} failed {attempts[job.index]} times "
                            f"(max_retries {self.settings.max_retries}); last errors: {'; '.join(failures[-3:])}; "
                            f"encoders: {self.pool.summary()}"
                        )
                timing.retries += len(left)
                self.metrics.retries.inc(len(left))
            if remaining and all(h.address in excluded for h in self.pool.serving()):
                # Every encoder failed this request once already: do not hammer them in a tight loop.
                pause = min(1.0, 0.05 * 2 ** max(attempts.values(), default=0))
                await asyncio.sleep(pause)
                timing.wait += pause

    async def _routable(self, timing: _Timing, failures: list[str]) -> list[EncoderHandle]:
        """The SERVING encoders, waiting (bounded) for ones still connecting or being re-checked."""
        assert self.pool is not None
        t0 = time.perf_counter()
        deadline = t0 + self.settings.encoder_wait_seconds
        try:
            while True:
                routable = self.pool.serving()
                if routable:
                    return routable
                settling = [h for h in self.pool.encoders()
                            if (h.settling or h.state is EncoderState.CONNECTING) and not h.gone]
                left = deadline - time.perf_counter()
                if not settling or left <= 0:
                    tail = f"; after failures: {'; '.join(failures[-3:])}" if failures else ""
                    raise Unavailable(f"no encoder can serve this request: {self.pool.summary()}{tail}")
                await self.pool.wait_changed(left)
        finally:
            timing.wait += time.perf_counter() - t0

    async def _call(self, h: EncoderHandle, images: Sequence[bytes], jobs: list[_Job],
                    remaining: dict[int, _Job], timing: _Timing) -> _CallFailure | None:
        """One Encode stream to `h`; None on success, a _CallFailure when others should retry."""
        assert self.pool is not None
        ident = self.identity
        tickets = []
        for j in jobs:
            tickets.append(self.pool.add_work(h, j.patches))
            self.metrics.assignments.labels(h.address).inc()
            self.metrics.assigned_patches.labels(h.address).inc(j.patches)
        done: set[int] = set()
        seen_batches: set[tuple[float, tuple[int, ...]]] = set()
        try:
            stream = h.client.encode_iter(
                [bytes(images[j.index]) for j in jobs], min_pixels=ident.min_pixels, max_pixels=ident.max_pixels,
                timeout=self.settings.encode_timeout_seconds,
            )
            async with contextlib.aclosing(stream):  # cancel the RPC at once if we stop reading
                async for emb in stream:
                    pos = emb.image_index
                    job = jobs[pos]
                    entry = self._check(h, emb, job)
                    done.add(pos)
                    self.pool.complete_work(tickets[pos])
                    remaining.pop(job.index, None)
                    self.cache.fulfil(entry)
                    timing.queue = max(timing.queue, emb.queue_seconds)
                    if emb.batch is not None:
                        timing.encode = max(timing.encode, emb.batch.seconds)
                        key = (emb.batch.seconds, emb.batch.image_patches)
                        if key not in seen_batches:
                            seen_batches.add(key)
                            h.cost_model.observe(list(emb.batch.image_patches), emb.batch.seconds)
            return None
        except InvalidArgument as e:
            raise _request_numbering(e, jobs) from None
        except FailedPrecondition as e:
            self.pool.report_failure(h, str(e), refuse=True)
            return _CallFailure(h, e, jobs)
        except ResourceExhausted as e:
            return _CallFailure(h, e, jobs)  # busy, not broken: just try elsewhere
        except EncdisError as e:
            if e.code.name != "INTERNAL":
                self.pool.report_failure(h, f"Encode failed: {e}")
            return _CallFailure(h, e, jobs)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the channel closed under us: retry elsewhere
            log.exception("Encode call to %s failed unexpectedly", h.address)
            self.pool.report_failure(h, f"Encode failed: {e!r}")
            return _CallFailure(h, Unavailable(repr(e)), jobs)
        finally:
            for pos, ticket in enumerate(tickets):
                if pos not in done:
                    self.pool.complete_work(ticket)

    def _check(self, h: EncoderHandle, emb: Embedding, job: _Job) -> CachedEmbedding:
        """The received embedding as a tensor, after checking it is the one we asked for."""
        if emb.shape[1] != self.hidden_size:
            raise FailedPrecondition(f"encoder sent hidden size {emb.shape[1]}, the LLM needs {self.hidden_size}")
        if emb.digest and emb.digest != job.digest:
            raise FailedPrecondition(
                f"encoder's digest {emb.digest[:16]}... for image {job.index} differs from ours "
                f"{job.digest[:16]}... (other weights or resize bounds)"
            )
        t, hh, w = emb.grid_thw
        if t * hh * w != job.patches:
            log.warning("encoder %s: image %d has %d patches, %d predicted from its header",
                        h.address, job.index, t * hh * w, job.patches)
        return CachedEmbedding(embeds=_to_tensor(emb), grid_thw=emb.grid_thw, digest=job.digest)

    def _update_state_gauge(self) -> None:
        if self.pool is None:
            return
        for state, n in states_count(self.pool.encoders()).items():
            self.metrics.encoders.labels(state).set(n)


# -- helpers ---------------------------------------------------------------------------


async def _run_all(calls: list) -> list[_CallFailure | None]:
    """Run the calls concurrently; on a fatal error (e.g. a bad image) cancel the rest and raise."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _request_numbering(e: InvalidArgument, jobs: list[_Job]) -> InvalidArgument:
    """The encoder's 'image <call index>: reason' renumbered to the request's image index."""
    m = _IMAGE_INDEX.search(e.message)
    if m is not None and int(m.group(1)) < len(jobs):
        job = jobs[int(m.group(1))]
        reason = (e.message[:m.start()] + e.message[m.end():]).lstrip(":; ").strip() or e.message
        out = InvalidArgument(f"image {job.index}: {reason}")
        out.bad_index, out.bare_reason = job.index, reason  # type: ignore[attr-defined]
        return out
    if len(jobs) == 1:
        out = InvalidArgument(f"image {jobs[0].index}: {e.message}")
        out.bad_index, out.bare_reason = jobs[0].index, e.message  # type: ignore[attr-defined]
        return out
    return InvalidArgument(f"one of images {[j.index for j in jobs]}: {e.message}")


def _to_tensor(emb: Embedding):
    import torch

    dtypes = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
    if emb.datatype not in dtypes:
        raise WireError(f"image {emb.image_index}: unknown datatype {emb.datatype!r}")
    with warnings.catch_warnings():
        # The bytes are ours alone and never written to; no copy needed.
        warnings.filterwarnings("ignore", message=".*buffer is not writable.*")
        t = torch.frombuffer(emb.data, dtype=dtypes[emb.datatype])
    return t.view(emb.shape[0], emb.shape[1])


def _speed(model: Any) -> float:
    v = getattr(model, "patches_per_second", 0.0)
    return float(v() if callable(v) else v)


def _identity(fingerprint: str, hidden_size: int, processor: Mapping[str, Any]) -> ModelIdentity:
    """The checkpoint's resize bounds and patch geometry (old- and new-style processor configs)."""
    cfg = dict(processor)
    size = cfg.get("size") or {}
    min_pixels = cfg.get("min_pixels") or size.get("shortest_edge")
    max_pixels = cfg.get("max_pixels") or size.get("longest_edge")
    if not min_pixels or not max_pixels:
        raise ValueError("the image processor config has neither min_pixels/max_pixels nor size bounds")
    return ModelIdentity(
        weights_fingerprint=fingerprint,
        hidden_size=hidden_size,
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
        patch_size=int(cfg.get("patch_size", 14)),
        merge_size=int(cfg.get("merge_size", 2)),
        temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
    )


__all__ = ["Coordinator", "CoordinatorSettings", "EncodeResult", "EncodedImage", "EncoderStatus", "EncoderState"]
