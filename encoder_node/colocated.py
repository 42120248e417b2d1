"""The encoder node's side of the co-located transport: sessions and the per-image send.

An LLM node on the same host opens a session (OpenColocated): this node checks that the
caller shares this node's loopback (its boot id and network namespace) and that the store is on loopback, then joins the
pair's 2-rank group as the sender (encdis.pair_group). An Encode call naming the session
gets, per image, its header over gRPC marked `colocated` with the tag the call assigned,
and then the bytes over the group; the call's other images follow the same way. A call
naming a session this node does not hold (it restarted, or evicted it) is answered over
gRPC: the caller accepts either.

A failed send (the receiver timed out or went away) leaves the pair unusable: the session
is closed and the call fails with UNAVAILABLE, so the caller re-sends the images still
missing (over gRPC: it closes its side too). Sends run in worker threads, never on the
event loop, and are bounded by the session's timeout.

Test fault hook: ENCDIS_TEST_FAULT_COLOCATED_STALL_SECONDS (set only by tests in a node's
environment) makes each co-located image wait that long between its header and its bytes,
so a test can time out the receiver or kill this node mid-transfer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from encdis.client.errors import FailedPrecondition, InvalidArgument, Unavailable
from encdis.client.pb import encoder_pb2
from encdis.client.wire import AcceptedBacklog, BatchInfo, set_accepted_backlog
from encdis.pair_group import (
    BACKENDS,
    SENDER_RANK,
    PairError,
    PairGroup,
    is_loopback,
    join_store,
    read_boot_id,
    read_net_namespace,
    why_not_one_loopback,
)

log = logging.getLogger(__name__)

TEST_FAULT_STALL_ENV = "ENCDIS_TEST_FAULT_COLOCATED_STALL_SECONDS"
# Each session holds a group (sockets, a thread); LLM nodes on one host are few.
MAX_SESSIONS = 16
MAX_TIMEOUT_SECONDS = 600.0
_SESSION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass
class Session:
    session_id: str
    group: PairGroup
    device: torch.device
    timeout: float


def colocated_header(index: int, grid_thw: tuple[int, int, int], digest: str, embedding: torch.Tensor,
                     datatype: str, tag: int, *, batch: BatchInfo | None, queue_seconds: float,
                     preprocess_seconds: float = 0.0, accepted_backlog: AcceptedBacklog | None = None) -> bytes:
    """One image's header, serialised, saying its bytes follow on the group with `tag`."""
    rows, hidden = int(embedding.shape[0]), int(embedding.shape[1])
    header = encoder_pb2.EmbeddingHeader(
        image_index=index, grid_thw=list(grid_thw), num_tokens=rows, hidden_size=hidden, datatype=datatype,
        digest=digest, total_bytes=embedding.numel() * embedding.element_size(), num_chunks=0,
        queue_seconds=queue_seconds, preprocess_seconds=preprocess_seconds, colocated=True, colocated_tag=tag,
    )
    if batch is not None:
        header.batch.seconds = batch.seconds
        header.batch.image_patches.extend(batch.image_patches)
    set_accepted_backlog(header, accepted_backlog)
    return encoder_pb2.EncodeResponse(header=header).SerializeToString()


class ColocatedSessions:
    """The co-located sessions this node holds, by id; the oldest is dropped beyond MAX_SESSIONS."""

    def __init__(self, tower_device: torch.device | str = "cpu", max_sessions: int = MAX_SESSIONS) -> None:
        self.tower_device = torch.device(tower_device)
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._stall = float(os.environ.get(TEST_FAULT_STALL_ENV, "0") or 0)

    def __len__(self) -> int:
        return len(self._sessions)

    async def open(self, request: encoder_pb2.OpenColocatedRequest) -> encoder_pb2.OpenColocatedResponse:
        """Join the caller's pair group (blocking rendezvous in a thread); refuse a caller not on this host."""
        sid, backend = request.session_id, request.backend
        if not _SESSION_ID.match(sid):
            raise InvalidArgument("session_id must be 1-128 characters of [A-Za-z0-9_.-]")
        if backend not in BACKENDS:
            raise InvalidArgument(f"backend must be one of {BACKENDS}, got {backend!r}")
        why = why_not_one_loopback(read_boot_id(), read_net_namespace(), request.boot_id, request.net_namespace)
        if why is not None:
            raise FailedPrecondition(f"not co-located: the caller is {why}")
        if not is_loopback(request.store_host):
            raise InvalidArgument(f"store_host {request.store_host!r} is not a loopback address")
        if not 0 < request.timeout_seconds <= MAX_TIMEOUT_SECONDS:
            raise InvalidArgument(f"timeout_seconds must be in (0, {MAX_TIMEOUT_SECONDS}]")
        device = self.tower_device if backend == "nccl" else torch.device("cpu")
        if backend == "nccl" and device.type != "cuda":
            raise FailedPrecondition(f"nccl needs a CUDA tower; this node's is on {self.tower_device}")
        timeout = float(request.timeout_seconds)
        self.close(sid)  # a re-open replaces the old pair

        def build() -> PairGroup:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            store = join_store(request.store_host, request.store_port, timeout)
            return PairGroup(store, sid, SENDER_RANK, backend, timeout)

        try:
            group = await asyncio.to_thread(build)
        except (RuntimeError, ValueError, OSError) as e:
            raise Unavailable(f"co-located rendezvous failed: {e}") from None
        self._sessions[sid] = Session(sid, group, device, timeout)
        while len(self._sessions) > self.max_sessions:
            _, old = self._sessions.popitem(last=False)
            old.group.close()
        log.info("co-located session %s open (%s)", sid, backend)
        return encoder_pb2.OpenColocatedResponse(device=str(device))

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id) if session_id else None

    def close(self, session_id: str) -> None:
        s = self._sessions.pop(session_id, None)
        if s is not None:
            s.group.close()

    def close_all(self) -> None:
        for sid in list(self._sessions):
            self.close(sid)

    async def frames(self, session: Session, index: int, grid_thw: tuple[int, int, int], digest: str,
                     embedding: torch.Tensor, datatype: str, tag: int, *, batch: BatchInfo | None,
                     queue_seconds: float, preprocess_seconds: float = 0.0,
                     accepted_backlog: AcceptedBacklog | None = None) -> AsyncIterator[bytes]:
        """The image's header (to yield on the stream), then its bytes sent over the group."""
        yield colocated_header(index, grid_thw, digest, embedding, datatype, tag, batch=batch,
                               queue_seconds=queue_seconds, preprocess_seconds=preprocess_seconds,
                               accepted_backlog=accepted_backlog)
        try:
            if self._stall:
                await asyncio.sleep(self._stall)
            data = embedding.to(session.device) if embedding.device != session.device else embedding
            # The receiver posts its receive once it has checked the header: the send waits for it.
            await asyncio.to_thread(session.group.send, data, tag, session.timeout)
        except PairError as e:
            self.close(session.session_id)
            raise Unavailable(f"co-located transfer of image {index} failed: {e}") from None
        except asyncio.CancelledError:
            # The caller hung up mid-transfer: it drops its side, so this pair is done too.
            self.close(session.session_id)
            raise
