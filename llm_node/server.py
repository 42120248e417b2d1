"""LLM node wiring: engine, coordinator, generation service, front doors, health, metrics, drain.

Start order: the engine reaper (reaper.py), the vLLM engine (blocking, before the event
loop: vLLM's engine core must start from the main thread), then the coordinator and the
front doors; the node reports SERVING and prints its ready line only when all are up.
SIGTERM/SIGINT: NOT_SERVING, refuse new requests, let in-flight ones finish (up to the
grace period), then stop the servers, the coordinator and the engine; exit 0. The engine's
death: NOT_SERVING at once, stop, exit 3 (a supervisor restarts the node).

Exposure: both front doors take the same TLS certificate (encdis/tls.py) and API keys
(encdis/auth.py); the coordinator dials encoders with the --encoder-tls-* / key settings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from encdis import serving
from encdis.auth import ApiKeys
from encdis.auth import interceptors as auth_interceptors
from encdis.client.channels import ChannelSecurity
from encdis.client.pb import llm_pb2, llm_pb2_grpc
from encdis.llm_node.coordinator_thread import SWITCH_INTERVAL_SECONDS
from encdis.llm_node.engine import EngineHost
from encdis.llm_node.generation import GenerationService
from encdis.llm_node.grpc_front import GenerateServicer
from encdis.llm_node.metrics import LLMNodeMetrics
from encdis.llm_node.prompt import PromptRenderer
from encdis.llm_node.reaper import EngineReaper
from encdis.llm_node.settings import LLMSettings
from encdis.tls import ServerTLS, add_port
from encdis.tracing import Tracing

log = logging.getLogger(__name__)

SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
MAX_RESPONSE_MESSAGE_BYTES = 64 * 1024 * 1024


def server_options(settings: LLMSettings) -> list[tuple[str, int]]:
    """The gRPC port's message limits: requests carry encoded images, answers text."""
    return [
        ("grpc.max_receive_message_length", settings.grpc_request_bytes),
        ("grpc.max_send_message_length", MAX_RESPONSE_MESSAGE_BYTES),
    ]


ENGINE_DEAD_EXIT_CODE = 3
ENGINE_WATCH_SECONDS = 0.1


def run_node(settings: LLMSettings) -> int:
    """Run an LLM node until SIGTERM/SIGINT (exit 0) or its engine's death (exit 3)."""
    try:
        exposure = Exposure.from_settings(settings)  # bad certificate or key files fail before the engine starts
    except ValueError as e:
        log.error("cannot start: %s", e)
        return 2
    # As `vllm serve` does: every cached embedding handed to the engine through shared memory
    # holds a file descriptor while it is cached, more than a default soft limit of 1024 allows.
    from vllm.utils.system_utils import set_ulimit

    set_ulimit()
    # The coordinator receives on its own thread (coordinator_thread.py): a shorter GIL switch
    # interval bounds how long the loop that streams tokens waits for the GIL meanwhile.
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    reaper = EngineReaper.start()  # first, so the engine's processes are always reaped
    engine = EngineHost(settings)
    try:
        engine.start()
        log.info("engine processes under watch: %d", reaper.watch_descendants())
        return asyncio.run(_serve(settings, engine, exposure))
    finally:
        engine.shutdown()
        reaper.close()


class VllmMetrics:
    """vLLM's own vllm:* metrics (its process-wide registry), exported beside encdis's on the metrics port."""

    def collect(self):
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.name.startswith("vllm:"):
                yield family


@dataclass(frozen=True)
class Exposure:
    """The node's TLS, API keys and encoder channel security, read from the files the settings name."""

    tls: ServerTLS | None
    api_keys: ApiKeys | None
    encoder_security: ChannelSecurity | None

    @classmethod
    def from_settings(cls, s: LLMSettings) -> Exposure:
        from encdis.llm_node.coordinator.channel_security import encoder_channel_security

        return cls(ServerTLS.from_flags(s.tls_cert, s.tls_key, s.tls_client_ca), ApiKeys.configured(s.api_key_file),
                   encoder_channel_security(s.coordinator))


