"""Hedging: when to send a straggling call's images a second time, and how much extra work that may cost.

Role: dispatch.py runs each Encode call under `Dispatcher._attempt`, which checks the call the
moment it passes the predicted finish of its first missing image by the margin, and again every
`hedge_check_seconds` while it waits (looking only at the next tick would add up to a whole
interval, more than most forwards take, to every hedged image). A second attempt (one call, to
the encoder with the earliest predicted finish for the images still missing) goes out when all
hold:

- the call has run past the predicted finish of its first missing image by the margin: the
  p95 of recent prediction errors (arrival minus predicted finish), at least a floor;
- another encoder's predicted finish for those images is below the time already waited (a
  call that has waited w is, as far as we know, as likely to need another w as not);
- the budget allows it: hedged patches stay within `fraction` of all patches sent over the
  sliding window.

The check repeats while the call waits, so a call that was not worth hedging at the margin
(every other encoder busy) is hedged once one frees up. The first embedding that passes the
checks wins; the other call is cancelled, which the encoder sees (its queued images are
dropped before their forward).

A call to an encoder whose cost model has not seen a batch is never hedged: its prediction
means nothing yet, and the attempt bound (encode_timeout_seconds) handles it. A hedge that
wins while the first call is still running marks that encoder slow, as the attempt bound
would have (fault kind `outpaced`): its call is cancelled before its bound could fire, and an
encoder that straggles (a frozen one) must still leave the rotation rather than keep
attracting calls that each cost a hedge.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .handle import EncoderState

if TYPE_CHECKING:
    from .expectation import PendingImage
    from .handle import EncoderHandle
    from .metrics import CoordinatorMetrics
    from .pool import EncoderPool
    from .settings import CoordinatorSettings

log = logging.getLogger(__name__)

# Prediction errors remembered for the margin.
ERRORS_KEPT = 256
# The margin needs this many errors before the p95 counts; until then the floor alone.
MIN_ERRORS = 8
# A call is looked at this long after it passes its predicted finish by the margin.
PAST_DUE_SECONDS = 0.001
# A call not sent yet is looked at again this soon, to learn its predicted finishes.
NOT_SENT_SECONDS = 0.01
# A call whose images all arrived gets this long to end its stream before it is cancelled.
STREAM_END_SECONDS = 0.05


class PredictionErrors:
    """Recent (arrival - predicted finish) seconds of images; their p95 is the hedge margin."""

    def __init__(self) -> None:
        self._errors: collections.deque[float] = collections.deque(maxlen=ERRORS_KEPT)

    def observe(self, error_seconds: float) -> None:
        if math.isfinite(error_seconds):
            self._errors.append(error_seconds)

    def margin(self, floor: float) -> float:
        if len(self._errors) < MIN_ERRORS:
            return floor
        ordered = sorted(self._errors)
        p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
        return max(floor, p95)


class HedgeBudget:
    """Hedged patches at most `fraction` of the patches sent over the last `window` seconds."""

    def __init__(self, fraction: float, window: float) -> None:
        self.fraction = fraction
        self.window = window
        self._sent: collections.deque[tuple[float, int]] = collections.deque()
        self._hedged: collections.deque[tuple[float, int]] = collections.deque()
        self._sent_total = 0
        self._hedged_total = 0

    def _expire(self, now: float) -> None:
        cutoff = now - self.window
        while self._sent and self._sent[0][0] < cutoff:
            self._sent_total -= self._sent.popleft()[1]
        while self._hedged and self._hedged[0][0] < cutoff:
            self._hedged_total -= self._hedged.popleft()[1]

    def sent(self, patches: int, now: float) -> None:
        """First attempts: patches sent to an encoder for the first time in this request round."""
        self._sent.append((now, patches))
        self._sent_total += patches

    def allows(self, patches: int, now: float) -> bool:
        self._expire(now)
        return self._hedged_total + patches <= self.fraction * (self._sent_total + self._hedged_total + patches)

    def hedged(self, patches: int, now: float) -> None:
        self._hedged.append((now, patches))
        self._hedged_total += patches

    def used(self, now: float) -> tuple[int, int]:
        """(hedged patches, all patches) in the window now."""
        self._expire(now)
        return self._hedged_total, self._sent_total + self._hedged_total


def worth_hedging(waited: float, predicted_finish: float, margin: float, best_other: float | None) -> bool:
    """Past the predicted finish by the margin, and another encoder predicted to finish the
    images in less time than has been waited already."""
    return best_other is not None and waited > predicted_finish + margin and best_other < waited


def best_other(finishes: Sequence[float]) -> float | None:
    return min(finishes) if finishes else None


@dataclass
class CallProgress:
    """One Encode call as it runs: when it was sent, each image's predicted finish (seconds
    after that), which images arrived, and which of those no other attempt had delivered."""

    sent_at: float = 0.0
    finishes: list[float] = field(default_factory=list)
    delivered: set[int] = field(default_factory=set)  # positions in the call's jobs
    fulfilled: set[int] = field(default_factory=set)


# (encoder, images, progress, first attempt?) -> the call: None on success, else its failure
CallFn = Callable[["EncoderHandle", list["PendingImage"], CallProgress, bool], Coroutine[Any, Any, Any]]


class Hedger:
    """Runs one call with hedging: the decision (module docstring), the race, the metrics."""

    def __init__(self, settings: CoordinatorSettings, pool: EncoderPool, metrics: CoordinatorMetrics) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.errors = PredictionErrors()
        self.budget = HedgeBudget(settings.hedge_budget, settings.hedge_window_seconds)

    async def run(self, h: EncoderHandle, jobs: list[PendingImage], remaining: dict[int, PendingImage],
                  excluded: set[str], call: CallFn) -> tuple[Any, bool]:
        """(the failure to report or None, whether images of `jobs` are still missing)."""
        progress = CallProgress()
        primary = asyncio.ensure_future(call(h, jobs, progress, True))
        running = {primary}
        hedge: asyncio.Task | None = None
        hedge_handle: EncoderHandle | None = None
        hedge_progress = CallProgress()
        failure = None
        try:
            while running:
                timeout = self.next_check(progress, time.monotonic()) if hedge is None else \
                    self.settings.hedge_check_seconds
                finished, _ = await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                running -= finished
                for task in finished:
                    outcome = task.result()  # a fatal error (a bad image) propagates
                    if outcome is not None and (task is primary or failure is None):
                        failure = outcome
                if not any(j.index in remaining for j in jobs):
                    break
                if hedge is None and not primary.done():
                    left = [j for j in jobs if j.index in remaining]
                    target = self.target(h, left, progress, excluded)
                    if target is not None:
                        hedge_handle = target
                        self.pool.acquire(target)
                        patches = sum(j.patches for j in left)
                        self.budget.hedged(patches, time.monotonic())
                        self.metrics.hedges.labels("sent").inc()
                        self.metrics.hedge_patches.inc(patches)
                        log.info("hedging %d image(s) of a call to %s on %s", len(left), h.address, target.address)
                        hedge = asyncio.ensure_future(call(target, left, hedge_progress, False))
                        running.add(hedge)
            if any(j.index in remaining for j in jobs):
                return failure, True
            if hedge_progress.fulfilled:
                self.metrics.hedges.labels("won").inc()
                # The straggler never answered: it was at least this late, which its backlog remembers.
                missed = [p for p in range(len(progress.finishes)) if p not in progress.delivered]
                if missed:
                    self.pool.observe_finish(h, progress.finishes[missed[0]], time.monotonic() - progress.sent_at)
                if primary in running and hedge_handle is not None:
                    self.outpaced(h, hedge_handle, progress, len(missed))
            if hedge is None:
                # Every image is here and no hedge was sent: the call's stream is ending on its
                # own (its status follows the last embedding). A moment for that, rather than
                # cancel a served call (the encoder would count it CANCELLED); past it, cancelled.
                if running:
                    _, running = await asyncio.wait(running, timeout=STREAM_END_SECONDS)
                return None, False
            for _ in running:  # every image is here: the other attempt is cancelled below
                self.metrics.hedges.labels("cancelled").inc()
            return None, False
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            if hedge_handle is not None:
                self.pool.release(hedge_handle)

    def next_check(self, progress: CallProgress, now: float) -> float:
        """Seconds until the next look at a waiting call: when its first missing image passes its
        predicted finish by the margin (a millisecond after, so that it has), else the interval."""
        interval = self.settings.hedge_check_seconds
        if not progress.finishes:  # not sent yet: its predictions come with the send, in a moment
            return min(interval, NOT_SENT_SECONDS)
        missing = [pos for pos in range(len(progress.finishes)) if pos not in progress.delivered]
        if not missing:
            return interval
        margin = self.errors.margin(self.settings.hedge_min_margin_seconds)
        due = progress.sent_at + progress.finishes[missing[0]] + margin - now
        return min(interval, due + PAST_DUE_SECONDS) if due > 0 else interval

    def outpaced(self, h: EncoderHandle, winner: EncoderHandle, progress: CallProgress, missed: int) -> None:
        """The hedge on `winner` delivered what the call to `h` had not: `h` is slow, as if its
        attempt bound had fired (the cancellation below means it never will for this call)."""
        waited = time.monotonic() - progress.sent_at
        predicted = progress.finishes[-1] if progress.finishes else 0.0
        self.metrics.encoder_faults.labels(h.address, "outpaced").inc()
        self.pool.penalise(h, EncoderState.SLOW,
                           f"outpaced: a hedge on {winner.address} delivered {missed} image(s) first, "
                           f"{waited:.3g}s into a call predicted to finish in {predicted:.3g}s")

    def target(self, h: EncoderHandle, left: list[PendingImage], progress: CallProgress,
               excluded: set[str]) -> EncoderHandle | None:
        """The encoder a straggling call's missing images should also go to, or None."""
        if not progress.finishes or len(progress.delivered) >= len(progress.finishes):
            return None
        if h.cost_model.observations == 0:
            return None  # its predictions mean nothing yet: the attempt bound handles it
        now = time.monotonic()
        waited = now - progress.sent_at
        first = min(pos for pos in range(len(progress.finishes)) if pos not in progress.delivered)
        margin = self.errors.margin(self.settings.hedge_min_margin_seconds)
        if waited <= progress.finishes[first] + margin:
            return None
        others = [c for c in self.pool.serving() if c is not h and c.address not in excluded]
        finishes = [self.pool.backlog_seconds(c) + sum(c.cost_model.predict(j.patches) for j in left)
                    for c in others]
        if not worth_hedging(waited, progress.finishes[first], margin, best_other(finishes)):
            return None
        if not self.budget.allows(sum(j.patches for j in left), now):
            return None
        return others[finishes.index(min(finishes))]
