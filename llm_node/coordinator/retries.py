"""A request's retries across encode rounds: what a failed call costs its images, when they run
out, how long to back off when every encoder failed them, and the request's deadline."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from encdis.client.errors import DeadlineExceeded, EncdisError, ResourceExhausted, Unavailable

from .expectation import PendingImage
from .handle import EncoderHandle
from .metrics import CoordinatorMetrics
from .pool import EncoderPool
from .records import RequestTiming
from .settings import CoordinatorSettings

log = logging.getLogger(__name__)


@dataclass
class CallFailure:
    """One Encode call that did not deliver: its encoder, why, and the images it carried."""

    handle: EncoderHandle
    error: EncdisError
    jobs: list[PendingImage] = field(default_factory=list)


class Retries:
    """Retry accounting shared by a dispatcher's requests (each request keeps its own counts)."""

    def __init__(self, settings: CoordinatorSettings, pool: EncoderPool, metrics: CoordinatorMetrics) -> None:
        self.settings, self.pool, self.metrics = settings, pool, metrics
        self._random = random.Random()

    def pause(self, failed_rounds: int) -> float:
        """Exponential back-off with jitter: half of base * 2**(rounds-1) (capped) fixed, half random."""
        s = self.settings
        cap = min(s.retry_backoff_max_seconds, s.retry_backoff_seconds * 2 ** (failed_rounds - 1))
        return cap * (0.5 + 0.5 * self._random.random())

    def count_failure(self, failure: CallFailure, remaining: dict[int, PendingImage], attempts: dict[int, int],
                      excluded: set[str], failures: list[str], timing: RequestTiming) -> None:
        """Book a failed call's images for another round, or raise once one ran out of retries."""
        h, err = failure.handle, failure.error
        excluded.add(h.address)
        left = [j for j in failure.jobs if j.index in remaining]
        failures.append(err.code.name)  # what callers see: no address, no encoder's message
        log.warning("encoder %s failed %d image(s) of a request: %s", h.address, len(left), err)
        for job in left:
            attempts[job.index] += 1
            if attempts[job.index] > self.settings.max_retries:
                # Busy encoders are a different answer from broken ones: clients back off.
                cls = ResourceExhausted if isinstance(err, ResourceExhausted) else Unavailable
                what = "encoders are busy" if cls is ResourceExhausted else "no encoder can serve this request"
                log.warning("image %d failed %d times; encoders: %s", job.index, attempts[job.index],
                            self.pool.summary())
                raise cls(
                    f"{what}: image {job.index} failed {attempts[job.index]} times "
                    f"(max_retries {self.settings.max_retries}); last errors: {', '.join(failures[-3:])}; "
                    f"{self.pool.state_counts()}"
                )
        timing.retries += len(left)
        self.metrics.retries.inc(len(left))


def check_deadline(deadline: float | None, remaining: dict[int, PendingImage], failures: list[str]) -> None:
    """DeadlineExceeded naming the images not encoded, once `deadline` (time.monotonic()) has passed."""
    if deadline is not None and time.monotonic() >= deadline:
        tail = f"; after failures: {', '.join(failures[-3:])}" if failures else ""
        raise DeadlineExceeded(f"the request's deadline passed with image(s) {sorted(remaining)} not encoded{tail}")
