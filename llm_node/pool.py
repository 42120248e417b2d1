"""The coordinator's encoder pool: which encoder nodes exist and which may get work.

Targets are static addresses or DNS names with a port (a Kubernetes headless Service
resolves to every encoder pod); names are re-resolved every `refresh_seconds`, so new
encoders join without a restart and addresses that vanish leave once idle. Each encoder
gets one grpc.aio channel, an AsyncEncoderClient and a watcher task that follows
grpc.health.v1 `Watch` on the EncoderService and reconnects with backoff.

Every time an encoder (re)becomes SERVING it is `Describe`d first: one whose weights
fingerprint, embedding hidden size or image-processor geometry differs from the LLM
checkpoint's is REFUSED (logged at WARNING with the reason, never routed to), because a
mismatched encoder gives wrong answers silently.

States: connecting (no health answer yet, or NOT_SERVING from a node not seen serving since
the connection was made: still loading), serving (the only routable state), draining
(health NOT_SERVING), unhealthy (unreachable, watch broken, or a call just failed),
refused (model mismatch).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis.client.encoder_client import CHANNEL_OPTIONS, AsyncEncoderClient, EncoderDescription
from encdis.client.errors import EncdisError

from .assignment import Backlog, EncoderLoad
from .dns_resolver import Resolver, is_ip_literal, join_host_port, split_host_port

log = logging.getLogger(__name__)

ENCODER_SERVICE = "encdis.encoder.v1.EncoderService"

# Reconnect quickly after an encoder restarts: gRPC's default backoff grows to 120 s.
POOL_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
WATCH_BACKOFF_MIN_S = 0.1
WATCH_BACKOFF_MAX_S = 2.0


class EncoderState(str, Enum):
    CONNECTING = "connecting"
    SERVING = "serving"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"
    REFUSED = "refused"


@dataclass(frozen=True)
class ModelIdentity:
    """What an encoder must match to be routed to: the LLM checkpoint's tower and processor."""

    weights_fingerprint: str
    hidden_size: int
    min_pixels: int
    max_pixels: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2


def refusal_reason(desc: EncoderDescription, want: ModelIdentity) -> str | None:
    """Why this encoder must not serve the LLM checkpoint, or None if it matches."""
    if desc.weights_fingerprint != want.weights_fingerprint:
        return (f"weights_fingerprint {desc.weights_fingerprint[:16]}... differs from the LLM checkpoint's "
                f"{want.weights_fingerprint[:16]}... (another checkpoint)")
    if desc.out_hidden_size != want.hidden_size:
        return f"out_hidden_size {desc.out_hidden_size} differs from the LLM's hidden size {want.hidden_size}"
    for name in ("patch_size", "merge_size", "temporal_patch_size"):
        got, expected = getattr(desc, name), getattr(want, name)
        if got and got != expected:
            return f"{name} {got} differs from the LLM checkpoint's {expected}"
    # The coordinator sends the checkpoint's resize bounds with every request.
    if desc.min_pixels and desc.min_pixels > want.min_pixels:
        return f"its min_pixels {desc.min_pixels} is above the LLM checkpoint's {want.min_pixels}"
    if desc.max_pixels and desc.max_pixels < want.max_pixels:
        return f"its max_pixels {desc.max_pixels} is below the LLM checkpoint's {want.max_pixels}"
    return None


class EncoderHandle:
    """One encoder address: its connection, state, cost model and the work it holds."""

    def __init__(self, address: str, name: str, cost_model: Any) -> None:
        self.address = address
        self.names: set[str] = set(name.split(","))
        self.state = EncoderState.CONNECTING
        self.reason = ""
        self.description: EncoderDescription | None = None
        self.cost_model = cost_model
        self.channel = grpc.aio.insecure_channel(address, options=POOL_CHANNEL_OPTIONS)
        self.client = AsyncEncoderClient(address, channel=self.channel)
        self.assigned_patches = 0
        self.assigned_images = 0
        self.active_calls = 0
        self.gone = False  # its DNS name no longer lists it; removed once idle
        # Its health is being (re)established: a request may wait a little for the outcome.
        self.settling = True
        # It said SERVING since the connection last broke: a later NOT_SERVING means draining,
        # while NOT_SERVING from a node not seen serving means it is (re)starting: loading.
        self.was_serving = False
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return ",".join(sorted(self.names))

    @property
    def routable(self) -> bool:
        return self.state is EncoderState.SERVING and not self.gone

    def __repr__(self) -> str:
        return f"<encoder {self.address} {self.state.value}{': ' + self.reason if self.reason else ''}>"


