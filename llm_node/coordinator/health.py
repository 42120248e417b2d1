"""Health watch of one encoder: grpc.health.v1 `Watch`, and `Describe` each time it serves.

Every time an encoder (re)becomes SERVING it is `Describe`d first: one whose identity
differs from the LLM checkpoint's (identity.refusal_reason) is REFUSED, logged at WARNING
with the reason and never routed to. NOT_SERVING from a node seen serving since the
connection was made means draining; from one not seen serving, still loading. A broken
stream marks it unhealthy and the watch reconnects with backoff; `EncoderHandle.kick`
restarts the watch at once (after a failed call, to re-check rather than trust the stream).
The watch sets the health view only: a penalty (quarantined, slow) is the pool's and
outlasts any SERVING the watch reports until the pool's own probe lifts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis.client.errors import EncdisError

from .handle import EncoderHandle, EncoderState
from .identity import ModelIdentity, refusal_reason

log = logging.getLogger(__name__)

ENCODER_SERVICE = "encdis.encoder.v1.EncoderService"
WATCH_BACKOFF_MIN_S = 0.1
WATCH_BACKOFF_MAX_S = 2.0


class HealthWatcher:
    """Keeps each encoder's state in step with its health stream; states go through `set_state`."""

    def __init__(self, identity: ModelIdentity, describe_timeout: float,
                 set_state: Callable[..., None],
                 on_described: Callable[[EncoderHandle, Any], Awaitable[str | None]] | None = None) -> None:
        self.identity = identity
        self.describe_timeout = describe_timeout
        self._set_state = set_state
        # After each Describe of a matching encoder (colocated.py: open its pair); a reason refuses it.
        self._on_described = on_described

    async def run(self, h: EncoderHandle) -> None:
        """Follow `h`'s health until cancelled, reconnecting with backoff."""
        backoff = WATCH_BACKOFF_MIN_S
        while True:
            h.kick.clear()
            watch = asyncio.create_task(self._watch_once(h))
            kick = asyncio.create_task(h.kick.wait())
            try:
                await asyncio.wait({watch, kick}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                kick.cancel()
                if not watch.done():
                    watch.cancel()
                await asyncio.wait({watch})  # its outcome is read below; never raises here
            got_answer = False
            if not watch.cancelled():
                # The connection broke: whatever answers next may be a restarted node (loading).
                h.was_serving = False
                exc = watch.exception()
                if exc is None:
                    got_answer = watch.result()
                    self._set_state(h, EncoderState.UNHEALTHY, "health watch ended")
                else:
                    got_answer = getattr(exc, "got_answer", False)
                    self._set_state(h, EncoderState.UNHEALTHY, _describe_error(exc))
            backoff = WATCH_BACKOFF_MIN_S if got_answer else min(backoff * 2, WATCH_BACKOFF_MAX_S)
            await asyncio.sleep(backoff)

    async def _watch_once(self, h: EncoderHandle) -> bool:
        """Follow one health Watch stream; True if it delivered any status."""
        stub = health_pb2_grpc.HealthStub(h.channel)
        described = False  # the process behind the address may have changed since the last stream
        got_answer = False
        refusal: str | None = None  # why the node behind this stream must not be routed to
        call = stub.Watch(health_pb2.HealthCheckRequest(service=ENCODER_SERVICE))
        try:
            async for resp in call:
                got_answer = True
                status = resp.status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    h.was_serving = True
                    if not described:
                        try:
                            desc = await h.client.describe(timeout=self.describe_timeout)
                        except EncdisError as e:
                            e.got_answer = True  # type: ignore[attr-defined]
                            raise
                        described = True
                        h.description = desc
                        refusal = refusal_reason(desc, self.identity)
                        if refusal is None and self._on_described is not None:
                            refusal = await self._on_described(h, desc)
                        if refusal is not None and (h.health_state is not EncoderState.REFUSED
                                                    or h.health_reason != refusal):
                            log.warning("encoder %s refused: %s", h.address, refusal)
                    if refusal is not None:
                        self._set_state(h, EncoderState.REFUSED, refusal)
                        continue
                    self._set_state(h, EncoderState.SERVING)
                elif status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    if not h.was_serving:
                        self._set_state(h, EncoderState.CONNECTING, "health NOT_SERVING: still loading")
                    elif h.health_state is not EncoderState.REFUSED:
                        self._set_state(h, EncoderState.DRAINING, "health NOT_SERVING")
                elif status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
                    self._set_state(h, EncoderState.UNHEALTHY, f"health service does not know {ENCODER_SERVICE}")
                else:
                    self._set_state(h, EncoderState.UNHEALTHY, "health status UNKNOWN")
        except grpc.aio.AioRpcError as e:
            e.got_answer = got_answer  # type: ignore[attr-defined]
            raise
        finally:
            call.cancel()
        return got_answer


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"health watch: {exc.code().name}: {exc.details()}"
    if isinstance(exc, EncdisError):
        return f"describe failed: {exc}"
    return f"health watch: {exc!r}"
