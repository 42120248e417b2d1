"""Stopping the pool must stop it: a cancellation reaching a task that is itself waiting for
a cancelled task (the refresh loop removing an encoder while stop() cancels it) must not be
swallowed, or stop() waits forever on a loop that keeps running."""

from __future__ import annotations

import asyncio

import pytest

from encdis.llm_node.coordinator.pool import _cancel_and_wait


async def test_a_caller_cancelled_while_waiting_for_a_cancelled_task_is_cancelled_too():
    async def slow_to_finish():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # cleanup that takes a while (closing a channel)
            raise

    inner = asyncio.create_task(slow_to_finish())
    await asyncio.sleep(0)

    async def remove_then_continue():
        await _cancel_and_wait(inner)
        return "kept running"

    outer = asyncio.create_task(remove_then_continue())
    await asyncio.sleep(0.05)  # outer is now waiting for inner's cleanup
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    await asyncio.wait({inner})
    assert inner.cancelled()


async def test_waiting_for_a_cancelled_task_returns_once_it_finished():
    inner = asyncio.create_task(asyncio.sleep(30))
    await _cancel_and_wait(inner)
    assert inner.cancelled()
