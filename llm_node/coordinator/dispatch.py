"""Dispatch: a request's uncached images onto encoders, one Encode stream per encoder, with retries.

Each round assigns the images still missing (assignment.assign: decreasing cost, earliest
predicted finish over the SERVING encoders' cost models and backlogs) and runs one Encode
stream per chosen encoder concurrently. Each embedding, as it arrives, is checked against
what was asked (hidden size, digest), turned into a tensor over the received bytes
(torch.frombuffer, never pickle) and handed to the cache; each batch timing goes to that
encoder's cost model. A failed call (UNAVAILABLE, reset, DEADLINE_EXCEEDED, broken stream):
the images not yet received go to other encoders, each at most `max_retries` times;
INVALID_ARGUMENT is not retried and names the image in the request's numbering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from encdis.client.errors import (
    EncdisError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    WireError,
)
from encdis.client.wire import DATATYPES, Embedding

from .assignment import assign
from .embedding_cache import EmbeddingCache
from .handle import EncoderHandle, EncoderState
from .metrics import CoordinatorMetrics
from .pool import EncoderPool
from .records import ImageEmbedding

if TYPE_CHECKING:
    import torch

    from .coordinator import CoordinatorSettings

log = logging.getLogger(__name__)

_IMAGE_INDEX = re.compile(r"\bimage (\d+)")


@dataclass(frozen=True)
class PendingImage:
    """An image this request must have encoded: its place in the request, key and size."""

    index: int  # in the request's numbering
    digest: str
    patches: int


@dataclass
class RequestTiming:
    """Where one request's encode time went, each part measured on its own."""

    wait: float = 0.0  # for a SERVING encoder, in the coordinator
    queue: float = 0.0  # longest time an image sat in an encoder's queue
    encode: float = 0.0  # longest forward among the request's batches
    transfer: float = 0.0  # longest receive of one embedding (header to last byte, as a tensor)
    retries: int = 0


@dataclass
class _CallFailure:
    handle: EncoderHandle
    error: EncdisError
    jobs: list[PendingImage] = field(default_factory=list)


