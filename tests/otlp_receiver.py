"""A real OTLP trace receiver for tests: opentelemetry-proto's gRPC TraceService on loopback,
keeping every span it is sent (the collector's side of `--otlp-traces-endpoint`).

    with OtlpReceiver() as rx:
        ... a node started with --otlp-traces-endpoint rx.address ...
        spans = rx.wait_for(lambda spans: any(s.name == "x" for s in spans), timeout=60)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex, as in a W3C traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict
    start_ns: int = 0  # unix nanoseconds
    end_ns: int = 0


def _value(v) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                              s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                                              s.start_time_unix_nano, s.end_time_unix_nano))
        with self.receiver._lock:
            self.receiver._spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self._server.start()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while not predicate(spans := self.spans):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s; received {[(s.service, s.name) for s in spans]}")
            time.sleep(0.1)
        return spans

    def close(self) -> None:
        self._server.stop(None)

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
