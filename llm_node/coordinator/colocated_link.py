"""One co-located pair, the coordinator's side: open it, receive embeddings over it, close it.

`open_link` hosts the pair's rendezvous store on 127.0.0.1 (ephemeral port), starts building
its side of the 2-rank group in a thread and asks the encoder to join (OpenColocated); both
must succeed within the timeout. A link then serves any number of Encode calls: each call
gets a `CallReceiver` with its own block of tags (image i of the call: base + i), so
concurrent calls on one pair never match each other's bytes (gloo matches a receive to a
send by peer and tag; a tag is never reused while the pair lives).

A receive allocates its buffer only from a header the decoder has already checked (and whose
tag is the one the call assigned), posts the receive, and waits in a worker thread with a
timeout, never on the event loop. Any failure (timeout, peer gone, the call abandoning the
receive) closes the link: gloo itself closes a pair on a timeout, so nothing more can be
trusted to arrive on it. The caller then re-sends the image over gRPC or to another encoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from encdis.client.errors import DeadlineExceeded, Unavailable, WireError, from_rpc_error
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.client.wire import Allocate
from encdis.pair_group import RECEIVER_RANK, PairError, PairGroup, host_store

log = logging.getLogger(__name__)

_TAG_SPACE = 1 << 31  # gloo tags are 32-bit; stay clear of the sign bit


class ColocatedFailure(Unavailable):
    """A co-located transfer failed (timeout, peer gone): the pair is closed; re-send the image."""


class ColocatedLink:
    """An open pair with one encoder; `call_receiver` for each Encode call that uses it."""

    def __init__(self, address: str, session_id: str, store: object, group: PairGroup, *, timeout: float,
                 threads: ThreadPoolExecutor, on_failure: Callable[[ColocatedLink, str, str], None],
                 on_receiving: Callable[[int], None], on_received: Callable[[], None],
                 allocate: Allocate | None = None) -> None:
        self.address = address
        self.session_id = session_id
        self._store = store  # kept alive for the group's lifetime
        self.group = group
        self.timeout = timeout
        self._threads = threads
        self._on_failure = on_failure
        self._on_receiving = on_receiving
        self._on_received = on_received
        self.allocate = allocate  # where embeddings land in host memory (the node's shared region; None: the heap)
        self._next_tag = 0
        self.receiving = 0  # receives waiting on this pair now
        self.broken = False
        self.device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else None

    def call_receiver(self) -> CallReceiver:
        return CallReceiver(self)

    def take_tags(self, n: int) -> int:
        if self._next_tag + n >= _TAG_SPACE:
            self._next_tag = 0  # wrapped: the tags of 2**31 images ago are long done
        base, self._next_tag = self._next_tag, self._next_tag + n
        return base

    async def receive(self, header: encoder_pb2.EmbeddingHeader, tag: int, deadline: float | None) -> memoryview:
        if self.broken:
            self.fail("closed", "")
            raise ColocatedFailure(f"co-located pair with {self.address} is closed")
        timeout, by_caller = self.timeout, False
        if deadline is not None and deadline - time.monotonic() < timeout:
            timeout, by_caller = max(deadline - time.monotonic(), 1e-3), True
        # Sized from the checked header only. A host receive lands where the node wants it, allocated in
        # a receive thread (the node's shared region reserves its pages), not on the loop.
        loop = asyncio.get_running_loop()
        if self.allocate is not None and self.device is None:
            buf = torch.frombuffer(await loop.run_in_executor(self._threads, self.allocate, header.total_bytes),
                                   dtype=torch.uint8)
        else:  # uncommitted until the bytes land
            buf = torch.empty(header.total_bytes, dtype=torch.uint8, device=self.device)
        what = f"image {header.image_index} ({header.total_bytes} bytes, tag {tag})"
        self._on_receiving(1)
        self.receiving += 1
        try:
            work = self.group.post_recv(buf, tag)
            host = await loop.run_in_executor(self._threads, self._landed, work, buf, timeout, what)
        except PairError as e:
            reason = "timeout" if "imed out" in str(e) else "peer_lost"
            if by_caller and reason == "timeout":
                self.fail("deadline", f"{what}: the call's deadline passed")
                raise DeadlineExceeded(f"co-located receive of {what} ran into the call's deadline") from None
            self.fail(reason, f"{what}: {e}")
            raise ColocatedFailure(f"co-located receive of {what} from {self.address} failed: {e}") from None
        except asyncio.CancelledError:
            # The receive is still posted on the pair: nothing later on it can be trusted.
            self.fail("abandoned", f"{what}: the call stopped waiting")
            raise
        finally:
            self._on_receiving(-1)
            self.receiving -= 1
        self._on_received()
        return memoryview(host.numpy()).cast("B")

    def _landed(self, work, buf: torch.Tensor, timeout: float, what: str) -> torch.Tensor:
        """In a receive thread: wait for `work`, then `buf` in host memory. The device-to-host copy of
        an NCCL receive runs here too (into the node's buffer where it has one), never on the
        coordinator's loop, which streams other calls."""
        self.group.wait(work, timeout, what)
        if buf.device.type == "cpu":
            return buf
        if self.allocate is None:
            return buf.cpu()
        return torch.frombuffer(self.allocate(buf.numel()), dtype=torch.uint8).copy_(buf)

    def fail(self, reason: str, detail: str) -> None:
        """Close the pair (idempotent); the first failure is reported to the owner."""
        if self.broken:
            self._on_failure(self, reason, "")  # counted: another image fell back
            return
        self.broken = True
        log.warning("co-located pair with %s closed (%s): %s; images go over gRPC", self.address, reason, detail)
        self.group.close()
        self._on_failure(self, reason, detail)

    def close(self) -> None:
        if not self.broken:
            self.broken = True
            self.group.close()


class CallReceiver:
    """One Encode call's view of a link (client/colocated.py's ColocatedReceiver)."""

    def __init__(self, link: ColocatedLink) -> None:
        self.link = link
        self.session_id = link.session_id
        self._base: int | None = None

    def tag_base(self, num_images: int) -> int:
        self._base = self.link.take_tags(num_images)
        return self._base

    async def receive(self, header: encoder_pb2.EmbeddingHeader, deadline: float | None) -> memoryview:
        tag = (self._base or 0) + header.image_index
        if self._base is None or header.colocated_tag != tag:
            # The encoder named a tag this call did not give it: another call's bytes, or none.
            raise WireError(f"image {header.image_index}: co-located tag {header.colocated_tag}, "
                            f"the call assigned {tag}")
        return await self.link.receive(header, tag, deadline)


async def open_link(address: str, channel: grpc.aio.Channel, *, backend: str, boot_id: str, net_namespace: str,
                    timeout: float, threads: ThreadPoolExecutor, **callbacks: Callable) -> ColocatedLink:
    """Open a pair with the encoder behind `channel`: store, both group halves, the encoder's OpenColocated."""
    store = await asyncio.to_thread(host_store, timeout)
    session_id = uuid.uuid4().hex
    half = asyncio.ensure_future(asyncio.to_thread(PairGroup, store, session_id, RECEIVER_RANK, backend, timeout))
    req = encoder_pb2.OpenColocatedRequest(session_id=session_id, store_host="127.0.0.1", store_port=store.port,
                                           backend=backend, boot_id=boot_id, net_namespace=net_namespace,
                                           timeout_seconds=timeout)
    try:
        await encoder_pb2_grpc.EncoderServiceStub(channel).OpenColocated(req, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        # Our half waits for a peer that will not come: it fails at its timeout, in its thread.
        half.add_done_callback(_discard)
        raise from_rpc_error(e) from None
    except BaseException:
        half.add_done_callback(_discard)
        raise
    try:
        group = await half
    except (RuntimeError, ValueError) as e:
        raise Unavailable(f"co-located rendezvous with {address} failed: {e}") from None
    return ColocatedLink(address, session_id, store, group, timeout=timeout, threads=threads, **callbacks)


async def close_remote(channel: grpc.aio.Channel, session_id: str, timeout: float = 5.0) -> None:
    """Ask the encoder to drop the session (best effort: it also drops broken ones itself)."""
    with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
        await encoder_pb2_grpc.EncoderServiceStub(channel).CloseColocated(
            encoder_pb2.CloseColocatedRequest(session_id=session_id), timeout=timeout)


def _discard(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: the failed half of an abandoned rendezvous
