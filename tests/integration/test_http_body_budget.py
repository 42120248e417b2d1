"""Request bodies in flight share one budget: eight 200 MiB bodies at once against 512 MiB.

The real door (uvicorn, the node's app, its Admission) in this process, over raw sockets, so the
test sees what the node answers before a body is sent, and the process's own memory is the
node's. A body is counted at twice its bytes (its peak while parsed), so one 200 MiB body fits
the budget: the other seven get 429 with Retry-After before a byte of theirs is read, and the
process grows by no more than the budget and a margin while the one admitted is read and parsed.
Nothing here reaches an engine.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import psutil
import pytest

from tests.integration.test_http_limits import answer, engineless_door, open_post
from tests.needs import require_module

require_module("fastapi")
require_module("uvicorn")

from encdis.llm_node.http_front import PARSE_PEAK  # noqa: E402

MIB = 1 << 20
BODY = 200 * MIB
BUDGET = 512 * MIB
BODIES = 8
MARGIN = 64 * MIB  # the read buffer's growth slack and the interpreter's own churn
REFUSAL_WAIT_SECONDS = 60  # only a guard against a door that reads before refusing


class PeakRss:
    """The process's resident memory, sampled every 5 ms on a thread until stopped: its peak."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
async def door(tiny_ckpt: Path):
    front, _, app = engineless_door(tiny_ckpt, max_body_bytes=256 * MIB, body_budget_bytes=BUDGET,
                                    max_concurrent_requests=BODIES)
    port = await front.start()
    yield port, app
    await front.stop()


async def test_bodies_that_do_not_fit_the_budget_get_429_unread_and_memory_stays_within_it(door) -> None:
    port, app = door
    assert BODY * PARSE_PEAK <= BUDGET < 2 * BODY * PARSE_PEAK  # exactly one body fits
    conns = [await open_post(port, {"content-length": str(BODY)}) for _ in range(BODIES)]
    # No body byte is sent yet: every answer that arrives now was given unread.
    waits = [asyncio.ensure_future(answer(reader)) for reader, _ in conns]
    done, pending = await asyncio.wait(waits, timeout=REFUSAL_WAIT_SECONDS,
                                       return_when=asyncio.FIRST_COMPLETED)
    while len(done) < BODIES - 1:
        more, pending = await asyncio.wait(pending, timeout=REFUSAL_WAIT_SECONDS,
                                           return_when=asyncio.FIRST_COMPLETED)
        assert more, f"only {len(done)} of {BODIES - 1} refusals came"
        done |= more
    refused = [w.result() for w in done]
    assert all(status == 429 and headers["retry-after"] for status, _, headers in refused), refused
    assert all("budget" in body["error"]["message"] for _, body, _ in refused)
    [admitted] = pending
    reader, writer = conns[waits.index(admitted)]
    baseline = psutil.Process().memory_info().rss
    with PeakRss() as rss:
        piece = b" " * MIB
        for _ in range(BODY // MIB - 1):
            writer.write(piece)
            await writer.drain()
        writer.write(b" " * (MIB - 1) + b"[")  # the whole body, then JSON that does not parse
        await writer.drain()
        status, body, _ = await admitted
    assert status == 400 and "not valid JSON" in body["error"]["message"], body
    growth = rss.peak - baseline
    assert growth <= BUDGET + MARGIN, f"grew by {growth / MIB:.0f} MiB reading one {BODY // MIB} MiB body"
    assert app.budget.held == 0  # every reservation given back
    for _, w in conns:
        w.close()
