"""PreparedBuffers: receive buffers made ahead in worker threads, each made once, handed out by size."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from encdis.client.receive_buffer import PreparedBuffers

WAIT_SECONDS = 30


class Maker:
    """An Allocate that records what it made; sizes in `gate` wait for the gate's event first."""

    def __init__(self) -> None:
        self.made: list[int] = []
        self.gate: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}
        self.failing: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> np.ndarray:
        self.started.setdefault(nbytes, threading.Event()).set()
        if nbytes in self.gate:
            assert self.gate[nbytes].wait(WAIT_SECONDS)
        if nbytes in self.failing:
            self.failing.discard(nbytes)
            raise OSError("no room")
        with self._lock:
            self.made.append(nbytes)
        return np.zeros(nbytes, dtype=np.uint8)


@pytest.fixture
def pool():
    with ThreadPoolExecutor(1) as executor:
        yield executor


def test_buffers_made_ahead_are_handed_out_by_size_and_not_made_again(pool) -> None:
    make = Maker()
    buffers = PreparedBuffers(make, [64, 32, 64], pool)
    buffers.wait(WAIT_SECONDS)
    assert sorted(make.made) == [32, 64, 64]
    a, b, c = buffers(64), buffers(32), buffers(64)
    assert (a.nbytes, b.nbytes, c.nbytes) == (64, 32, 64) and a is not c
    assert sorted(make.made) == [32, 64, 64]  # nothing made twice
    assert buffers(16).nbytes == 16  # a size nobody expected is made on the spot
    assert make.made[-1] == 16


def test_a_buffer_being_made_is_waited_for_and_one_not_started_is_made_now(pool) -> None:
    make = Maker()
    make.gate[64] = threading.Event()
    buffers = PreparedBuffers(make, [64, 32], pool)
    assert make.started.setdefault(64, threading.Event()).wait(WAIT_SECONDS)
    # 32 waits behind 64 in the one worker: asked for now, it is made here and its turn cancelled.
    assert buffers(32).nbytes == 32
    got: list[np.ndarray] = []
    taker = threading.Thread(target=lambda: got.append(buffers(64)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # waiting for the buffer being made, not making another
    make.gate[64].set()
    taker.join(WAIT_SECONDS)
    assert got[0].nbytes == 64
    pool.submit(lambda: None).result(WAIT_SECONDS)
    assert sorted(make.made) == [32, 64]


def test_close_keeps_buffers_not_started_from_being_made(pool) -> None:
    make = Maker()
    make.gate[64] = threading.Event()
    buffers = PreparedBuffers(make, [64, 32, 16], pool)
    assert make.started.setdefault(64, threading.Event()).wait(WAIT_SECONDS)
    buffers.close()
    make.gate[64].set()
    pool.submit(lambda: None).result(WAIT_SECONDS)
    assert make.made == [64]  # the one already being made finishes; 32 and 16 never start


def test_a_buffer_that_failed_ahead_is_made_again_when_asked(pool) -> None:
    make = Maker()
    make.failing.add(64)
    buffers = PreparedBuffers(make, [64], pool)
    buffers.wait(WAIT_SECONDS)
    assert make.made == []
    assert buffers(64).nbytes == 64
    assert make.made == [64]