async def _serve(settings: LLMSettings, engine: EngineHost, exposure: Exposure) -> int:
    from encdis.llm_node.coordinator import Coordinator
    from encdis.llm_node.coordinator.identity import expected_tower_impl
    from encdis.llm_node.coordinator_thread import CoordinatorThread

    towers = await engine.vision_tower()
    tower_params = sum(int(t["visual_parameters"]) for t in towers)
    log.info("vLLM workers hold %d vision-tower parameters (%s)", tower_params,
             ", ".join(str(t["visual_type"]) for t in towers))

    coordinator_settings = settings.coordinator
    if coordinator_settings.encoder_datatype == "auto":
        coordinator_settings = dataclasses.replace(coordinator_settings, encoder_datatype=engine.embedding_datatype())
    log.info("encoders must send %s embeddings from the %s tower", coordinator_settings.encoder_datatype,
             expected_tower_impl(coordinator_settings.encoder_tower_impl, coordinator_settings.encoder_datatype))
    registry = CollectorRegistry()
    metrics = LLMNodeMetrics(registry)
    pool_coordinator = Coordinator.from_checkpoint(coordinator_settings, registry, settings.model,
                                                   channel_security=exposure.encoder_security)
    pool_coordinator.tracing = tracing = Tracing.configured(settings.otlp_traces_endpoint, "encdis-llm")
    if engine.region is not None:  # embeddings are received into the shared region: no copy to hand them over
        pool_coordinator.receive_buffers = engine.region.buffer
    # Receiving embeddings is work in proportion to their bytes: on its own thread and loop, it
    # cannot stall this loop's token streams (coordinator_thread.py).
    coordinator = CoordinatorThread(pool_coordinator)
    await coordinator.start()
    service = GenerationService(settings, engine, coordinator, PromptRenderer(settings.model), metrics)
    if engine.region is not None:
        metrics.watch_region(engine.region)
    from encdis.llm_node.openai_layer import build_vllm_app
    from encdis.llm_node.timed_engine import TimedEngine

    # vLLM's OpenAI serving layer on the engine: the HTTP door's handlers and the gRPC door's full form.
    vllm_app = await build_vllm_app(TimedEngine(engine.llm, metrics), settings)
    registry.register(VllmMetrics())
    servicer = GenerateServicer(settings, service, coordinator, chat=vllm_app.state.openai_serving_chat)

    server = grpc.aio.server(interceptors=[*auth_interceptors(exposure.api_keys), serving.ErrorMappingInterceptor()],
                             options=server_options(settings),
                             maximum_concurrent_rpcs=settings.grpc_concurrent_rpcs)
    llm_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
    health = await serving.add_health_and_reflection(server, [SERVICE_NAME], reflection_enabled=settings.reflection)
    port = add_port(server, f"{settings.host}:{settings.port}", exposure.tls)
    if port == 0:
        raise RuntimeError(f"could not bind {settings.host}:{settings.port}")
    await server.start()
    health_server, health_port = await serving.start_health_port(health, settings.host, settings.health_port)
    metrics_port = serving.start_metrics_http(settings.metrics_port, registry, settings.metrics_host or settings.host)
    http_server, http_port = None, None
    if settings.http_port >= 0:
        from encdis.llm_node.http_front import HttpFront, build_app

        def serving_state() -> tuple[bool, str]:
            if service.draining:
                return False, "draining"
            if not coordinator.pool or not coordinator.pool.serving():
                return False, "no encoder is serving"
            return True, "ok"

        http_server = HttpFront(build_app(settings, service, serving_state, exposure.api_keys, vllm_app),
                                settings.host, settings.http_port, tls=exposure.tls)
        http_port = await http_server.start()

    async def drain() -> None:
        log.info("draining: NOT_SERVING, refusing new requests, finishing in-flight ones")
        serving.notify_stopping()
        await health.set_not_serving()
        service.draining = True
        if not await service.wait_idle(settings.drain_grace_seconds):
            log.warning("drain grace period (%.0fs) over with requests still in flight", settings.drain_grace_seconds)
        # The HTTP door first: the gRPC server's end is what lets this node exit, and an HTTP
        # door still stopping then would be cancelled halfway.
        if http_server is not None:
            await http_server.stop()
        await server.stop(grace=1.0)

    engine_died = asyncio.Event()

    async def watch_engine() -> None:
        # A dead engine fails every request, text-only too: stop serving at once and exit
        # non-zero so systemd or Kubernetes restarts the node.
        while not engine.dead:
            await asyncio.sleep(ENGINE_WATCH_SECONDS)
        log.error("the vLLM engine died: NOT_SERVING and exiting")
        engine_died.set()
        await health.set_not_serving()
        service.draining = True
        if http_server is not None:
            await http_server.stop()
        await server.stop(grace=0.5)

    watcher = asyncio.create_task(watch_engine(), name="encdis-engine-watch")
    serving.install_drain_signal_handlers(asyncio.get_running_loop(), drain)
    await health.set_serving()
    serving.announce_ready("llm", port, metrics_port, http_port=http_port, health_port=health_port,
                           vision_tower_parameters=tower_params)
    await server.wait_for_termination()
    if health_server is not None:
        await health_server.stop(None)
    watcher.cancel()
    await coordinator.stop()
    await tracing.shutdown()
    log.info("stopped")
    return ENGINE_DEAD_EXIT_CODE if engine_died.is_set() else 0
