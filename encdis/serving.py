"""gRPC node plumbing shared by the encoder node and the LLM node.

- ErrorMappingInterceptor: the one place exceptions become status codes. encdis's typed
  errors keep their code, message and details (ErrorInfo, BadRequest: client/errors.py);
  anything else is INTERNAL with a fixed message and
  the details in the log, so internals never leak and a bad request never kills a node.
- Health (grpc.health.v1) and reflection (--no-reflection leaves it out), with a HealthState
  to flip on drain; optionally a plaintext port serving health alone, for probes that
  cannot speak TLS (the kubelet's gRPC probe) when the node's own port does.
- TLS and API keys live in encdis/tls.py and encdis/auth.py; a key refusal is
  UNAUTHENTICATED like any `Unauthenticated` a handler raises.
- Prometheus metrics over HTTP on the address the node is told (--metrics-host or --host),
  the "ready" line on stdout, systemd notifications, and SIGTERM/SIGINT handling that
  starts a drain exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from encdis import sd_notify
from encdis.client.errors import EncdisError, InvalidArgument
from encdis.launcher import READY_PREFIX

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal error (details are in the node's log)"
HEALTH_PORT_MAX_REQUEST_BYTES = 4096
HEALTH_PORT_MAX_CALLS = 256


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by encdis's own handlers (`/encdis.*` methods) to status codes."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/encdis."):
            return handler
        method = handler_call_details.method
        handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method))
        return handler


class _Undecodable:
    """A request whose bytes are not the method's message: the handler answers INVALID_ARGUMENT
    (grpc itself would answer INTERNAL from inside its deserializer)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserialize):
    if deserialize is None:
        return None

    def wrapper(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # protobuf's DecodeError, or anything a malformed message raises
            return _Undecodable(e)

    return wrapper


def _check_decoded(request) -> None:
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"the request is not a valid protobuf message of this method: {request.error}")


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, EncdisError):
        log.info("%s -> %s: %s", method, exc.code.name, exc.message)
        # The details (ErrorInfo, BadRequest) go in the status trailer, as gRPC's rich error model has it.
        await context.abort(exc.code, exc.message, trailing_metadata=exc.to_status().trailing_metadata)
    log.exception("%s failed unexpectedly", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def _wrap_unary(behavior, method: str):
    async def wrapper(request, context):
        try:
            _check_decoded(request)
            return await behavior(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:  # this is the mapping point
            await _abort_for(e, context, method)

    return wrapper


def _wrap_stream(behavior, method: str):
    async def wrapper(request, context):
        try:
            _check_decoded(request)
            async for item in behavior(request, context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:  # this is the mapping point
            await _abort_for(e, context, method)

    return wrapper


class InFlight:
    """Calls in progress, so a drain can wait for them; mirrored in a gauge when given one."""

    def __init__(self, gauge=None) -> None:
        self.count = 0
        self._gauge = gauge
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.count += 1
        self._idle.clear()
        if self._gauge is not None:
            self._gauge.inc()
        try:
            yield
        finally:
            if self._gauge is not None:
                self._gauge.dec()
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no call is in progress, False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class HealthState:
    """The node's health as seen by load balancers and probes ("" and each service name)."""

    def __init__(self, servicer: health_aio.HealthServicer, service_names: Sequence[str]) -> None:
        self.servicer = servicer
        self._names = ["", *service_names]
        self.serving = False

    async def _set(self, status: int) -> None:
        for name in self._names:
            await self.servicer.set(name, status)

    async def set_serving(self) -> None:
        self.serving = True
        await self._set(health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        self.serving = False
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)


async def add_health_and_reflection(server: grpc.aio.Server, service_full_names: Sequence[str], *,
                                    reflection_enabled: bool = True) -> HealthState:
    """Register grpc.health.v1 (NOT_SERVING until set_serving) and, unless disabled, server reflection."""
    servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_full_names)
    if reflection_enabled:
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
        )
    state = HealthState(servicer, names)
    await state.set_not_serving()
    return state


async def start_health_port(health: HealthState, host: str, port: int) -> tuple[grpc.aio.Server | None, int | None]:
    """A plaintext port answering grpc.health.v1 only, with `health`'s state; port < 0: none.

    It tells no more than a load balancer sees (SERVING or not), so it needs no TLS; it is
    for probes that cannot use the node's TLS port."""
    if port < 0:
        return None, None
    # A health request is a service name: anything larger is refused unread. Watches are
    # long-lived, so calls are capped too (a probe holds one at most).
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", HEALTH_PORT_MAX_REQUEST_BYTES)],
                             maximum_concurrent_rpcs=HEALTH_PORT_MAX_CALLS)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the health port {host}:{port}")
    await server.start()
    return server, bound


def start_metrics_http(port: int, registry, host: str) -> int | None:
    """Serve `registry` at http://host:port/metrics; port 0 picks one. None (or <0): disabled."""
    if port is None or port < 0:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


def announce_ready(role: str, grpc_port: int, metrics_port: int | None, **extra: object) -> None:
    """One stdout line scripts wait for (encdis.launcher reads it), then READY=1 to systemd."""
    info = {"role": role, "grpc_port": grpc_port, "metrics_port": metrics_port, "pid": os.getpid(), **extra}
    print(READY_PREFIX + json.dumps(info), flush=True)
    sys.stdout.flush()
    sd_notify.notify("READY=1")


def notify_stopping() -> None:
    sd_notify.notify("STOPPING=1")


def install_drain_signal_handlers(
    loop: asyncio.AbstractEventLoop, on_drain: Callable[[], Awaitable[None]]
) -> asyncio.Event:
    """SIGTERM/SIGINT start `on_drain()` once; the returned event is set when it has finished."""
    done = asyncio.Event()
    started = False

    def _start() -> None:
        nonlocal started
        if started:
            return
        started = True

        async def _run() -> None:
            try:
                await on_drain()
            finally:
                done.set()

        loop.create_task(_run())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _start)
    return done
