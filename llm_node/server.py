"""LLM node wiring: engine, coordinator, generation service, front doors, health, metrics, drain.

Start order: the vLLM engine first (blocking, before the event loop: vLLM's engine core
must start from the main thread), then the coordinator and the gRPC server; the node
reports SERVING and prints its ready line only when all of them are up. SIGTERM/SIGINT:
NOT_SERVING, refuse new requests, let in-flight ones finish (up to the grace period),
then stop the server, the coordinator and the engine.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from prometheus_client import CollectorRegistry

from encdis import serving
from encdis.client.pb import llm_pb2, llm_pb2_grpc
from encdis.llm_node.engine import EngineHost
from encdis.llm_node.generation import GenerationService
from encdis.llm_node.grpc_front import GenerateServicer
from encdis.llm_node.metrics import LLMNodeMetrics
from encdis.llm_node.prompt import PromptRenderer
from encdis.llm_node.settings import LLMSettings

log = logging.getLogger(__name__)

SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),  # requests carry encoded images
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


def run_node(settings: LLMSettings) -> int:
    """Run an LLM node until SIGTERM/SIGINT; the exit code."""
    engine = EngineHost(settings)
    engine.start()
    try:
        return asyncio.run(_serve(settings, engine))
    finally:
        engine.shutdown()


async def _serve(settings: LLMSettings, engine: EngineHost) -> int:
    from encdis.llm_node.coordinator import Coordinator

    towers = await engine.vision_tower()
    tower_params = sum(int(t["visual_parameters"]) for t in towers)
    log.info("vLLM workers hold %d vision-tower parameters (%s)", tower_params,
             ", ".join(str(t["visual_type"]) for t in towers))

    registry = CollectorRegistry()
    metrics = LLMNodeMetrics(registry)
    coordinator = Coordinator.from_checkpoint(settings, registry, settings.model)
    await coordinator.start()
    service = GenerationService(settings, engine, coordinator, PromptRenderer(settings.model), metrics)
    servicer = GenerateServicer(settings, service, coordinator)

    server = grpc.aio.server(interceptors=[serving.ErrorMappingInterceptor()], options=SERVER_OPTIONS)
    llm_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
    health = await serving.add_health_and_reflection(server, [SERVICE_NAME])
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {settings.host}:{settings.port}")
    await server.start()
    metrics_port = serving.start_metrics_http(settings.metrics_port, registry)
    http_server, http_port = None, None
    if settings.http_port >= 0:
        from encdis.llm_node.http_front import HttpFront, build_app

        def serving_state() -> tuple[bool, str]:
            if service.draining:
                return False, "draining"
            if not coordinator.pool or not coordinator.pool.serving():
                return False, "no encoder is serving"
            return True, "ok"

        http_server = HttpFront(build_app(settings, service, serving_state), settings.host, settings.http_port)
        http_port = await http_server.start()

    async def drain() -> None:
        log.info("draining: NOT_SERVING, refusing new requests, finishing in-flight ones")
        serving.notify_stopping()
        await health.set_not_serving()
        service.draining = True
        if not await service.wait_idle(settings.drain_grace_seconds):
            log.warning("drain grace period (%.0fs) over with requests still in flight", settings.drain_grace_seconds)
        await server.stop(grace=1.0)
        if http_server is not None:
            await http_server.stop()

    serving.install_drain_signal_handlers(asyncio.get_running_loop(), drain)
    await health.set_serving()
    serving.announce_ready("llm", port, metrics_port, http_port=http_port, vision_tower_parameters=tower_params)
    await server.wait_for_termination()
    await coordinator.stop()
    log.info("stopped")
    return 0
