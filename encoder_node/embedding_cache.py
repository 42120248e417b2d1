"""The encoder's embedding cache: finished embeddings by content digest, LRU within a byte budget.

The digest (client/wire.content_digest, computed in preprocess.py) covers the image bytes, the
resize bounds, the image loader, the datatype, the weights and the tower implementation, so an
entry is only ever served for the same computation. Entries are immutable `bytes` made once
from the tower's output: a hit is streamed as is and never races a later write.

Concurrent requests for one digest share one forward (`claim`): the first caller computes, the
others await its result; if it fails or is cancelled they compute themselves, so nobody hangs.
Everything runs on the node's event loop (no locks).
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from encdis.client.embedding import DATATYPES

DEFAULT_MAX_BYTES = 2 * 1024**3
DEFAULT_SHARE = 0.05  # of the memory limit


@dataclass(frozen=True)
class CachedEmbedding:
    """One finished embedding: its bytes and what they mean."""

    data: bytes
    grid_thw: tuple[int, int, int]
    shape: tuple[int, int]
    datatype: str

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @classmethod
    def of(cls, embedding, grid_thw: tuple[int, int, int], datatype: str) -> CachedEmbedding:
        """One copy of a CPU tensor's raw bytes, made once: nothing writes them afterwards."""
        raw = embedding.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return cls(raw, tuple(grid_thw), (int(embedding.shape[0]), int(embedding.shape[1])), datatype)

    def tensor(self) -> torch.Tensor:
        """A read-only view as the tower's dtype, for the reply framing (which only reads it)."""
        dtype = getattr(torch, DATATYPES[self.datatype].torch)
        with warnings.catch_warnings():  # frombuffer warns that bytes are not writable: they are never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self.data, dtype=dtype).reshape(self.shape)


def memory_limit_bytes(cgroup_root: Path = Path("/sys/fs/cgroup"),
                       physical: Callable[[], int] | None = None) -> int:
    """The memory this process may use: its cgroup's limit (v2 memory.max, v1
    memory.limit_in_bytes) when one is set, else the host's physical RAM."""
    for name in ("memory.max", "memory/memory.limit_in_bytes", "memory.limit_in_bytes"):
        try:
            text = (cgroup_root / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            ram = (physical or _physical_ram)()
            value = int(text)
            # v1 writes a huge number for "no limit": anything above the RAM is no limit.
            if 0 < value < ram:
                return value
            return ram
    return (physical or _physical_ram)()


def _physical_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget(limit_bytes: int) -> int:
    """--cache-bytes -1: a modest share of the memory limit, at most 2 GiB."""
    return min(DEFAULT_MAX_BYTES, int(limit_bytes * DEFAULT_SHARE))


class EmbeddingCache:
    """LRU of CachedEmbedding by digest, at most `budget_bytes` in all (0: off)."""

    def __init__(self, budget_bytes: int, metrics=None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._metrics = metrics
        self._entries: OrderedDict[str, CachedEmbedding] = OrderedDict()
        self._bytes = 0
        self._computing: dict[str, asyncio.Future[CachedEmbedding]] = {}
        if metrics is not None:
            metrics.cache_budget_bytes.set(budget_bytes)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def has(self, digest: str) -> bool:
        """A finished entry, or one being computed (a call for it now waits for that forward and runs
        none of its own: `claim`); does not touch the LRU order."""
        fut = self._computing.get(digest)
        return digest in self._entries or (fut is not None and not fut.done())

    def get(self, digest: str) -> CachedEmbedding | None:
        entry = self._entries.get(digest)
        if entry is not None:
            self._entries.move_to_end(digest)
        return entry

    def put(self, digest: str, entry: CachedEmbedding) -> bool:
        """Store `entry` (most recent), evicting the least recently used; False if it alone exceeds the budget."""
        if not self.enabled or entry.nbytes > self.budget_bytes:
            return False
        old = self._entries.pop(digest, None)
        if old is not None:
            self._bytes -= old.nbytes
        while self._entries and self._bytes + entry.nbytes > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
            if self._metrics is not None:
                self._metrics.cache_evictions.inc()
        self._entries[digest] = entry
        self._bytes += entry.nbytes
        self._gauge()
        return True

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.cache_bytes.set(self._bytes)

    # ---- one forward per digest at a time

    def claim(self, digest: str) -> asyncio.Future[CachedEmbedding] | None:
        """None: the caller computes `digest` and must `finish` or `abandon` it. A future: another
        caller is computing it; await it (if it raises, claim again)."""
        fut = self._computing.get(digest)
        if fut is not None and not fut.done():
            return fut
        self._computing[digest] = asyncio.get_running_loop().create_future()
        return None

    def finish(self, digest: str, entry: CachedEmbedding) -> None:
        self.put(digest, entry)
        fut = self._computing.pop(digest, None)
        if fut is not None and not fut.done():
            fut.set_result(entry)

    def abandon(self, digest: str) -> None:
        """The claimed computation failed or was cancelled: waiters compute it themselves."""
        fut = self._computing.pop(digest, None)
        if fut is not None and not fut.done():
            fut.set_exception(LookupError(f"the computation of {digest} was abandoned"))
            fut.exception()  # retrieved: no "never retrieved" warning when nobody waited
