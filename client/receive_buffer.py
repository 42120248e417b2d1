"""Where an embedding's chunks land: one image's receive buffer and the copies that fill it.

The copies run in worker threads (they release the GIL); the loop that checks every call's chunks
only places them (client/wire.py's EmbeddingAssembler)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# A receive buffer of so many bytes (uint8, writable): where an embedding's chunks are put.
Allocate = Callable[[int], np.ndarray]


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
