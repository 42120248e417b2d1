"""Dispatch: a request's uncached images onto encoders, one Encode stream per encoder, with retries.

Each round assigns the images still missing (assignment.assign: decreasing cost, earliest predicted
finish over the SERVING encoders' cost models and backlogs; with caching encoders affinity.py's
digest affinity, in a pool shared with other LLM nodes after asking where images may be held)
and runs one Encode stream per chosen encoder concurrently. Each embedding, as it arrives, is
checked against what the coordinator knows before any encoder answers (the image's grid from its
header, rows = t*h*w / merge_size**2, the LLM's hidden size, the pool's datatype, our own digest),
turned into a tensor over the received bytes (torch.frombuffer, never pickle) and handed to the
cache; each batch timing goes to that encoder's cost model. Received into the node's shared
region, an image's buffer (its size known from its grid) is made while its encoder works
(PreparedBuffers), not after its first bytes arrive.

Encoders are not trusted. One that sends anything else (or breaks the wire contract) is
quarantined (pool.penalise) and its images go elsewhere. Each attempt is bounded by the
encoder's predicted cost (its backlog plus these images, times a margin, at least a floor;
`encode_timeout_seconds` until its cost model has seen a batch) and by the caller's
deadline: an attempt past its own bound marks the encoder slow and moves its images (to a slow
one only when no encoder is serving: late beats refused); past the caller's deadline, the request
fails with DEADLINE_EXCEEDED. RESOURCE_EXHAUSTED makes the encoder look busier for a while. Other
failures (UNAVAILABLE, reset, broken stream) mark it unhealthy until its health watch re-checks
it. Each image is re-sent at most `max_retries` times; rounds in which every encoder failed the
request are spaced by an exponential back-off with jitter. INVALID_ARGUMENT is not retried and
names the image in the request's numbering (retries.py keeps the counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from opentelemetry.trace import Span

from encdis.client.embedding import itemsize
from encdis.client.errors import (
    DeadlineExceeded,
    EncdisError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    WireError,
)
from encdis.client.receive_buffer import PreparedBuffers
from encdis.client.wire import Allocate, Embedding, ExpectedEmbedding
from encdis.tracing import Tracing, record_span, trace_metadata

from .affinity import Affinity, ask_holders
from .colocated import ColocatedTransport
from .colocated_link import ColocatedFailure
from .embedding_cache import EmbeddingCache
from .expectation import PendingImage, embedding_mismatch, request_numbering
from .handle import EncoderHandle, EncoderState
from .hedging import CallProgress, Hedger
from .metrics import CoordinatorMetrics
from .pool import EncoderPool
from .records import ImageEmbedding, RequestTiming, embedding_tensor
from .retries import CallFailure, Retries, check_deadline
from .settings import CoordinatorSettings

log = logging.getLogger(__name__)


class Dispatcher:
    """Runs the encode rounds of requests over one pool, cache and set of metrics."""

    def __init__(self, settings: CoordinatorSettings, pool: EncoderPool, cache: EmbeddingCache,
                 metrics: CoordinatorMetrics, *, hidden_size: int, min_pixels: int, max_pixels: int,
                 colocated: ColocatedTransport | None = None) -> None:
        self.settings = settings
        self.colocated = colocated  # co-located pairs (colocated.py); None: gRPC only
        self.pool, self.cache = pool, cache
        self.metrics = metrics
        self.hidden_size = hidden_size
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.receive_buffers: Allocate | None = None  # where embeddings are received (None: the heap)
        # Makes a call's receive buffers while its encoder works (PreparedBuffers); threads start on first use.
        self._preparing = ThreadPoolExecutor(2, thread_name_prefix="encdis-buffers")
        # Rotating the candidates per round spreads ties on predicted finish (assign picks the first).
        self._rotation = 0
        self.retries = Retries(settings, pool, metrics)
        self.tracing = Tracing()  # off until the node sets its own (encdis/tracing.py)
        self.hedger = Hedger(settings, pool, metrics)
        self.affinity = Affinity(settings)  # digests to the encoders that hold them (affinity.py)

    async def run(self, images: Sequence[bytes], remaining: dict[int, PendingImage], timing: RequestTiming,
                  deadline: float | None = None) -> None:
        """Encode the `remaining` images into the cache, removing each as it arrives.

        `deadline` (time.monotonic() seconds, None: none) bounds every attempt and wait.
        Raises when one cannot be encoded anywhere (or in time); `remaining` then holds those
        not encoded.
        """
        attempts = dict.fromkeys(remaining, 0)
        excluded: set[str] = set()  # encoders that already failed this request
        failures: list[str] = []
        failed_rounds = 0
        asked: set[tuple[str, str]] = set()  # (encoder, digest) asked whether it holds it (affinity.py)
        while remaining:
            check_deadline(deadline, remaining, failures)
            routable = await self._routable(timing, failures, deadline)
            candidates = [h for h in routable if h.address not in excluded] or routable
            self._rotation += 1
            shift = self._rotation % len(candidates)
            candidates = candidates[shift:] + candidates[:shift]
            jobs = sorted(remaining.values(), key=lambda j: j.index)
            if await ask_holders(self.affinity, self.pool, candidates, jobs, asked):
                continue  # asked (awaited): plan again with the pool and what they hold as they are now
            calls = self._plan(candidates, jobs)
            # Held from now (no await since `_routable`), so a DNS refresh cannot close them under us.
            for h, _ in calls:
                self.pool.acquire(h)
            try:
                outcomes = await _run_all([self._attempt(h, images, group, remaining, timing, deadline, excluded)
                                           for h, group in calls])
            finally:
                for h, _ in calls:
                    self.pool.release(h)
            for failure in outcomes:
                if failure is not None:
                    self.retries.count_failure(failure, remaining, attempts, excluded, failures, timing)
            if remaining and all(h.address in excluded for h in self.pool.serving()):
                # Every encoder failed it once: back off, not in a tight loop nor with the requests failing beside it.
                failed_rounds += 1
                pause = self.retries.pause(failed_rounds)
                if deadline is not None:
                    pause = max(0.0, min(pause, deadline - time.monotonic()))
                await asyncio.sleep(pause)
                timing.wait += pause

    def attempt_timeout(self, h: EncoderHandle, jobs: Sequence[PendingImage],
                        deadline: float | None) -> tuple[float, float, bool]:
        """(timeout, predicted seconds, bounded by the caller) of one Encode call of `jobs` to `h`.

        The prediction is the encoder's queued work plus these images on its cost model; before
        that model has seen a batch it means nothing, and the bound is encode_timeout_seconds.
        """
        s = self.settings
        predicted = self.pool.backlog_seconds(h) + sum(h.cost_model.predict(j.patches) for j in jobs)
        bound = s.encode_timeout_seconds
        if h.cost_model.observations > 0:
            bound = min(bound, max(s.attempt_timeout_floor_seconds, s.attempt_timeout_margin * predicted))
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= bound:
                return max(left, 1e-3), predicted, True
        return bound, predicted, False

    def _plan(self, candidates: list[EncoderHandle],
              order: list[PendingImage]) -> list[tuple[EncoderHandle, list[PendingImage]]]:
        """(encoder, images) per Encode call: the policy's choice, split by each encoder's image limit."""
        picks = self.affinity.assign([j.patches for j in order], [j.digest for j in order],
                                     self.pool.loads(candidates), self.affinity.applies(candidates),
                                     self.pool.spread(candidates))
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

    async def _routable(self, timing: RequestTiming, failures: list[str],
                        deadline: float | None) -> list[EncoderHandle]:
        """The SERVING encoders (else the slow ones), waiting (bounded) for ones still connecting."""
        t0 = time.monotonic()
        until = t0 + self.settings.encoder_wait_seconds
        if deadline is not None:
            until = min(until, deadline)
        try:
            while True:
                routable = self.pool.serving() or self.pool.slow_but_serving()
                if routable:
                    return routable
                # A penalised encoder is not waited for: its back-off outlasts any request.
                settling = [h for h in self.pool.encoders()
                            if (h.settling or h.state is EncoderState.CONNECTING) and not h.gone]
                left = until - time.monotonic()
                if not settling or left <= 0:
                    tail = f"; after failures: {', '.join(failures[-3:])}" if failures else ""
                    log.warning("no encoder for a request: %s", self.pool.summary())
                    if settling and deadline is not None and until == deadline:
                        raise DeadlineExceeded(f"the request's deadline passed waiting for an encoder "
                                               f"({self.pool.state_counts()}){tail}")
                    raise Unavailable(f"no encoder can serve this request ({self.pool.state_counts()}; "
                                      f"their states and reasons: ListEncoders){tail}")
                await self.pool.wait_changed(left)
        finally:
            timing.wait += time.monotonic() - t0

    async def _attempt(self, h: EncoderHandle, images: Sequence[bytes], jobs: list[PendingImage],
                       remaining: dict[int, PendingImage], timing: RequestTiming, deadline: float | None,
                       excluded: set[str]) -> CallFailure | None:
        """One call to `h`, hedged when it straggles (hedging.Hedger); None once every image is in."""
        def call(target: EncoderHandle, group: list[PendingImage], progress: CallProgress, first_attempt: bool):
            return self._call(target, images, group, remaining, timing, deadline, progress,
                              first_attempt=first_attempt)

        if self.settings.hedge != "on":
            return await call(h, jobs, CallProgress(), True)
        failure, missing = await self.hedger.run(h, jobs, remaining, excluded, call)
        if missing and failure is None:
            return CallFailure(h, Unavailable("no attempt delivered every image"), jobs)
        return failure if missing else None

    async def _call(self, h: EncoderHandle, images: Sequence[bytes], jobs: list[PendingImage],
                    remaining: dict[int, PendingImage], timing: RequestTiming,
                    deadline: float | None, progress: CallProgress | None = None,
                    *, first_attempt: bool = True) -> CallFailure | None:
        """One Encode stream to `h` in its own span (the encoder's spans are its children)."""
        with self.tracing.tracer.start_as_current_span("encdis.coordinator.encode_call", attributes={
                "encdis.encoder": h.address, "encdis.images": len(jobs),
                "encdis.patches": sum(j.patches for j in jobs), "encdis.hedge": not first_attempt}) as span:
            t0 = time.monotonic()
            failure = await self._stream(h, images, jobs, remaining, timing, deadline, span,
                                         progress if progress is not None else CallProgress(),
                                         first_attempt=first_attempt)
            span.set_attribute("encdis.actual_seconds", time.monotonic() - t0)
            if failure is not None:
                span.set_attribute("encdis.failure", f"{failure.error.code.name}: {failure.error.message}")
            return failure

    async def _stream(self, h: EncoderHandle, images: Sequence[bytes], jobs: list[PendingImage],
                      remaining: dict[int, PendingImage], timing: RequestTiming, deadline: float | None,
                      span: Span, progress: CallProgress, *, first_attempt: bool) -> CallFailure | None:
        """One Encode stream to `h`; None on success, a CallFailure when others should retry.

        Images another attempt delivered meanwhile (no longer in `remaining`) are checked and
        dropped."""
        timeout, predicted, by_caller = self.attempt_timeout(h, jobs, deadline)
        span.set_attribute("encdis.predicted_seconds", predicted)
        datatype = self.pool.identity.datatype  # every encoder in the pool matched it (identity.py)
        fitted = h.cost_model.observations > 0  # only then is a prediction worth learning from
        costs = [h.cost_model.predict(j.patches) for j in jobs]
        finish = predicted - sum(costs)
        progress.finishes = []
        for c in costs:
            finish += c
            progress.finishes.append(finish)
        progress.sent_at = time.monotonic()
        tickets = []
        for j in jobs:
            tickets.append(self.pool.add_work(h, j.patches))
            self.metrics.assignments.labels(h.address).inc()
            self.metrics.assigned_patches.labels(h.address).inc(j.patches)
            if first_attempt:
                self.hedger.budget.sent(j.patches, progress.sent_at)
        done = progress.delivered
        buffers = self._buffers(jobs, datatype)
        try:
            stream = h.client.encode_iter(
                [bytes(images[j.index]) for j in jobs], min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                timeout=timeout,
                # The receiver refuses a header that disagrees before it allocates anything.
                expected=[ExpectedEmbedding(j.rows, self.hidden_size, datatype or "", j.patches) for j in jobs],
                on_embedding_bytes=self.metrics.embedding_bytes_received.inc,
                colocated=self.colocated.receiver(h) if self.colocated is not None else None,
                metadata=trace_metadata(),  # this call's span, as W3C trace context
                allocate=buffers or self.receive_buffers,
                on_tail_error=functools.partial(self._tail_failed, h),
            )
            async with contextlib.aclosing(stream):  # cancel the RPC at once if we stop reading
                async for emb in stream:
                    pos = emb.image_index
                    job = jobs[pos]
                    t0 = time.perf_counter()
                    entry = self._check(emb, job, datatype)
                    timing.transfer = max(timing.transfer, emb.receive_seconds + time.perf_counter() - t0)
                    done.add(pos)
                    self.affinity.observe(h.address, job.patches, job.digest, emb.receive_seconds, emb.cached)
                    self.pool.complete_work(tickets[pos])
                    if fitted:
                        error = time.monotonic() - progress.sent_at - progress.finishes[pos]
                        self.pool.observe_finish(h, progress.finishes[pos], progress.finishes[pos] + error)
                        self.hedger.errors.observe(error)
                    if remaining.pop(job.index, None) is None:
                        continue  # another attempt (a hedge) delivered it first
                    progress.fulfilled.add(pos)
                    self.cache.fulfil(entry)
                    timing.observe_queue(emb.queue_seconds, emb.preprocess_seconds)
                    if span.is_recording():
                        record_span(self.tracing.tracer, span, "encdis.coordinator.image", span.start_time,
                                    time.time_ns(), **{"encdis.image_index": job.index, "encdis.cache": "miss",
                                                       "encdis.encoder": h.address, "encdis.patches": job.patches,
                                                       "encdis.queue_seconds": emb.queue_seconds})
                    if emb.batch is not None:
                        timing.encode = max(timing.encode, emb.batch.seconds)
                        # Each image of a batch reports it; the cost model counts a batch once.
                        h.cost_model.observe(list(emb.batch.image_patches), emb.batch.seconds)
            return None
        except InvalidArgument as e:
            raise request_numbering(e, jobs) from None
        except ColocatedFailure as e:
            # The pair failed, not the encoder (the pair is closed): the images go again, over gRPC.
            return CallFailure(h, e, jobs)
        except (FailedPrecondition, WireError) as e:
            self._quarantine(h, e)
            return CallFailure(h, e, jobs)
        except DeadlineExceeded:
            left = [j.index for pos, j in enumerate(jobs) if pos not in done]
            if by_caller:
                raise DeadlineExceeded(f"the request's deadline passed while image(s) {left} were encoding; "
                                       f"retries so far: {timing.retries}") from None
            self.metrics.encoder_faults.labels(h.address, "timeout").inc()
            why = (f"an Encode of {len(jobs)} image(s) ran past its {timeout:.3g}s bound "
                   f"(predicted {predicted:.3g}s with its backlog)")
            self.pool.penalise(h, EncoderState.SLOW, why)
            return CallFailure(h, Unavailable(f"{why}; image(s) {left} sent elsewhere"), jobs)
        except ResourceExhausted as e:
            self.metrics.encoder_faults.labels(h.address, "busy").inc()
            self.pool.report_busy(h)  # busy, not broken: send it less for a while, try elsewhere
            return CallFailure(h, e, jobs)
        except EncdisError as e:
            if e.code.name != "INTERNAL":
                self.pool.report_failure(h, f"Encode failed: {e}")
            return CallFailure(h, e, jobs)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # e.g. the channel closed under us: retry elsewhere
            log.exception("Encode call to %s failed unexpectedly", h.address)
            self.pool.report_failure(h, f"Encode failed: {e!r}")
            return CallFailure(h, Unavailable(repr(e)), jobs)
        finally:
            if buffers is not None:
                buffers.close()
            for pos, ticket in enumerate(tickets):
                if pos not in done:
                    self.pool.complete_work(ticket)

    def close(self) -> None:
        """Buffers not started are not made; the threads end once idle."""
        self._preparing.shutdown(wait=False, cancel_futures=True)

    def _buffers(self, jobs: list[PendingImage], datatype: str | None) -> PreparedBuffers | None:
        """The call's receive buffers, made from now on (the region's; the heap's cost nothing to make)."""
        if self.receive_buffers is None or not datatype:
            return None
        sizes = [j.rows * self.hidden_size * itemsize(datatype) for j in jobs]
        return PreparedBuffers(self.receive_buffers, sizes, self._preparing)

    def _quarantine(self, h: EncoderHandle, e: EncdisError) -> None:
        """It sent something other than what was asked (or claims a model mismatch mid-call)."""
        self.metrics.encoder_faults.labels(h.address, "bad_embedding").inc()
        self.pool.penalise(h, EncoderState.QUARANTINED, e.message)

    def _tail_failed(self, h: EncoderHandle, e: EncdisError) -> None:  # after every image of the call arrived
        if isinstance(e, (FailedPrecondition, WireError)):
            self._quarantine(h, e)
        else:
            log.info("encoder %s: an Encode call failed after all its images arrived: %s", h.address, e)

    def _check(self, emb: Embedding, job: PendingImage, datatype: str | None) -> ImageEmbedding:
        """The received embedding as a tensor, after checking it is exactly the one we asked for."""
        problem = embedding_mismatch(emb, job, self.hidden_size, datatype)
        if problem is not None:
            raise FailedPrecondition(f"image {job.index}: {problem}")
        return ImageEmbedding(embeds=embedding_tensor(emb), grid_thw=emb.grid_thw, digest=job.digest)


async def _run_all(calls: list) -> list[CallFailure | None]:
    """Run the calls concurrently; on a fatal error (e.g. a bad image) cancel the rest and raise.
    A lone call is awaited in place: a task of its own would cost a turn of the loop to start and one to end."""
    if len(calls) == 1:
        return [await calls[0]]
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
