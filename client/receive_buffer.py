"""Where an embedding's chunks land: one image's receive buffer and the copies that fill it.

The copies run in worker threads (they release the GIL); the loop that checks every call's chunks
only places them (client/wire.py's EmbeddingAssembler)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass

import numpy as np

# A receive buffer of so many bytes (uint8, writable): where an embedding's chunks are put.
Allocate = Callable[[int], np.ndarray]
PAGE_BYTES = 4096  # a buffer made ahead has one byte of each page written, so its pages exist


class ReceiveBuffer:
    """One image's receive buffer. The heap's is made at once (np.empty: uncommitted until written,
    so memory grows only as announced bytes arrive); an `allocate`d one at its first copy, in the
    thread that runs it, since allocating may take time (the node's shared region reserves its
    pages) that the loop checking every call's chunks must not spend."""

    def __init__(self, nbytes: int, allocate: Allocate | None) -> None:
        self.nbytes = nbytes
        self._allocate = allocate
        self._array = np.empty(nbytes, dtype=np.uint8) if allocate is None else None
        self._lock = threading.Lock()

    def array(self) -> np.ndarray:
        if self._array is None:
            with self._lock:  # the image's copies may run in several threads
                if self._array is None:
                    self._array = self._allocate(self.nbytes)
        return self._array


class PreparedBuffers:
    """An Allocate whose buffers are made ahead, in worker threads, while the encoder still works.

    A buffer of the node's shared region costs the reservation of its pages and a fault per
    page at its first write (4K 72B, 173 MB: about 50 + 50 ms on a 2-core VM), which would
    otherwise be spent while its bytes arrive; made ahead, its pages are written once (a byte
    each) in the worker thread. Faulted page by page, not mapped with MAP_POPULATE: that holds
    the process's memory map for the whole buffer, and every other thread that allocates waits
    (bench/data_plane/receive_lag.py: the main loop stalled up to 330 ms). `sizes`: the bytes of each
    embedding the call expects.
    A call for a size takes the first unclaimed buffer of that size: made, or being made (it
    waits: shorter than starting over); not started yet, it is cancelled and made now, so no
    buffer is made twice. A size nobody expected is made now.
    """

    def __init__(self, make: Allocate, sizes: Sequence[int], executor: Executor) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._pending: list[tuple[int, Future[np.ndarray]]] = [(n, executor.submit(self._ahead, n)) for n in sizes]

    def _ahead(self, nbytes: int) -> np.ndarray:
        array = self._make(nbytes)
        array[::PAGE_BYTES] = 0  # its pages faulted in here, not in the copies (the buffer is written whole)
        return array

    def __call__(self, nbytes: int) -> np.ndarray:
        with self._lock:
            ahead = next((k for k, (n, _) in enumerate(self._pending) if n == nbytes), None)
            future = self._pending.pop(ahead)[1] if ahead is not None else None
        if future is not None and (future.done() or not future.cancel()):
            if future.exception() is None:  # waits while it is being made
                return future.result()
        return self._make(nbytes)

    def wait(self, timeout: float | None = None) -> None:
        """Return once every buffer not yet taken is made (or failed), or `timeout` passed."""
        with self._lock:
            futures = [f for _, f in self._pending]
        wait(futures, timeout)

    def close(self) -> None:
        """The buffers nobody took are not made (those not started) or dropped (the others)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for _, future in pending:
            future.cancel()


@dataclass(frozen=True)
class ChunkCopy:
    """A checked chunk and its place in its image's buffer; `run` copies it (releasing the GIL)."""

    dst: ReceiveBuffer
    start: int
    src: bytes | memoryview

    def run(self) -> None:
        self.dst.array()[self.start:self.start + self.nbytes] = np.frombuffer(self.src, dtype=np.uint8)

    @property
    def nbytes(self) -> int:
        return memoryview(self.src).nbytes
