"""Encoders' ORCA load reports, and the backlog a coordinator predicts from them.

Role: several LLM nodes share one encoder pool, and each coordinator sends only part of an
encoder's work. Each encoder reports its whole load out of band (encoder_node/load_report.py:
ORCA StreamCoreMetrics); `ReportWatcher` keeps one such stream per encoder and holds the last
report, and `predicted_backlog` turns it into the seconds of work ahead of a new image:

    backlog(e) = max(own view, max(0, drain - age) + own work sent after the report) + lateness

- drain: the encoder's own drain prediction; when the encoder has not measured its speed yet
  (drain 0 with patches queued), its queued patches priced by our cost model of it;
- age: seconds since the report arrived; the encoder kept working meanwhile;
- own work sent after the report: not in the report yet. Work sent before it is in it already
  (the encoder counted what it had accepted), so our own work is never counted twice;
- own view: what today's balancer sees (our outstanding images, decaying). An encoder is never
  believed to hold less than what we ourselves have outstanding on it: a report of idleness
  does not erase work we know is there;
- lateness: how far its calls have recently finished past their prediction (decaying with
  time), so an encoder whose reports say idle but whose answers come late attracts a bounded
  share, whatever it reports.

A report older than `max_age` counts for nothing: the coordinator falls back to its own view
(a hung report stream ages out; no request ever waits for a report).

What no report shows yet is the other coordinators' work sent since it was made. `UnseenWork`
estimates it per encoder: its busy fraction is the rate of work it gets (what is done is what
arrives, in the long run), less our own rate to it it is the others'; times the report's
staleness it is their work still invisible, which the pool adds to the backlog (where the
others have been sending, they likely sent). Their sum is where the others' greedy choices
may have herded on the same stale reports: assignment.Spread spreads our images as that work
is expected to have spread, rather than every coordinator piling onto the one encoder the
reports show least loaded.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.protobuf import duration_pb2

if TYPE_CHECKING:
    import grpc

    from .cost_model import CostModel

log = logging.getLogger(__name__)

STREAM_METHOD = "/xds.service.orca.v3.OpenRcaService/StreamCoreMetrics"
# After a broken report stream, wait this long before opening another.
RECONNECT_SECONDS = 0.5
# Lateness is forgotten with this half-life: an encoder that ran late once is not shunned forever.
LATENESS_HALF_LIFE_SECONDS = 10.0
# Our own rate of work is averaged over about this long (an exponentially decaying sum).
OWN_RATE_WINDOW_SECONDS = 1.0
# Our own work is priced by our cost models, which err by some percent (noise, stalls): busy time
# up to this multiple of our own predicted rate is taken for ours, not for other coordinators'.
OWN_RATE_ERROR = 1.25


@dataclass(frozen=True)
class LoadReport:
    """One encoder's ORCA report as received."""

    queued_patches: float
    images_in_flight: float
    drain_seconds: float
    utilization: float
    received_at: float  # time.monotonic() here
    # When the encoder made it, on our clock, where known; else its arrival (the transit is unknown).
    made_at: float | None = None

    def age(self, now: float) -> float:
        """Seconds since the encoder made it (since it arrived, where that is all we know)."""
        return max(0.0, now - self.made())

    def made(self) -> float:
        """When it was made: our own work sent after that is not in it."""
        return self.received_at if self.made_at is None else self.made_at


def parse_report(message, received_at: float) -> LoadReport:  # message: OrcaLoadReport
    """An OrcaLoadReport as a LoadReport; a missing or non-finite metric is refused."""
    named = message.named_metrics
    values = {}
    for name in ("queued_patches", "images_in_flight", "drain_seconds"):
        v = named.get(name)
        if v is None or not math.isfinite(v) or v < 0:
            raise ValueError(f"load report without a valid {name}: {v!r}")
        values[name] = float(v)
    util = message.application_utilization
    if not math.isfinite(util):
        raise ValueError(f"load report with utilization {util!r}")
    return LoadReport(**values, utilization=min(1.0, max(0.0, util)), received_at=received_at)


