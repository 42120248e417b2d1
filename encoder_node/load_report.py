"""Out-of-band load reports: gRPC's ORCA service (gRFC A51) on the encoder node's port.

Role: any ORCA-aware client (the encdis coordinator, Envoy, proxyless gRPC) opens
`xds.service.orca.v3.OpenRcaService/StreamCoreMetrics` once and receives
`xds.data.orca.v3.OrcaLoadReport` messages on that stream:

    named_metrics["queued_patches"]    patches accepted and not yet encoded (the HPA signal's value)
    named_metrics["images_in_flight"]  images queued or in the forward running now
    named_metrics["drain_seconds"]     the node's own prediction of seconds until its queue is empty
                                       (queued patches at its measured speed; 0 before a batch ran)
    application_utilization            busy fraction (time in forwards) since the previous report
    utilization["encoder"]             the same, in ORCA's per-resource utilization map

A report goes out at the interval the client asks for (at least MIN_INTERVAL_SECONDS; none
asked: DEFAULT_INTERVAL_SECONDS), and at once when the images in flight changed by more than
one since the last report, so a burst is seen before the next tick. The first report is sent
as soon as the stream opens.

xds-protos ships the messages but no service stubs: the handler is registered by hand.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from xds.data.orca.v3 import orca_load_report_pb2
from xds.service.orca.v3 import orca_pb2

from encdis.encoder_node.batcher import Batcher
from encdis.encoder_node.metrics import EncoderMetrics

SERVICE_NAME = "xds.service.orca.v3.OpenRcaService"
MIN_INTERVAL_SECONDS = 0.01
DEFAULT_INTERVAL_SECONDS = 1.0
# A report goes out early when the images in flight moved by more than this since the last one.
IMAGES_CHANGE = 1


def load_report(batcher: Batcher, utilization: float, now: float) -> orca_load_report_pb2.OrcaLoadReport:
    """The node's load as one ORCA report."""
    busy = min(1.0, max(0.0, utilization))
    report = orca_load_report_pb2.OrcaLoadReport(application_utilization=busy)
    report.utilization["encoder"] = busy
    report.named_metrics["queued_patches"] = float(batcher.queued_patches)
    report.named_metrics["images_in_flight"] = float(batcher.images_in_flight)
    report.named_metrics["drain_seconds"] = batcher.drain_seconds(now)
    return report


def report_interval(request: orca_pb2.OrcaLoadReportRequest) -> float:
    """The interval the client asked for, floored; DEFAULT_INTERVAL_SECONDS when it asked none."""
    asked = request.report_interval.seconds + request.report_interval.nanos / 1e9
    if asked <= 0:
        return DEFAULT_INTERVAL_SECONDS
    return max(MIN_INTERVAL_SECONDS, asked)


class LoadReportService:
    """StreamCoreMetrics over one node's batcher."""

    def __init__(self, metrics: EncoderMetrics) -> None:
        self.metrics = metrics
        self.batcher: Batcher | None = None  # set once the model is loaded
        self._closed = asyncio.Event()  # set: every report stream ends (the node is stopping)

    def close(self) -> None:
        """End every report stream now, so a stopping server need not wait out its grace for them."""
        self._closed.set()

    async def StreamCoreMetrics(self, request: orca_pb2.OrcaLoadReportRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[
                                    orca_load_report_pb2.OrcaLoadReport]:
        interval = report_interval(request)
        while self.batcher is None:  # loading: nothing to report yet, the stream stays open
            if self._closed.is_set():
                return
            await asyncio.sleep(interval)
        batcher = self.batcher
        changed = asyncio.Event()
        reported_images = -1

        def on_change() -> None:
            if abs(batcher.images_in_flight - reported_images) > IMAGES_CHANGE:
                changed.set()

        batcher.add_listener(on_change)
        try:
            last_time = time.monotonic()
            last_busy = batcher.busy_seconds(last_time)
            while True:
                now = time.monotonic()
                busy = batcher.busy_seconds(now)
                utilization = (busy - last_busy) / (now - last_time) if now > last_time else 0.0
                last_time, last_busy = now, busy
                reported_images = batcher.images_in_flight
                changed.clear()
                self.metrics.load_reports.inc()
                yield load_report(batcher, utilization, now)
                closing = asyncio.ensure_future(self._closed.wait())
                change = asyncio.ensure_future(changed.wait())
                try:
                    await asyncio.wait({closing, change}, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    closing.cancel()
                    change.cancel()
                if self._closed.is_set():
                    return
        finally:
            batcher.remove_listener(on_change)


def add_load_report_service(service: LoadReportService, server: grpc.aio.Server) -> None:
    handlers = {
        "StreamCoreMetrics": grpc.unary_stream_rpc_method_handler(
            service.StreamCoreMetrics, request_deserializer=orca_pb2.OrcaLoadReportRequest.FromString,
            response_serializer=orca_load_report_pb2.OrcaLoadReport.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
