"""The coordinator on its own thread and event loop, so receiving embeddings cannot stall token streams.

Role: the node's event loop streams every request's tokens (gRPC and SSE) and drives vLLM's
AsyncLLM. Receiving an embedding (gRPC frames, checks, the tensor over its bytes) is work
proportional to its size: eight 4K-image embeddings of a 72B model are 1.4 GB. On the main
loop that work delays every other callback; on this thread it competes only for the GIL,
which Python hands over every switch interval. The node runs with SWITCH_INTERVAL_SECONDS (1 ms,
Python's default is 5): bench/data_plane/receive_lag.py measures the three side by side (eight 4K 72B
embeddings at once, p99 lag of the main loop: 23 ms on it, 15 ms here at 5 ms, 7.8 ms at 1 ms).

Everything of the coordinator that touches its channels (start, encode, stop, its health
watches and load-report streams) runs on this thread's loop, where its gRPC channels were
made. Its synchronous, read-only parts (grid arithmetic, image probes, ListEncoders' view of
the pool) are called from any thread, as before: they read state, they do not await.

A request cancelled on the main loop cancels its encode here (asyncio.wrap_future cancels the
concurrent future, which cancels the task on this loop), and the caller's context (its
OpenTelemetry span) is copied over, so the coordinator's spans stay children of the request's.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from encdis.llm_node.coordinator import Coordinator
    from encdis.llm_node.coordinator.records import EncodeResult

T = TypeVar("T")
START_TIMEOUT_SECONDS = 30.0
# The GIL switch interval the LLM node runs with (Python's default is 5 ms): how long the main
# loop may wait for the GIL while this thread receives (bench/data_plane/receive_lag.py, "thread+1ms").
SWITCH_INTERVAL_SECONDS = 0.001
# How long stopping waits for the tasks still running on the thread's loop to end once cancelled.
STOP_TIMEOUT_SECONDS = 10.0


async def _finish_tasks(timeout: float) -> None:
    """Cancel every other task of the running loop, wait up to `timeout` for them, close its async generators."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    await asyncio.get_running_loop().shutdown_asyncgens()


class LoopThread:
    """An event loop of its own on a daemon thread; `run` awaits a coroutine function there from any loop."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_SECONDS):
            raise RuntimeError(f"thread {self._thread.name} did not start its loop")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    async def run(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) run as a task on this thread's loop, in a copy of the caller's context."""
        ctx = contextvars.copy_context()

        async def in_context() -> T:
            # The task inherits ctx; awaiting it here means cancelling this cancels it too.
            return await ctx.run(asyncio.ensure_future, fn(*args, **kwargs))

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(in_context(), self.loop))

    async def stop(self) -> None:
        """Cancel what still runs there and let it finish (as asyncio.run does at its end), then
        stop the loop and join the thread. A task left pending would be destroyed with the closed
        loop: its cleanup (a call's cancel, a cache claim's failure) would never run."""
        if not self._thread.is_alive():
            return
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_finish_tasks(STOP_TIMEOUT_SECONDS), self.loop))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, START_TIMEOUT_SECONDS)
        if not self._thread.is_alive():
            self.loop.close()


class CoordinatorThread:
    """A Coordinator whose loop is a dedicated thread; `encode` is awaited from any other loop."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self._loop = LoopThread("encdis-coordinator")

    def __getattr__(self, name: str) -> Any:
        # grid_tokens, hidden_size, image_grids, encoders(), pool, tracing: the synchronous parts.
        return getattr(self.coordinator, name)

    async def start(self) -> None:
        self._loop.start()
        await self._loop.run(self.coordinator.start)

    async def encode(self, images: Any, **kwargs: Any) -> EncodeResult:
        """Coordinator.encode on the coordinator's loop (same arguments, errors and result)."""
        return await self._loop.run(self.coordinator.encode, images, **kwargs)

    async def stop(self) -> None:
        if not self._loop.running:
            return
        try:
            await self._loop.run(self.coordinator.stop)
        finally:
            await self._loop.stop()