class Dispatcher:
    """Runs the encode rounds of requests over one pool, cache and set of metrics."""

    def __init__(self, settings: CoordinatorSettings, pool: EncoderPool, cache: EmbeddingCache,
                 metrics: CoordinatorMetrics, *, hidden_size: int, min_pixels: int, max_pixels: int) -> None:
        self.settings = settings
        self.pool = pool
        self.cache = cache
        self.metrics = metrics
        self.hidden_size = hidden_size
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        # Idle encoders tie on predicted finish and assign() then picks the first: rotating
        # the candidates' order per round spreads ties instead of favouring one encoder.
        self._rotation = 0

    async def run(self, images: Sequence[bytes], remaining: dict[int, PendingImage], timing: RequestTiming) -> None:
        """Encode the `remaining` images into the cache, removing each as it arrives.

        Raises when one cannot be encoded anywhere; `remaining` then holds those not encoded.
        """
        attempts = dict.fromkeys(remaining, 0)
        excluded: set[str] = set()  # encoders that already failed this request
        failures: list[str] = []
        while remaining:
            routable = await self._routable(timing, failures)
            candidates = [h for h in routable if h.address not in excluded] or routable
            self._rotation += 1
            shift = self._rotation % len(candidates)
            candidates = candidates[shift:] + candidates[:shift]
            calls = self._plan(candidates, sorted(remaining.values(), key=lambda j: j.index))
            # Held from now (no await since `_routable`), so a DNS refresh cannot close them under us.
            for h, _ in calls:
                self.pool.acquire(h)
            try:
                outcomes = await _run_all([self._call(h, images, group, remaining, timing) for h, group in calls])
            finally:
                for h, _ in calls:
                    self.pool.release(h)
            for failure in outcomes:
                if failure is not None:
                    self._count_failure(failure, remaining, attempts, excluded, failures, timing)
            if remaining and all(h.address in excluded for h in self.pool.serving()):
                # Every encoder failed this request once already: do not hammer them in a tight loop.
                pause = min(1.0, 0.05 * 2 ** max(attempts.values(), default=0))
                await asyncio.sleep(pause)
                timing.wait += pause

    def _plan(self, candidates: list[EncoderHandle],
              order: list[PendingImage]) -> list[tuple[EncoderHandle, list[PendingImage]]]:
        """(encoder, images) per Encode call: the policy's choice, split by each encoder's image limit."""
        picks = assign([j.patches for j in order], self.pool.loads(candidates))
        groups: dict[int, list[PendingImage]] = {}
        for job, k in zip(order, picks, strict=True):
            groups.setdefault(k, []).append(job)
        calls = []
        for k, group in groups.items():
            h = candidates[k]
            limit = (h.description.max_images_per_request if h.description else 0) or len(group)
            for start in range(0, len(group), limit):
                calls.append((h, group[start:start + limit]))
        return calls

    def _count_failure(self, failure: _CallFailure, remaining: dict[int, PendingImage], attempts: dict[int, int],
                       excluded: set[str], failures: list[str], timing: RequestTiming) -> None:
        """Book a failed call's images for another round, or raise once one ran out of retries."""
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

    async def _routable(self, timing: RequestTiming, failures: list[str]) -> list[EncoderHandle]:
        """The SERVING encoders, waiting (bounded) for ones still connecting or being re-checked."""
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

    async def _call(self, h: EncoderHandle, images: Sequence[bytes], jobs: list[PendingImage],
                    remaining: dict[int, PendingImage], timing: RequestTiming) -> _CallFailure | None:
        """One Encode stream to `h`; None on success, a _CallFailure when others should retry."""
        tickets = []
        for j in jobs:
            tickets.append(self.pool.add_work(h, j.patches))
            self.metrics.assignments.labels(h.address).inc()
            self.metrics.assigned_patches.labels(h.address).inc(j.patches)
        done: set[int] = set()
        try:
            stream = h.client.encode_iter(
                [bytes(images[j.index]) for j in jobs], min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                timeout=self.settings.encode_timeout_seconds,
            )
            async with contextlib.aclosing(stream):  # cancel the RPC at once if we stop reading
                async for emb in stream:
                    pos = emb.image_index
                    job = jobs[pos]
                    t0 = time.perf_counter()
                    entry = self._check(emb, job)
                    timing.transfer = max(timing.transfer, emb.receive_seconds + time.perf_counter() - t0)
                    done.add(pos)
                    self.pool.complete_work(tickets[pos])
                    remaining.pop(job.index, None)
                    self.cache.fulfil(entry)
                    timing.queue = max(timing.queue, emb.queue_seconds)
                    if emb.batch is not None:
                        timing.encode = max(timing.encode, emb.batch.seconds)
                        # Each image of a batch reports it; the cost model counts a batch once.
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
        except Exception as e:  # e.g. the channel closed under us: retry elsewhere
            log.exception("Encode call to %s failed unexpectedly", h.address)
            self.pool.report_failure(h, f"Encode failed: {e!r}")
            return _CallFailure(h, Unavailable(repr(e)), jobs)
        finally:
            for pos, ticket in enumerate(tickets):
                if pos not in done:
                    self.pool.complete_work(ticket)

    def _check(self, emb: Embedding, job: PendingImage) -> ImageEmbedding:
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
            log.warning("image %d has %d patches, %d predicted from its header", job.index, t * hh * w, job.patches)
        return ImageEmbedding(embeds=embedding_tensor(emb), grid_thw=emb.grid_thw, digest=job.digest)


def embedding_tensor(emb: Embedding) -> torch.Tensor:
    """A (tokens, hidden) tensor over the received bytes: no copy, never unpickled."""
    import torch

    if emb.datatype not in DATATYPES:
        raise WireError(f"image {emb.image_index}: unknown datatype {emb.datatype!r}")
    with warnings.catch_warnings():
        # The bytes are ours alone and never written to.
        warnings.filterwarnings("ignore", message=".*buffer is not writable.*")
        t = torch.frombuffer(emb.data, dtype=getattr(torch, DATATYPES[emb.datatype].torch))
    return t.view(emb.shape[0], emb.shape[1])


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


def _request_numbering(e: InvalidArgument, jobs: list[PendingImage]) -> InvalidArgument:
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