class EncoderPool:
    """Encoder handles by address, kept in step with the targets and their health."""

    def __init__(
        self,
        targets: Sequence[str],
        identity: ModelIdentity,
        *,
        cost_model_factory: Callable[[], Any],
        resolver: Resolver | None = None,
        refresh_seconds: float = 10.0,
        describe_timeout: float = 10.0,
        on_change: Callable[[], None] | None = None,
        on_remove: Callable[[str], None] | None = None,
    ) -> None:
        self.targets = [(t.strip(), *split_host_port(t)) for t in targets if t.strip()]
        self.identity = identity
        self.cost_model_factory = cost_model_factory
        self.resolver = resolver or Resolver()
        self.refresh_seconds = refresh_seconds
        self.describe_timeout = describe_timeout
        self.on_change = on_change
        self.on_remove = on_remove  # called with the address of an encoder that left the pool
        self._handles: dict[str, EncoderHandle] = {}
        # Outstanding work per encoder address (H2's tracker: decays while work is in flight).
        self._backlog = Backlog()
        self._changed = asyncio.Event()
        self._refresh_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh()
        if any(not is_ip_literal(host) for _, host, _ in self.targets):
            self._refresh_task = asyncio.create_task(self._refresh_loop(), name="encdis-pool-refresh")

    async def stop(self) -> None:
        self._stopped = True
        if self._refresh_task is not None:
            await _cancel_and_wait(self._refresh_task)
        for h in list(self._handles.values()):
            await self._remove(h)

    # -- views -----------------------------------------------------------------

    def encoders(self) -> list[EncoderHandle]:
        return list(self._handles.values())

    def serving(self) -> list[EncoderHandle]:
        return [h for h in self._handles.values() if h.routable]

    def summary(self) -> str:
        """One line naming every encoder's state, for error messages."""
        if not self.targets:
            return "no encoders configured"
        parts = [f"{h.address} {h.state.value}" + (f" ({h.reason})" if h.reason else "")
                 for h in self._handles.values()]
        listed = {name for h in self._handles.values() for name in h.names}
        parts += [f"{t} resolves to no address" for t, _, _ in self.targets if t not in listed]
        return "; ".join(parts)

    async def wait_changed(self, timeout: float) -> bool:
        """Wait until some encoder changes state (True) or `timeout` passes (False)."""
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return False
        return True

    # -- work in flight --------------------------------------------------------------

    def add_work(self, h: EncoderHandle, patches: int) -> int:
        """An image was sent to `h`; returns the ticket to `complete_work` with."""
        h.assigned_patches += patches
        h.assigned_images += 1
        return self._backlog.add(h.address, patches, time.monotonic())

    def complete_work(self, ticket: int) -> None:
        """That image arrived, or its call failed: it no longer loads its encoder."""
        self._backlog.complete(ticket, time.monotonic())

    def backlog_seconds(self, h: EncoderHandle) -> float:
        return self._backlog.seconds(h.address, h.cost_model, time.monotonic())

    def backlog_patches(self, h: EncoderHandle) -> int:
        return sum(self._backlog.outstanding(h.address))

    def loads(self, handles: Sequence[EncoderHandle]) -> list[EncoderLoad]:
        """The `encoders` argument of assignment.assign for these handles."""
        now = time.monotonic()
        return [EncoderLoad(h.address, self._backlog.seconds(h.address, h.cost_model, now), h.cost_model)
                for h in handles]

    # -- what the coordinator reports ------------------------------------------------

    def acquire(self, h: EncoderHandle) -> None:
        """A call to `h` starts: it stays in the pool at least until `release`."""
        h.active_calls += 1

    def release(self, h: EncoderHandle) -> None:
        h.active_calls -= 1
        if h.gone and h.active_calls == 0:
            task = asyncio.get_running_loop().create_task(self._remove(h))
            self._background.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._background.discard)

    def report_failure(self, h: EncoderHandle, reason: str, *, refuse: bool = False) -> None:
        """A call to `h` failed: take it out of rotation until its health watch says otherwise."""
        if h.state is EncoderState.REFUSED:
            return
        if refuse:
            log.warning("encoder %s refused: %s", h.address, reason)
            self._set(h, EncoderState.REFUSED, reason)
        else:
            self._set(h, EncoderState.UNHEALTHY, reason)
            # Reconnect and re-Describe now rather than trusting the old watch stream; requests
            # may wait for the outcome (a transient reset should not fail them).
            h.settling = True
        h._kick.set()

    # -- membership ------------------------------------------------------------------

    async def refresh(self) -> None:
        """Resolve every target now and add/retire encoders accordingly."""
        wanted: dict[str, set[str]] = {}  # address -> the targets listing it
        keep_unknown: set[str] = set()  # targets whose lookup failed: keep their current addresses
        for target, host, port in self.targets:
            addresses = await self.resolver.resolve(host)
            if addresses is None:
                keep_unknown.add(target)
                continue
            for ip in addresses:
                wanted.setdefault(join_host_port(ip, port), set()).add(target)
        for address, targets in wanted.items():
            h = self._handles.get(address)
            if h is None:
                self._add(address, ",".join(sorted(targets)))
                continue
            h.names = targets | (h.names & keep_unknown)
            if h.gone:
                h.gone = False
                log.info("encoder %s is listed again by %s", address, h.name)
                self._notify()
        for address, h in list(self._handles.items()):
            if address in wanted or h.names & keep_unknown:
                continue
            if not h.gone:
                log.info("encoder %s no longer listed by %s; leaving the pool once idle", address, h.name)
                h.gone = True
                self._notify()
            if h.active_calls == 0:
                await self._remove(h)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a refresh must never kill the loop
                log.exception("refreshing the encoder pool failed")

    def _add(self, address: str, name: str) -> EncoderHandle:
        h = EncoderHandle(address, name, self.cost_model_factory())
        self._handles[address] = h
        h._task = asyncio.create_task(self._watch_loop(h), name=f"encdis-watch-{address}")
        log.info("encoder %s joins the pool (from %s)", address, name)
        self._notify()
        return h

    async def _remove(self, h: EncoderHandle) -> None:
        if self._handles.get(h.address) is not h:
            return
        del self._handles[h.address]
        self._backlog.forget(h.address)
        if h._task is not None:
            await _cancel_and_wait(h._task)
        await h.channel.close()
        if not self._stopped:
            log.info("encoder %s left the pool", h.address)
            if self.on_remove is not None:
                self.on_remove(h.address)
        self._notify()

    # -- health ----------------------------------------------------------------------

    def _set(self, h: EncoderHandle, state: EncoderState, reason: str = "") -> None:
        was_settling, h.settling = h.settling, False
        if h.state is state and h.reason == reason:
            if was_settling:
                self._notify()
            return
        if state is not EncoderState.REFUSED:
            log.info("encoder %s: %s -> %s%s", h.address, h.state.value, state.value,
                     f" ({reason})" if reason else "")
        h.state, h.reason = state, reason
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        if self.on_change is not None:
            self.on_change()

    async def _watch_loop(self, h: EncoderHandle) -> None:
        backoff = WATCH_BACKOFF_MIN_S
        while True:
            h._kick.clear()
            watch = asyncio.create_task(self._watch_once(h))
            kick = asyncio.create_task(h._kick.wait())
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
                    self._set(h, EncoderState.UNHEALTHY, "health watch ended")
                else:
                    got_answer = getattr(exc, "got_answer", False)
                    self._set(h, EncoderState.UNHEALTHY, _describe_error(exc))
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
                        if refusal is not None and (h.state is not EncoderState.REFUSED or h.reason != refusal):
                            log.warning("encoder %s refused: %s", h.address, refusal)
                    if refusal is not None:
                        self._set(h, EncoderState.REFUSED, refusal)
                        continue
                    self._set(h, EncoderState.SERVING)
                elif status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    if not h.was_serving:
                        self._set(h, EncoderState.CONNECTING, "health NOT_SERVING: still loading")
                    elif h.state is not EncoderState.REFUSED:
                        self._set(h, EncoderState.DRAINING, "health NOT_SERVING")
                elif status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
                    self._set(h, EncoderState.UNHEALTHY, f"health service does not know {ENCODER_SERVICE}")
                else:
                    self._set(h, EncoderState.UNHEALTHY, "health status UNKNOWN")
        except grpc.aio.AioRpcError as e:
            e.got_answer = got_answer  # type: ignore[attr-defined]
            raise
        finally:
            call.cancel()
        return got_answer


async def _cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it has finished.

    Not `with suppress(CancelledError): await task`: that would also swallow a cancellation
    of the *caller* arriving meanwhile (e.g. stop() cancelling the refresh loop while it
    removes an encoder), and the caller would then run on forever.
    """
    task.cancel()
    await asyncio.wait({task})


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"health watch: {exc.code().name}: {exc.details()}"
    if isinstance(exc, EncdisError):
        return f"describe failed: {exc}"
    return f"health watch: {exc!r}"


def states_count(handles: Iterable[EncoderHandle]) -> dict[str, int]:
    counts = {s.value: 0 for s in EncoderState}
    for h in handles:
        counts[h.state.value] += 1
    return counts
