"""Pairwise torch.distributed groups: the byte pipe of the co-located transport, both sides.

Co-located means one loopback: the same boot id (one host) and the same network namespace
(`read_net_namespace`). Two Kubernetes pods on one node share the boot id but each has its own
loopback, so a store on 127.0.0.1 in one is not there for the other; both sides check both.

One group per (LLM node, encoder) pair, two ranks: the encoder (SENDER_RANK) sends each
embedding's bytes, the LLM node's coordinator (RECEIVER_RANK) receives them. The coordinator
hosts a TCPStore on loopback for the rendezvous (`host_store`); the encoder joins it
(`join_store`). Groups are built from their class (ProcessGroupGloo / ProcessGroupNCCL)
rather than init_process_group, so one process holds any number of them. Only raw bytes
move (a uint8 view of the tensor): nothing is pickled, and the receiver's buffer is
allocated from a header it has already checked.

Gloo on CPU, NCCL when both sides hold CUDA tensors: the calls are the same. Every wait has a
timeout. Gloo closes the pair on a timeout ("Application timeout caused pair closure"), so
a group whose transfer failed is unusable and its owner closes it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

SENDER_RANK = 0  # the encoder
RECEIVER_RANK = 1  # the LLM node
BACKENDS = ("gloo", "nccl")
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
NET_NAMESPACE_PATH = "/proc/self/ns/net"


class PairError(RuntimeError):
    """A transfer on a pair failed (timeout, peer gone, closed): the pair is unusable."""


def read_boot_id() -> str:
    """This host's boot id ("" when unknown): equal ids on two processes mean one host."""
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""


def read_net_namespace() -> str:
    """This process's network namespace ("net:[4026531840]"; "" when unknown). Namespace ids
    are unique while the host runs: equal boot ids and equal namespaces mean one loopback."""
    try:
        return os.readlink(NET_NAMESPACE_PATH)
    except OSError:
        return ""


def why_not_one_loopback(own_boot_id: str, own_net_namespace: str, peer_boot_id: str,
                         peer_net_namespace: str) -> str | None:
    """Why a peer that reports these ids cannot share this process's loopback, or None if it can.
    Anything unknown counts as different: a pair attempted across loopbacks only times out."""
    if not own_boot_id:
        return "this host's boot id is unknown"
    if peer_boot_id != own_boot_id:
        return "on another host (boot id differs)"
    if not own_net_namespace:
        return "this process's network namespace is unknown"
    if peer_net_namespace != own_net_namespace:
        return (f"on this host but in another network namespace ({peer_net_namespace or 'unknown'}, "
                f"here {own_net_namespace}): another pod, whose loopback is not this one")
    return None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(float(seconds), 1e-3))


def host_store(timeout: float) -> dist.TCPStore:
    """A rendezvous store on 127.0.0.1 at an ephemeral port (`.port`), for one pair."""
    return dist.TCPStore("127.0.0.1", 0, 2, True, timeout=_timedelta(timeout), wait_for_workers=False)


def join_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A client of the pair's store; only loopback stores are joined (the peer is on this host)."""
    if not is_loopback(host):
        raise ValueError(f"co-located store {host!r} is not a loopback address")
    return dist.TCPStore(host.strip("[]"), int(port), 2, False, timeout=_timedelta(timeout))


class PairGroup:
    """A 2-rank process group over one pair's store; blocking calls (run them in threads)."""

    def __init__(self, store: dist.Store, session_id: str, rank: int, backend: str, timeout: float) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.rank = rank
        self.timeout = timeout
        self._lock = threading.Lock()
        self._closed = False
        prefixed = dist.PrefixStore(f"encdis/{session_id}", store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _timedelta(timeout)
            # Loopback only: the peer is on this host, and no other interface is exposed.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self._pg = dist.ProcessGroupGloo(prefixed, rank, 2, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _timedelta(timeout)
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        self.peer = RECEIVER_RANK if rank == SENDER_RANK else SENDER_RANK

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, data: torch.Tensor, tag: int, timeout: float) -> None:
        """Send `data`'s bytes to the peer with `tag`; returns once the peer has them (gloo
        waits for the peer's matching receive), raises PairError past `timeout`."""
        flat = data.contiguous().reshape(-1).view(torch.uint8)
        self._wait(lambda: self._pg.send([flat], self.peer, int(tag)), timeout, f"send tag {tag}")

    def post_recv(self, buf: torch.Tensor, tag: int) -> dist.Work:
        """Post the receive of `buf.numel()` bytes with `tag` (does not block)."""
        if self._closed:
            raise PairError("the co-located pair is closed")
        try:
            return self._pg.recv([buf], self.peer, int(tag))
        except RuntimeError as e:
            raise PairError(f"posting recv tag {tag}: {e}") from e

    def wait(self, work: dist.Work, timeout: float, what: str) -> None:
        """Block until `work` is done; PairError past `timeout` or if the peer went away."""
        self._wait(lambda: work, timeout, what)

    def _wait(self, start, timeout: float, what: str) -> None:
        if self._closed:
            raise PairError(f"{what}: the co-located pair is closed")
        try:
            work = start()
            if self.backend == "nccl":
                self._wait_nccl(work, timeout, what)
            else:
                work.wait(_timedelta(timeout))
        except RuntimeError as e:
            raise PairError(f"{what}: {e}") from e

    def _wait_nccl(self, work: dist.Work, timeout: float, what: str) -> None:
        """NCCL work completes on the GPU: poll its event against the deadline, abort the
        communicator past it (an NCCL op never returns on its own if the peer is gone)."""
        deadline = time.monotonic() + timeout
        while not work.is_completed():
            if time.monotonic() > deadline:
                self._pg.abort()
                raise PairError(f"{what}: Timed out after {timeout:.3g}s")
            time.sleep(0.0005)
        work.wait()  # orders the current stream after the transfer; raises a failed op's error

    def close(self) -> None:
        """Tear the group down; transfers still waiting on it fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._pg.shutdown()
        except RuntimeError:
            pass  # already broken: nothing left to release
