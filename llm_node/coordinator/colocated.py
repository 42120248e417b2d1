"""Co-located transport, the coordinator's policy: which encoders get a pair, when, and fallbacks.

An encoder that shares this process's loopback (its Describe boot id and network namespace
equal this process's: encdis.pair_group.why_not_one_loopback; two pods on one Kubernetes
node share a boot id, not a loopback) gets a pairwise torch.distributed group
(colocated_link.py), reused by every Encode call to it; the header of each embedding still
comes over gRPC, the bytes over the group. Under auto the rendezvous runs in the background
after the health watch describes the encoder: the encoder serves over gRPC at once, and its
calls take the pair once it is up, so no request ever waits for a rendezvous. `--colocated`:

  off      never;
  auto     when the loopback is shared, the pair would be NCCL (both sides on CUDA) and the
           rendezvous succeeds. On CPU the pair is gloo over loopback TCP: bench/data_plane/colocated.py
           measured it at 1.2-2x gRPC's MB/s for 1080p and 4K 72B embeddings, the same for
           small ones, with much noise on a shared 2-core machine. auto still leaves CPU
           pairs on gRPC, so the CPU fault tests (encoders killed, frozen, drained) keep the
           path they were written for until they have run on gloo; `require` opts in;
  require  every encoder must be on this host and open a pair (gloo on CPU, NCCL on CUDA);
           one that cannot is refused, with the reason. A pair that fails later still
           falls back, as in auto.

Any failure of a transfer (timeout, peer gone, a call giving up) closes the pair: the
images not received go again over gRPC or to another encoder (dispatch.py), each counted
in encdis_coordinator_colocated_fallbacks_total{reason}; the pair is re-opened after
REOPEN_SECONDS. A re-described encoder (its health stream reconnected: maybe a new
process) gets a new pair.

DESIGN notes: vLLM's encoder-cache connector (vllm/distributed/ec_transfer/ec_connector/
base.py) is vLLM's place for embeddings arriving straight in each worker's encoder cache:
a scheduler-side half decides per request which mm_hash to load, a worker-side half fills
the worker's encoder_cache dict before the model gathers the embeddings. It is not used
here, for now, because (1) encdis hands embeddings to vLLM as `image_embeds` inputs from the
coordinator, which checks every embedding (rows, hidden, datatype, digest) and caches and
shares it across requests before vLLM sees it; a connector would move the receive into
every worker, outside those checks and that cache, and make the coordinator a metadata
broker instead; (2) the connector is per worker, so with TP > 1 each rank would receive
the bytes (or a rank-0 receive plus a broadcast) and the design's "received once whatever
the TP size" would go; (3) its scheduler half keys on mm_hash and has no way to refuse a
header before allocating, or to fall back to another encoder mid-request. So on NCCL the
bytes land in this process's device memory and are copied to the host for vLLM's inputs:
one device-to-host copy remains. Plugging into the connector (a consumer that reads the
coordinator's checked, device-resident tensors by digest) is the step that removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from encdis.client.encoder_client import EncoderDescription
from encdis.client.wire import Allocate
from encdis.pair_group import read_boot_id, read_net_namespace, why_not_one_loopback

from .colocated_link import CallReceiver, ColocatedLink, close_remote, open_link
from .handle import EncoderHandle

log = logging.getLogger(__name__)

MODES = ("auto", "off", "require")
REOPEN_SECONDS = 30.0
# The pairs auto opens: NCCL only (see above). tests/integration/test_colocated_namespaces.py
# adds gloo, to run auto's own path on a CPU machine.
AUTO_BACKENDS = ("nccl",)
# Receives waiting at once (each holds a thread while its bytes arrive).
RECEIVE_THREADS = 32
# Why an embedding left the co-located path (label values, all exported from the start at 0 so
# rates over them exist before the first fallback).
FALLBACK_REASONS = ("timeout", "peer_lost", "abandoned", "deadline", "closed")


class ColocatedMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.fallbacks = Counter(
            "encdis_coordinator_colocated_fallbacks_total",
            "Embeddings whose co-located transfer failed and went again over gRPC or to another encoder, "
            "by reason (timeout, peer_lost, abandoned, deadline, closed)", ["reason"], registry=registry)
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)
        self.embeddings = Counter("encdis_coordinator_colocated_embeddings_total",
                                  "Embeddings received over a co-located group", registry=registry)
        self.receiving = Gauge("encdis_coordinator_colocated_receiving",
                               "Co-located receives in progress", registry=registry)
        self.pairs = Gauge("encdis_coordinator_colocated_pairs", "Open co-located pairs", registry=registry)


class ColocatedTransport:
    """The pairs of one coordinator, by encoder address."""

    def __init__(self, mode: str, timeout: float, registry: CollectorRegistry, *,
                 reopen_seconds: float = REOPEN_SECONDS, boot_id: str | None = None,
                 net_namespace: str | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"colocated mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.timeout = timeout
        self.reopen_seconds = reopen_seconds
        self.auto_backends = AUTO_BACKENDS  # read at construction: a test may widen it
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        self.net_namespace = read_net_namespace() if net_namespace is None else net_namespace
        self.metrics = ColocatedMetrics(registry)
        self._threads = ThreadPoolExecutor(RECEIVE_THREADS, thread_name_prefix="encdis-colocated")
        self.receive_buffers: Allocate | None = None  # where embeddings land in host memory (None: the heap)
        self._links: dict[str, ColocatedLink] = {}
        self._handles: dict[str, EncoderHandle] = {}
        self._retry_at: dict[str, float] = {}
        self._opening: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()

    # -- policy ------------------------------------------------------------------

    def backend_for(self, desc: EncoderDescription) -> str:
        return "nccl" if desc.device.startswith("cuda") and torch.cuda.is_available() else "gloo"

    def why_not(self, desc: EncoderDescription) -> str | None:
        """Why this encoder gets no pair under the mode, or None."""
        if self.mode == "off":
            return "--colocated off"
        apart = why_not_one_loopback(self.boot_id, self.net_namespace, desc.boot_id, desc.net_namespace)
        if apart is not None:
            return f"it ({desc.hostname or 'unknown'}) is {apart}"
        if self.mode == "auto" and self.backend_for(desc) not in self.auto_backends:
            return "a gloo pair on CPU is no faster than gRPC (auto uses NCCL pairs only)"
        return None

    async def on_described(self, h: EncoderHandle, desc: EncoderDescription) -> str | None:
        """The health watch's hook after each Describe: (re)open the pair; a refusal reason
        (require only) or None. Never raises: the watch must go on."""
        self.forget(h.address)
        self._handles[h.address] = h
        why = self.why_not(desc)
        if why is not None:
            return f"--colocated require: {why}" if self.mode == "require" else None
        if self.mode == "auto":
            # gRPC serves it meanwhile; receiver() hands calls the pair once it is open.
            self._start_opening(h, desc)
            return None
        try:
            await self._open(h, desc)
        except Exception as e:  # noqa: BLE001 - any failure means gRPC, or a refusal under require
            self._retry_at[h.address] = time.monotonic() + self.reopen_seconds
            if self.mode == "require":
                return f"--colocated require: the co-located rendezvous failed: {e}"
            log.info("encoder %s: no co-located pair (%s); gRPC carries its embeddings", h.address, e)
        return None

    def receiver(self, h: EncoderHandle) -> CallReceiver | None:
        """What an Encode call to `h` receives co-located bytes with; None: gRPC only."""
        link = self._links.get(h.address)
        if link is not None and not link.broken:
            return link.call_receiver()
        retry_at = self._retry_at.get(h.address)
        if (retry_at is not None and time.monotonic() >= retry_at and h.address not in self._opening
                and h.description is not None and self.why_not(h.description) is None):
            self._retry_at.pop(h.address, None)
            self._start_opening(h, h.description)
        return None

    def opening(self, address: str) -> bool:
        """A rendezvous with `address` is under way in the background."""
        return address in self._opening

    def receiving(self, address: str) -> int:
        """Co-located receives waiting on `address`'s pair now (0 without one)."""
        link = self._links.get(address)
        return link.receiving if link is not None else 0

    # -- pairs -------------------------------------------------------------------

    async def _open(self, h: EncoderHandle, desc: EncoderDescription) -> None:
        link = await open_link(h.address, h.channel, backend=self.backend_for(desc), boot_id=self.boot_id,
                               net_namespace=self.net_namespace, timeout=self.timeout, threads=self._threads,
                               on_failure=self._failed, allocate=self.receive_buffers,
                               on_receiving=self.metrics.receiving.inc, on_received=self.metrics.embeddings.inc)
        if self._handles.get(h.address) is not h:  # left the pool meanwhile
            link.close()
            return
        self._links[h.address] = link
        self.metrics.pairs.set(len(self._links))
        log.info("encoder %s: co-located pair open (%s, session %s)", h.address, link.group.backend,
                 link.session_id)

    def _start_opening(self, h: EncoderHandle, desc: EncoderDescription) -> None:
        task = asyncio.ensure_future(self._open_in_background(h, desc))
        self._opening[h.address] = task

        def done(t: asyncio.Task, address: str = h.address) -> None:
            if self._opening.get(address) is t:
                del self._opening[address]

        task.add_done_callback(done)

    async def _open_in_background(self, h: EncoderHandle, desc: EncoderDescription) -> None:
        try:
            await self._open(h, desc)
        except Exception as e:  # noqa: BLE001 - stays on gRPC; tried again later
            self._retry_at[h.address] = time.monotonic() + self.reopen_seconds
            log.info("encoder %s: no co-located pair (%s); gRPC carries its embeddings, retry in %.0fs",
                     h.address, e, self.reopen_seconds)

    def _failed(self, link: ColocatedLink, reason: str, detail: str) -> None:
        self.metrics.fallbacks.labels(reason).inc()
        if not detail or self._links.get(link.address) is not link:
            return
        del self._links[link.address]
        self.metrics.pairs.set(len(self._links))
        self._retry_at[link.address] = time.monotonic() + self.reopen_seconds
        h = self._handles.get(link.address)
        if h is not None:
            self._spawn(close_remote(h.channel, link.session_id))

    def forget(self, address: str) -> None:
        """Close `address`'s pair (it left the pool, or is being re-described)."""
        task = self._opening.pop(address, None)
        if task is not None:
            task.cancel()
        self._retry_at.pop(address, None)
        link = self._links.pop(address, None)
        h = self._handles.pop(address, None)
        if link is not None:
            link.close()
            self.metrics.pairs.set(len(self._links))
            if h is not None and not h.gone:
                self._spawn(close_remote(h.channel, link.session_id))

    async def close(self) -> None:
        for address in list(self._links) + list(self._opening):
            self.forget(address)
        for t in list(self._background):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._background, return_exceptions=True)
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
