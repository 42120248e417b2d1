"""One encoder as the pool holds it: address, channel, client, state and what it was given.

States: connecting (no health answer yet, or NOT_SERVING from a node not seen serving since
the connection was made: still loading), serving (the only routable state), draining
(health NOT_SERVING), unhealthy (unreachable, watch broken, or a call just failed),
refused (model mismatch).
"""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import Any

import grpc

from encdis.client.encoder_client import CHANNEL_OPTIONS, AsyncEncoderClient, EncoderDescription

# Reconnect quickly after an encoder restarts: gRPC's default backoff grows to 120 s.
POOL_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class EncoderState(str, Enum):
    CONNECTING = "connecting"
    SERVING = "serving"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"
    REFUSED = "refused"


class EncoderHandle:
    """One encoder address: its connection, state, cost model and the work it holds."""

    def __init__(self, address: str, name: str, cost_model: Any) -> None:
        self.address = address
        self.names: set[str] = set(name.split(","))
        self.state = EncoderState.CONNECTING
        self.reason = ""
        self.description: EncoderDescription | None = None
        self.cost_model = cost_model
        self.channel = grpc.aio.insecure_channel(address, options=POOL_CHANNEL_OPTIONS)
        self.client = AsyncEncoderClient(address, channel=self.channel)
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

    @property
    def name(self) -> str:
        return ",".join(sorted(self.names))

    @property
    def routable(self) -> bool:
        return self.state is EncoderState.SERVING and not self.gone

    def __repr__(self) -> str:
        return f"<encoder {self.address} {self.state.value}{': ' + self.reason if self.reason else ''}>"
