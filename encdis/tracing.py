"""OpenTelemetry traces of a node, exported over OTLP gRPC; nothing at all when off.

    tracing = Tracing.configured(settings.otlp_traces_endpoint, "encdis-encoder")
    with tracing.tracer.start_as_current_span("Encode", context=context_from_metadata(md)): ...
    metadata = trace_metadata()      # W3C traceparent/tracestate of the current span, for a call
    await tracing.shutdown()         # flush what is buffered

Off (no endpoint) means no TracerProvider, no exporter and no thread: the tracer is
OpenTelemetry's no-op tracer, whose spans record nothing. Each node holds its own provider
(never the process-global one), so several nodes in one process trace apart. The context
crosses processes as W3C trace context (`traceparent`, `tracestate`): in gRPC metadata, and in
HTTP headers (and vLLM's `trace_headers`, which it reads the same way).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_KEYS = ("traceparent", "tracestate")
# Spans are sent in batches this often (ms): soon enough to follow a request live.
EXPORT_DELAY_MS = 1000


class Tracing:
    """A node's tracer; `provider` (and its exporter) exist only when an endpoint is given."""

    def __init__(self, provider=None) -> None:
        self.provider = provider
        self.tracer: trace.Tracer = provider.get_tracer("encdis") if provider is not None else trace.NoOpTracer()

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    @classmethod
    def configured(cls, endpoint: str, service_name: str) -> Tracing:
        """Export to the OTLP gRPC `endpoint` (host:port or http(s)://host:port; http is plaintext);
        an empty endpoint: off."""
        if not endpoint:
            return cls()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        insecure = not endpoint.startswith("https://")
        target = endpoint.split("://", 1)[-1]
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=target, insecure=insecure),
                                                       schedule_delay_millis=EXPORT_DELAY_MS))
        return cls(provider)

    async def shutdown(self) -> None:
        """Flush buffered spans and stop the exporter (off the event loop: it may block on the network)."""
        if self.provider is not None:
            await asyncio.to_thread(self.provider.shutdown)


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None) -> Context:
    """The caller's trace context from gRPC metadata or HTTP headers (W3C); empty when it sent none."""
    if metadata is None:
        return Context()
    items = metadata.items() if isinstance(metadata, Mapping) else metadata
    carrier = {k.lower(): v for k, v in items if isinstance(v, str) and k.lower() in TRACE_KEYS}
    return _PROPAGATOR.extract(carrier)


def trace_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """`traceparent` (and `tracestate`) of `context` (None: the current one) for an outgoing call;
    empty when there is no recording span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return sorted(carrier.items())


def record_span(tracer: trace.Tracer, parent: trace.Span, name: str, start_ns: int, end_ns: int,
                **attributes: str | int | float) -> trace.Span:
    """A finished child span of `parent` over [start_ns, end_ns] (time.time_ns()), for a step
    measured as it happened (a queue wait, a batched forward) rather than wrapped in a block;
    returned, to parent the step's own parts."""
    span = tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns,
                             attributes=attributes)
    span.end(end_time=max(start_ns, end_ns))
    return span
