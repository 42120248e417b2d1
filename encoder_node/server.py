"""Encoder node wiring: grpc.aio server, interceptors, health + reflection, metrics, load, drain.

The port is plaintext or TLS (encdis/tls.py); with API keys, Encode and Describe need one
(encdis/auth.py) while health and reflection stay open. The same port serves ORCA load
reports (load_report.py: OpenRcaService/StreamCoreMetrics), keyed like Encode.

Order of events:
  bind the port (health NOT_SERVING; Encode answers UNAVAILABLE "loading") -> load the
  tower and processor -> health SERVING -> one "encdis ready" line + sd_notify READY=1.
  SIGTERM/SIGINT -> health NOT_SERVING + STOPPING=1 -> new Encode calls get UNAVAILABLE
  -> wait for calls in progress (up to drain_grace_seconds) -> stop -> exit 0.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from encdis.auth import ApiKeys
from encdis.auth import interceptors as auth_interceptors
from encdis.checkpoint import weights_fingerprint
from encdis.client.pb import encoder_pb2
from encdis.encoder_node.batcher import Batcher
from encdis.encoder_node.fault_hook import with_test_fault
from encdis.encoder_node.load_report import LoadReportService, add_load_report_service
from encdis.encoder_node.metrics import EncoderMetrics
from encdis.encoder_node.preprocess import ImagePreprocessor
from encdis.encoder_node.servicer import EncoderServicer, LoadedModel, add_encoder_service
from encdis.encoder_node.settings import EncoderSettings
from encdis.encoder_node.tower import load_tower
from encdis.serving import (
    ErrorMappingInterceptor,
    add_health_and_reflection,
    announce_ready,
    install_drain_signal_handlers,
    notify_stopping,
    start_health_port,
    start_metrics_http,
)
from encdis.tls import ServerTLS, add_port
from encdis.tracing import Tracing

log = logging.getLogger(__name__)

# RPCs beyond max_concurrent_rpcs Encode calls: health checks and watches, Describe, reflection.
HEADROOM_RPCS = 64

SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name


def load_model(settings: EncoderSettings, metrics: EncoderMetrics) -> LoadedModel:
    """Tower, processor and fingerprint (blocking); the batcher is started by the caller."""
    if settings.torch_threads:
        import torch
        torch.set_num_threads(settings.torch_threads)  # process-wide: the forward thread inherits it
    tower = load_tower(settings.model, settings.resolved_tower_impl, device=settings.device,
                       dtype=settings.torch_dtype_name)
    fingerprint = weights_fingerprint(settings.model)
    pre = ImagePreprocessor(
        settings.model, weights_fingerprint=fingerprint, max_image_bytes=settings.max_image_bytes,
        max_image_pixels=settings.max_image_pixels, min_pixels=settings.min_pixels, max_pixels=settings.max_pixels,
        image_loader=settings.image_loader, datatype=tower.datatype, tower_impl=tower.impl,
        raw_pixels=tower.expects_raw_pixels,
    )
    return LoadedModel(
        tower=tower, preprocessor=pre, weights_fingerprint=fingerprint,
        batcher=Batcher(with_test_fault(tower.forward), max_batch_patches=settings.max_batch_patches,
                        max_queued_patches=settings.max_queued_patches, metrics=metrics),
        preprocess_pool=ThreadPoolExecutor(settings.preprocess_workers, thread_name_prefix="encdis-preprocess"),
    )


def server_options(settings: EncoderSettings) -> list[tuple[str, int]]:
    # A request carries up to max_images_per_request images of max_image_bytes each; gRPC caps at 2 GiB.
    max_request = min(settings.max_images_per_request * settings.max_image_bytes + (1 << 20), 2**31 - 1)
    return [
        ("grpc.max_receive_message_length", max_request),
        ("grpc.max_send_message_length", settings.max_chunk_bytes + (1 << 20)),
        ("grpc.so_reuseport", 0),
        # Coordinators ping to notice a hung encoder, at most every second (llm_node/settings.py
        # MIN_KEEPALIVE_SECONDS; half that here for timer jitter): permit it, also between
        # calls, instead of answering GOAWAY "too_many_pings".
        ("grpc.http2.min_ping_interval_without_data_ms", 500),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class EncoderNode:
    """One running encoder node; `serve` returns its exit code after a drain."""

    def __init__(self, settings: EncoderSettings) -> None:
        self.settings = settings
        self.metrics = EncoderMetrics()
        self.tracing = Tracing.configured(settings.otlp_traces_endpoint, "encdis-encoder")
        self.servicer = EncoderServicer(settings, self.metrics, self.tracing)
        self.load_reports = LoadReportService(self.metrics)
        self.model: LoadedModel | None = None
        self.server: grpc.aio.Server | None = None
        self.health = None
        self.port = 0
        self.metrics_port: int | None = None
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None

    async def start(self) -> None:
        """Bind and start the server, then load the model; health turns SERVING at the end."""
        s = self.settings
        api_keys = ApiKeys.configured(s.api_key_file)  # before binding: a bad key file fails the start
        self.server = grpc.aio.server(
            interceptors=[*auth_interceptors(api_keys), ErrorMappingInterceptor()], options=server_options(s),
            # Encode calls are limited by the servicer; this hard cap leaves room for health/Describe.
            maximum_concurrent_rpcs=s.max_concurrent_rpcs + HEADROOM_RPCS,
        )
        add_encoder_service(self.servicer, self.server)
        add_load_report_service(self.load_reports, self.server)
        self.health = await add_health_and_reflection(self.server, [SERVICE_NAME], reflection_enabled=s.reflection)
        tls = ServerTLS.from_flags(s.tls_cert, s.tls_key, s.tls_client_ca)
        self.port = add_port(self.server, bind_address(s.host, s.port), tls)
        if self.port == 0:
            raise OSError(f"cannot bind {bind_address(s.host, s.port)}")
        await self.server.start()
        self.health_server, self.health_port = await start_health_port(self.health, s.host, s.health_port)
        self.metrics_port = start_metrics_http(s.metrics_port, self.metrics.registry, host=s.metrics_host or s.host)
        log.info("encoder node listening on port %d; loading %s on %s", self.port, s.model, s.device)
        self.model = await asyncio.to_thread(load_model, s, self.metrics)
        self.model.batcher.start()
        self.servicer.attach(self.model)
        self.load_reports.batcher = self.model.batcher
        await self.health.set_serving()

    async def drain(self) -> None:
        """NOT_SERVING first; new calls still accepted for drain_accept_seconds (coordinators see
        the health change meanwhile), then refused; calls in progress finish; then stop."""
        log.info("draining: %d calls in progress", self.servicer.inflight)
        if self.health is not None:
            await self.health.set_not_serving()
        notify_stopping()
        await asyncio.sleep(self.settings.drain_accept_seconds)
        self.servicer.start_draining()
        if not await self.servicer.wait_idle(self.settings.drain_grace_seconds):
            log.warning("drain grace of %.0fs over with %d calls in progress; stopping anyway",
                        self.settings.drain_grace_seconds, self.servicer.inflight)
        await self.stop(grace=1.0)

    async def stop(self, grace: float | None = None) -> None:
        self.load_reports.close()
        if self.server is not None:
            await self.server.stop(grace)
        self.servicer.colocated.close_all()
        if self.health_server is not None:
            await self.health_server.stop(None)
        if self.model is not None:
            await self.model.batcher.close()
            self.model.preprocess_pool.shutdown(wait=False, cancel_futures=True)
        await self.tracing.shutdown()


async def serve(settings: EncoderSettings) -> int:
    """Run an encoder node until SIGTERM/SIGINT has drained it; returns the exit code."""
    node = EncoderNode(settings)
    drained = install_drain_signal_handlers(asyncio.get_running_loop(), node.drain)
    start = asyncio.ensure_future(node.start())
    signalled = asyncio.ensure_future(drained.wait())
    await asyncio.wait({start, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # a signal during loading: the drain stopped the server, nothing was in flight
        start.cancel()
        return 0
    if start.exception() is not None:
        log.error("encoder node failed to start: %s", start.exception(), exc_info=start.exception())
        signalled.cancel()
        await node.stop(grace=0)
        return 1
    announce_ready("encoder", node.port, node.metrics_port, health_port=node.health_port)
    await signalled
    log.info("encoder node stopped")
    return 0
