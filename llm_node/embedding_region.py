"""The shared region: each embedding a request needs, written once into shared memory, keyed by digest.

An image's rows (the engine's dtype, row-major) are in a file named by its digest in a directory
on tmpfs while any of the node's requests that need them is in flight; the last one to end,
however it ends, removes it. The coordinator receives embeddings into files of the region
(`buffer`), so the digest's file is a hard link to the received bytes; rows from elsewhere are
written. vLLM's engine reads them through encdis's encoder-cache connector
(llm_node/ec_connector.py) by hard links, so no file is ever read after it is gone:

- the engine core's scheduler pins each digest for a request (`<digest>.pin.<request>`) before the
  request is scheduled, and drops the pin when the request finishes in the core;
- for each load it schedules, it links one file per rank (`<digest>.load.<n>.<rank>`); the rank
  maps its file (a view on CPU, one host-to-device copy on GPU) and removes the link at once.

A link shares the file's pages: the bytes exist once, until the last link is gone and the last
worker that mapped them drops them from its encoder cache.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterable

import numpy as np
import torch

REGION_PARENT = "/dev/shm"  # tmpfs: the pages are memory, shared by every process that maps them
SAFE_DIGEST = re.compile(r"[0-9A-Za-z_\-]{1,128}")  # a file name, never a path; no "." (the links' separator)


PREFIX = "encdis-region-"  # then the owning node's pid and its start time


def remove_stale_regions(parent: str) -> list[str]:
    """Remove the regions of nodes that are gone (killed, crashed): a region outlives its process
    on tmpfs, and a node restarted in the same pod or host would otherwise leave one per crash.
    A region is its node's while a process of that pid runs that started when the node did (a
    restarted container is often pid 1 again)."""
    removed = []
    for name in os.listdir(parent):
        if not name.startswith(PREFIX):
            continue
        try:
            pid, started = name[len(PREFIX):].split("-")[:2]
            owner = (int(pid), int(started))
        except ValueError:
            continue
        if _started(owner[0]) != owner[1]:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(name)
    return removed


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot; None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


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
        base = parent or (REGION_PARENT if os.path.isdir(REGION_PARENT) else tempfile.gettempdir())
        remove_stale_regions(base)
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{_started(os.getpid())}-", dir=base)
        self._lock = threading.Lock()
        self._users: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._written: dict[str, threading.Event] = {}
        self._failed: dict[str, BaseException] = {}
        self._buffers: dict[int, tuple[str, int]] = {}  # receive buffer address -> (its file, bytes)
        self._buffer_ids = itertools.count()

    def room_bytes(self) -> int:
        """Free bytes of the filesystem the region is on."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._users)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def buffer(self, nbytes: int) -> np.ndarray:
        """A receive buffer in the region (the coordinator's `receive_buffers`): an embedding received
        into it is in the region already, so a request holding it links the file instead of copying
        the rows. Its file goes when the last tensor over the buffer does (the coordinator's cache
        evicting it, or the request ending). Where the region has no room, the heap."""
        path = os.path.join(self.path, f"buf.{next(self._buffer_ids)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return np.empty(nbytes, dtype=np.uint8)
        try:
            # Reserved now: a full tmpfs is an error here, rather than SIGBUS on a write to the mapping.
            os.posix_fallocate(fd, 0, nbytes)
            mapped = mmap.mmap(fd, nbytes)
        except (OSError, ValueError):
            remove_file(path)
            return np.empty(nbytes, dtype=np.uint8)
        finally:
            os.close(fd)
        array = np.frombuffer(mapped, dtype=np.uint8)
        address = array.ctypes.data
        with self._lock:
            self._buffers[address] = (path, nbytes)
        weakref.finalize(mapped, self._buffer_gone, address, path)
        return array

    def _buffer_gone(self, address: int, path: str) -> None:
        with self._lock:
            self._buffers.pop(address, None)
        remove_file(path)

    def file_of(self, rows: torch.Tensor) -> str | None:
        """The region file `rows` are the whole of, if they were received into one."""
        if not rows.is_contiguous():
            return None
        with self._lock:
            path, nbytes = self._buffers.get(rows.data_ptr(), (None, 0))
        return path if nbytes == rows.numel() * rows.element_size() else None

    def links_only(self, images: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Whether `acquire` would copy no bytes and wait for no other request's copy: each image is
        held and written already, or its rows were received into the region (a link, microseconds).
        Then a caller may acquire on the event loop instead of paying a thread hop. (Another request
        starting to write the same digest from a worker thread at this very moment, with other
        rows for it, would still make `acquire` wait for that write: a cache eviction and a new
        encode of the digest within the same microseconds.)"""
        for digest, rows in images:
            with self._lock:
                written = self._written.get(digest)
            if written is not None:
                if not written.is_set():
                    return False
            elif (self.dtype is not None and rows.dtype != self.dtype) or self.file_of(rows) is None:
                return False
        return True

    def acquire(self, images: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hold each (digest, rows) for one request, writing the ones not in the region yet.

        Blocking (a copy of every new byte not received into the region): run it off the event
        loop. On failure nothing stays held for this request."""
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
            received = self.file_of(rows)
            if received is not None:
                os.link(received, final)  # received into the region: the same pages, no copy
            else:
                with open(partial, "wb") as f:
                    f.write(tensor_bytes(rows))
                os.rename(partial, final)  # a reader never sees part of the rows
            with self._lock:
                self._sizes[digest] = rows.numel() * rows.element_size()
        except BaseException as e:
            self._failed[digest] = e
            remove_file(partial)
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
                remove_file(os.path.join(self.path, digest))

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def remove_file(path: str) -> None:
    """Remove `path`; gone already is fine (the node and the engine each remove what they hold)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