class Lateness:
    """How late an encoder's calls finish past their predicted finish, decaying with time."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._at = 0.0

    def seconds(self, now: float) -> float:
        return self._seconds * 0.5 ** (max(0.0, now - self._at) / LATENESS_HALF_LIFE_SECONDS)

    def observe(self, late_seconds: float, now: float) -> None:
        """A call finished `late_seconds` past (negative: before) its prediction. A moving
        average: one late call (a pause of the host) counts for a third, calls late again and
        again add up to their lateness; calls on time bring it down, and so does time."""
        current = self.seconds(now)
        self._seconds = max(0.0, 0.7 * current + 0.3 * late_seconds)
        self._at = now


def predicted_backlog(report: LoadReport | None, own_view: float, own_after: Sequence[int], model: CostModel,
                      now: float, max_age: float, lateness: float) -> float:
    """Seconds of work ahead of a new image on one encoder (module docstring).

    `own_after`: patch counts of our images sent to it after the report was made (arrived,
    where its making is unknown): those it cannot hold yet."""
    backlog = own_view
    if report is not None and report.age(now) <= max_age:
        drain = report.drain_seconds
        if drain == 0.0 and report.queued_patches > 0:  # the encoder has not measured its speed yet
            drain = model.predict(int(report.queued_patches))
        reported = max(0.0, drain - report.age(now)) + sum(model.predict(n) for n in own_after)
        backlog = max(backlog, reported)
    return backlog + lateness


class UnseenWork:
    """Seconds of work the other coordinators sent each encoder that its report holds not yet
    (module docstring): per encoder, its busy fraction less our own rate of work to it."""

    def __init__(self, window: float = OWN_RATE_WINDOW_SECONDS) -> None:
        self.window = window
        self._sums: dict[Hashable, tuple[float, float]] = {}  # key -> (decaying sum of our seconds, when)

    def _sum(self, key: Hashable, now: float) -> float:
        """Our seconds of work sent to `key`, decayed to `now`."""
        total, at = self._sums.get(key, (0.0, now))
        return total * math.exp(-max(0.0, now - at) / self.window)

    def sent(self, key: Hashable, seconds: float, now: float) -> None:
        """We sent encoder `key` an image predicted to take `seconds` of its forward."""
        self._sums[key] = (self._sum(key, now) + seconds, now)

    def own_rate(self, key: Hashable, now: float) -> float:
        """Our recent seconds of work sent to `key` per second."""
        return self._sum(key, now) / self.window

    def forget(self, key: Hashable) -> None:
        self._sums.pop(key, None)

    def seconds(self, key: Hashable, report: LoadReport | None, now: float, max_age: float) -> float:
        """The others' rate to `key` (its busy fraction less OWN_RATE_ERROR times ours) times its
        report's staleness; 0 without a fresh report."""
        if report is None or report.age(now) > max_age:
            return 0.0
        return max(0.0, report.utilization - OWN_RATE_ERROR * self.own_rate(key, now)) * report.age(now)


class ReportWatcher:
    """One encoder's report stream: reopened when it breaks; the last report in `latest`."""

    def __init__(self, channel: grpc.aio.Channel, interval: float, address: str) -> None:
        from xds.data.orca.v3 import orca_load_report_pb2
        from xds.service.orca.v3 import orca_pb2

        self.address = address
        self.interval = interval
        self.latest: LoadReport | None = None
        self.reports = 0
        self._call = channel.unary_stream(
            STREAM_METHOD, request_serializer=orca_pb2.OrcaLoadReportRequest.SerializeToString,
            response_deserializer=orca_load_report_pb2.OrcaLoadReport.FromString)
        whole = int(interval)
        self._request = orca_pb2.OrcaLoadReportRequest(
            report_interval=duration_pb2.Duration(seconds=whole, nanos=int((interval - whole) * 1e9)))
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"encdis-orca-{self.address}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task})

    async def _run(self) -> None:
        while True:
            try:
                async for message in self._call(self._request):
                    try:
                        self.latest = parse_report(message, time.monotonic())
                        self.reports += 1
                    except ValueError as e:
                        log.warning("encoder %s sent a bad load report (ignored): %s", self.address, e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # unreachable, restarting, or no ORCA service: own view meanwhile
                log.debug("load report stream of %s ended: %s", self.address, e)
            await asyncio.sleep(RECONNECT_SECONDS)
