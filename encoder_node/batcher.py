"""Dynamic batching: images from all calls queue; one varlen forward per batch under a patch budget.

The loop takes queued images in arrival order while their patches fit the budget (an image
larger than the budget runs alone), runs ONE forward pass of the tower in a worker thread
(so the event loop keeps serving), and hands each image its own slice of the output.

A forward that fails re-runs each of its images alone, so only an image that fails by itself
fails (INTERNAL naming it), never the other requests batched with it.

Accounting: `admit` reserves patches when a call is accepted (before preprocessing), so
queued_patches counts all accepted, unfinished work; they are released when the image's
batch finishes or when the image is abandoned (failed preprocessing, cancelled call).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from encdis.client.errors import Internal, ResourceExhausted, Unavailable
from encdis.client.wire import BatchInfo
from encdis.encoder_node.metrics import EncoderMetrics
from encdis.encoder_node.preprocess import PreparedImage

log = logging.getLogger(__name__)

# (pixel_values per image, grid_thw per image) -> embedding per image
ForwardFn = Callable[[Sequence[torch.Tensor], Sequence[tuple[int, int, int]]], list[torch.Tensor]]


@dataclass(frozen=True)
class TowerOutput:
    """One image's share of a forward pass: its rows, the batch it ran in, its wait."""

    embedding: torch.Tensor  # (num_tokens, hidden) on CPU
    batch: BatchInfo
    queue_seconds: float  # accept to the batch's start
    preprocess_seconds: float  # of that, accept to submit: decoding and preprocessing


@dataclass
class _QueuedImage:
    image: PreparedImage
    accepted_at: float
    submitted_at: float
    future: asyncio.Future


class Batcher:
    def __init__(self, forward: ForwardFn, *, max_batch_patches: int, max_queued_patches: int,
                 metrics: EncoderMetrics) -> None:
        self._forward = forward
        self.max_batch_patches = max_batch_patches
        self.max_queued_patches = max_queued_patches
        self._metrics = metrics
        self._queue: collections.deque[_QueuedImage] = collections.deque()
        self._wakeup = asyncio.Event()
        self._queued_patches = 0
        self._closed = False
        # One thread: forwards never overlap, each has the device (and all CPU cores) to itself.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encdis-forward")
        self._task: asyncio.Task | None = None
        # What the node's load reports read (load_report.py): images queued or in a forward,
        # cumulative busy time, and the measured speed that prices the queue.
        self._running_images = 0
        self._busy_total = 0.0
        self._busy_since: float | None = None
        self._seconds_per_patch = 0.0  # moving average over batches; 0 until one has run
        self._listeners: list[Callable[[], None]] = []

    @property
    def queued_patches(self) -> int:
        return self._queued_patches

    @property
    def images_in_flight(self) -> int:
        """Images submitted and not yet finished: queued, or in the forward that runs now."""
        return len(self._queue) + self._running_images

    def busy_seconds(self, now: float) -> float:
        """Seconds spent in forwards since the node started (the one running now included)."""
        running = now - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_total + running

    def drain_seconds(self, now: float) -> float:
        """The node's own prediction of seconds until its queue is empty: the queued patches at
        its measured speed, less what the running forward has done already. 0 before any batch."""
        work = self._queued_patches * self._seconds_per_patch
        if self._busy_since is not None:
            work -= min(now - self._busy_since, work)
        return max(0.0, work)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` after every change of the queue (an image queued, a batch started or done)."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    def _changed(self) -> None:
        for callback in list(self._listeners):
            callback()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="encdis-batcher")

    def admit(self, patches: int) -> None:
        """Reserve `patches` for a call, or refuse it when the node's queue is full."""
        if self._closed:
            raise Unavailable("encoder node is shutting down")
        # A call bigger than the whole queue limit still runs when the node is otherwise idle.
        if self._queued_patches > 0 and self._queued_patches + patches > self.max_queued_patches:
            raise ResourceExhausted(
                f"encoder queue is full: {self._queued_patches} patches queued, this call needs {patches}, "
                f"the limit is {self.max_queued_patches}",
                reason="ENCODER_QUEUE_FULL", metadata={"limit": str(self.max_queued_patches)})
        self._add_queued(patches)

    def release(self, patches: int) -> None:
        """Give back reserved patches of images that will not be submitted."""
        self._add_queued(-patches)

    def submit(self, image: PreparedImage, accepted_at: float) -> asyncio.Future:
        """Queue an admitted image; the future resolves to its TowerOutput."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(_QueuedImage(image, accepted_at, time.monotonic(), fut))
        self._wakeup.set()
        self._changed()
        return fut

    async def close(self) -> None:
        """Finish what is queued, then stop the loop."""
        self._closed = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    def _add_queued(self, delta: int) -> None:
        self._queued_patches += delta
        self._metrics.queued_patches.set(self._queued_patches)

    def _take_batch(self) -> list[_QueuedImage]:
        batch: list[_QueuedImage] = []
        patches = 0
        while self._queue:
            job = self._queue[0]
            if job.future.done():  # its call was cancelled while queued
                self._queue.popleft()
                self.release(job.image.num_patches)
                self._metrics.dropped_images.inc()
                self._changed()
                continue
            n = job.image.num_patches
            if batch and patches + n > self.max_batch_patches:
                break
            batch.append(self._queue.popleft())
            patches += n
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._take_batch()
            if not batch:
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._running_images = len(batch)
            self._busy_since = time.monotonic()
            self._changed()
            try:
                await self._run_batch(loop, batch)
            finally:
                self._busy_total += time.monotonic() - self._busy_since
                self._busy_since = None
                self._running_images = 0
                self._changed()

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_QueuedImage],
                         *, alone_on_failure: bool = True) -> None:
        images = [j.image for j in batch]
        patches = [im.num_patches for im in images]
        started = time.monotonic()
        try:
            outputs = await loop.run_in_executor(
                self._executor, self._forward, [im.pixel_values for im in images], [im.grid_thw for im in images]
            )
            error = None
        except Exception as e:  # the batch's calls fail, the node goes on
            log.exception("forward pass of %d images (%d patches) failed", len(batch), sum(patches))
            if alone_on_failure and len(batch) > 1:
                # One bad image must not fail the others' requests: each runs again alone, so
                # only the one that fails by itself fails (each run releases its own patches).
                for job in batch:
                    if not job.future.done():
                        await self._run_batch(loop, [job], alone_on_failure=False)
                    else:
                        self.release(job.image.num_patches)
                return
            outputs, error = None, e
        seconds = time.monotonic() - started
        self.release(sum(patches))
        if error is None:
            per_patch = seconds / max(1, sum(patches))
            self._seconds_per_patch = (per_patch if self._seconds_per_patch == 0.0
                                       else 0.7 * self._seconds_per_patch + 0.3 * per_patch)
            info = BatchInfo(seconds=seconds, image_patches=tuple(patches))
            m = self._metrics
            m.batches.inc()
            m.batch_seconds.observe(seconds)
            m.batch_patches.observe(sum(patches))
            m.patches.inc(sum(patches))
            m.images.inc(len(batch))
        for i, job in enumerate(batch):
            if job.future.done():
                continue
            if error is not None:
                job.future.set_exception(Internal(
                    f"image {job.image.index}: the vision tower failed on this image (details in the node's log)"))
                continue
            queue_s = started - job.accepted_at
            self._metrics.queue_seconds.observe(queue_s)
            job.future.set_result(TowerOutput(embedding=outputs[i], batch=info, queue_seconds=queue_s,
                                              preprocess_seconds=job.submitted_at - job.accepted_at))
