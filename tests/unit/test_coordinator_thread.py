"""The coordinator's own thread and loop: results, errors, cancellation and context cross over intact."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from encdis.client.errors import InvalidArgument
from encdis.llm_node.coordinator_thread import CoordinatorThread, LoopThread

REQUEST = contextvars.ContextVar("request", default=None)


@pytest.fixture
async def loop_thread():
    lt = LoopThread("test-loop")
    lt.start()
    yield lt
    await lt.stop()


async def test_a_coroutine_runs_on_the_other_thread_and_its_result_or_error_comes_back(loop_thread) -> None:
    async def where(x: int) -> tuple[int, int]:
        await asyncio.sleep(0)
        return threading.get_ident(), x * 2

    ident, doubled = await loop_thread.run(where, 21)
    assert ident != threading.get_ident() and doubled == 42

    async def refuse() -> None:
        raise InvalidArgument("images[1]: not an image")

    with pytest.raises(InvalidArgument, match=r"images\[1\]"):
        await loop_thread.run(refuse)


async def test_cancelling_the_caller_cancels_the_work_on_the_other_loop(loop_thread) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def long_call() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # until cancelled
        except asyncio.CancelledError:
            cancelled.set()
            raise

    caller = asyncio.ensure_future(loop_thread.run(long_call))
    assert await asyncio.to_thread(started.wait, 10)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert await asyncio.to_thread(cancelled.wait, 10), "the call on the coordinator's loop was not cancelled"


async def test_the_callers_context_crosses_over(loop_thread) -> None:
    async def read() -> str | None:
        return REQUEST.get()

    REQUEST.set("request-7")
    assert await loop_thread.run(read) == "request-7"


class StandInCoordinator:
    """A stand-in for Coordinator (its loop-bound parts record which loop ran them)."""

    hidden_size = 128

    def __init__(self) -> None:
        self.loops: dict[str, asyncio.AbstractEventLoop] = {}

    def grid_tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * grid[1] * grid[2] // 4

    async def start(self) -> None:
        self.loops["start"] = asyncio.get_running_loop()

    async def encode(self, images, *, deadline=None, grids=None):
        self.loops["encode"] = asyncio.get_running_loop()
        return [len(i) for i in images], deadline

    async def stop(self) -> None:
        self.loops["stop"] = asyncio.get_running_loop()


async def test_the_coordinator_starts_encodes_and_stops_on_one_loop_not_the_callers() -> None:
    inner = StandInCoordinator()
    ct = CoordinatorThread(inner)
    await ct.start()
    assert await ct.encode([b"ab", b"c"], deadline=5.0) == ([2, 1], 5.0)
    assert ct.hidden_size == 128 and ct.grid_tokens((1, 4, 4)) == 4  # synchronous parts pass through
    await ct.stop()
    assert inner.loops["start"] is inner.loops["encode"] is inner.loops["stop"]
    assert inner.loops["start"] is not asyncio.get_running_loop()
    await ct.stop()  # a second stop is a no-op


async def test_stopping_cancels_what_still_runs_there_and_lets_its_cleanup_finish() -> None:
    # A request the node gave up waiting for (its encoder stalled past the drain's grace) is
    # still running on the coordinator's loop at stop: its cleanup must run on a live loop, not
    # be destroyed with a closed one.
    lt = LoopThread("test-stop")
    lt.start()
    cleaned: list[str] = []
    running = threading.Event()

    async def stalled() -> None:
        running.set()
        try:
            await asyncio.Event().wait()  # never set: only a cancel ends it
        finally:
            await asyncio.sleep(0)  # cleanup that awaits, as a call's cancel does
            cleaned.append("stalled")

    started = asyncio.run_coroutine_threadsafe(stalled(), lt.loop)
    assert await asyncio.to_thread(running.wait, 30)
    await lt.stop()
    assert cleaned == ["stalled"]
    assert started.cancelled() and not lt.running and lt.loop.is_closed()
