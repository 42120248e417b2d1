"""One encoder as the pool holds it: address, channel, client, state and what it was given.

States: connecting (no health answer yet, or NOT_SERVING from a node not seen serving since
the connection was made: still loading), serving (the only routable state), draining
(health NOT_SERVING), unhealthy (unreachable, watch broken, or a call just failed),
refused (model mismatch), quarantined (it sent an embedding other than the one asked for),
slow (a call ran past the bound its predicted cost gives). The first five follow its
health watch; quarantined and slow are penalties (penalty.py) that hide the health view
until their back-off is over and the encoder has answered a fresh Describe.
"""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import Any

from encdis.client.channels import CHANNEL_OPTIONS, ChannelSecurity
from encdis.client.encoder_client import AsyncEncoderClient, EncoderDescription

from .channel_security import open_encoder_channel
from .load_reports import Lateness, ReportWatcher
from .penalty import FaultRecord, Penalty

# Reconnect quickly after an encoder restarts: gRPC's default backoff grows to 120 s.
# One channel (one HTTP/2 connection) per encoder carries all its Encode streams, with gRPC's
# default window options: in bench/data_plane/transport.py two or four connections, several streams per
# embedding, and window/read-size options moved nothing beyond the noise on loopback.
POOL_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def keepalive_options(time_seconds: float, timeout_seconds: float) -> list[tuple[str, int]]:
    """HTTP/2 keepalive: a connection whose peer stops answering pings (a hung or frozen
    process, a dead host behind a live route) is closed, failing its calls, instead of
    waiting for each call's deadline. The encoder's server must permit pings this often."""
    return [
        ("grpc.keepalive_time_ms", int(time_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_seconds * 1000)),
        # The transport times an unanswered ping out by this one (default 60 s), whatever
        # keepalive_timeout_ms says (measured with grpcio 1.85: a frozen peer went unnoticed).
        ("grpc.http2.ping_timeout_ms", int(timeout_seconds * 1000)),
        # The health watch is usually the only call and sends nothing for long stretches.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class EncoderState(str, Enum):
    CONNECTING = "connecting"
    SERVING = "serving"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"
    REFUSED = "refused"
    QUARANTINED = "quarantined"
    SLOW = "slow"


class EncoderHandle:
    """One encoder address: its connection, state, cost model and the work it holds."""

    def __init__(self, address: str, name: str, cost_model: Any,
                 channel_options: list[tuple[str, Any]] | None = None,
                 channel_security: ChannelSecurity | None = None) -> None:
        self.address = address
        self.names: set[str] = set(name.split(","))
        # What its health watch (and failed calls) say; `state` shows a penalty instead.
        self.health_state = EncoderState.CONNECTING
        self.health_reason = ""
        self.penalty: Penalty | None = None
        self.faults: dict[EncoderState, FaultRecord] = {}  # consecutive faults per penalty state
        self.busy_until = 0.0  # monotonic; it answered RESOURCE_EXHAUSTED: send it less until then
        self.description: EncoderDescription | None = None
        self.cost_model = cost_model
        options = POOL_CHANNEL_OPTIONS if channel_options is None else [*POOL_CHANNEL_OPTIONS, *channel_options]
        # TLS verified against the name it was found by, and the API key, when configured.
        self.channel = open_encoder_channel(address, self.names, options, channel_security)
        self.client = AsyncEncoderClient(address, channel=self.channel)
        # Its ORCA load reports (load_reports.py), when the coordinator reads them; and how late
        # its calls have recently finished past their prediction.
        self.reports: ReportWatcher | None = None
        self.lateness = Lateness()
        self.assigned_patches = 0
        self.assigned_images = 0
        self.active_calls = 0
        self.gone = False  # its DNS name no longer lists it; removed once idle
        # Its health is being (re)established: a request may wait a little for the outcome.
        self.settling = True
        # It said SERVING since the connection last broke: a later NOT_SERVING means draining,
        # while NOT_SERVING from a node not seen serving means it is (re)starting: loading.
        self.was_serving = False
        self.kick = asyncio.Event()  # set: restart the health watch now
        self.watch_task: asyncio.Task | None = None
        self.probe_task: asyncio.Task | None = None

    @property
    def state(self) -> EncoderState:
        return EncoderState(self.penalty.state) if self.penalty is not None else self.health_state

    @property
    def reason(self) -> str:
        return self.penalty.describe() if self.penalty is not None else self.health_reason

    @property
    def name(self) -> str:
        return ",".join(sorted(self.names))

    @property
    def routable(self) -> bool:
        return self.state is EncoderState.SERVING and not self.gone

    def __repr__(self) -> str:
        return f"<encoder {self.address} {self.state.value}{': ' + self.reason if self.reason else ''}>"
