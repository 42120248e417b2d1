"""The shared region: each embedding a request needs, written once into shared memory, keyed by digest.

The node writes an image's rows (the engine's dtype, row-major) into a file named by its digest in
a directory on tmpfs, holds it while any of its requests is in flight and removes it when the last
one ends, however it ends. vLLM's engine reads it through encdis's encoder-cache connector
(llm_node/ec_connector.py) by hard links, so no file is ever read after it is gone:

- the engine core's scheduler pins each digest for a request (`<digest>.pin.<request>`) before the
  request is scheduled, and drops the pin when the request finishes in the core;
- for each load it schedules, it links one file per rank (`<digest>.load.<n>.<rank>`); the rank
  maps its file (a view on CPU, one host-to-device copy on GPU) and removes the link at once.

A link shares the file's pages: the bytes exist once, until the last link is gone and the last
worker that mapped them drops them from its encoder cache.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable

import torch

REGION_PARENT = "/dev/shm"  # tmpfs: the pages are memory, shared by every process that maps them
SAFE_DIGEST = re.compile(r"[0-9A-Za-z_\-]{1,128}")  # a file name, never a path; no "." (the links' separator)


def pin_name(digest: str, request_id: str) -> str:
    return f"{digest}.pin.{request_id}"


def load_name(digest: str, load_id: int, rank: int) -> str:
    return f"{digest}.load.{load_id}.{rank}"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, row-major, without a copy when it is contiguous (any dtype, bf16 too)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class EmbeddingRegion:
    """The node's side of the region: write on first use, count users, remove after the last.

    Thread-safe: requests acquire from worker threads and release from the event loop."""

    def __init__(self, dtype: torch.dtype | None = None, parent: str | None = None) -> None:
        self.dtype = dtype  # the engine's, set once it is known; rows of another dtype are converted
        base = parent or (REGION_PARENT if os.path.isdir(REGION_PARENT) else None)
        self.path = tempfile.mkdtemp(prefix="encdis-region-", dir=base)
        self._lock = threading.Lock()
        self._users: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._written: dict[str, threading.Event] = {}
        self._failed: dict[str, BaseException] = {}

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._users)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def acquire(self, images: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hold each (digest, rows) for one request, writing the ones not in the region yet.

        Blocking (a copy of every new byte): run it off the event loop. On failure nothing
        stays held for this request."""
        held: list[str] = []
        try:
            for digest, rows in images:
                if not SAFE_DIGEST.fullmatch(digest):
                    raise ValueError(f"image digest {digest!r} cannot name a file in the region")
                with self._lock:
                    first = digest not in self._users
                    self._users[digest] = self._users.get(digest, 0) + 1
                    if first:
                        self._written[digest] = threading.Event()
                        self._failed.pop(digest, None)
                    written = self._written[digest]
                held.append(digest)
                if first:
                    self._write(digest, rows, written)
                else:
                    written.wait()  # another request is writing these very bytes
                    error = self._failed.get(digest)
                    if error is not None:
                        raise error
        except BaseException:
            self.release(held)
            raise

    def _write(self, digest: str, rows: torch.Tensor, written: threading.Event) -> None:
        final = os.path.join(self.path, digest)
        partial = final + ".partial"
        try:
            if self.dtype is not None and rows.dtype != self.dtype:
                rows = rows.to(self.dtype)
            with open(partial, "wb") as f:
                f.write(tensor_bytes(rows))
            os.rename(partial, final)  # a reader never sees part of the rows
            with self._lock:
                self._sizes[digest] = rows.numel() * rows.element_size()
        except BaseException as e:
            self._failed[digest] = e
            _unlink(partial)
            raise
        finally:
            written.set()

    def release(self, digests: Iterable[str]) -> None:
        """Drop one request's hold on each digest; the last hold removes the file."""
        for digest in digests:
            with self._lock:
                users = self._users.get(digest, 0) - 1
                if users > 0:
                    self._users[digest] = users
                    continue
                self._users.pop(digest, None)
                self._sizes.pop(digest, None)
                self._written.pop(digest, None)
                # Under the lock: a request acquiring the digest next writes the file anew after this.
                _unlink(os.path.join(self.path, digest))

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
