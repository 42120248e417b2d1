"""The base of the SDK's clients: one channel to one node, its security, timeout and closing.

    class EncoderClient(SyncClient): ...        # blocking API (grpc.Channel)
    class AsyncEncoderClient(AsyncClient): ...  # asyncio API (grpc.aio.Channel)

A client is given a target and either a ready channel or the TLS / API key options to open
one (never both: the options would be silently unused); it closes the channel it holds, also
as a context manager. Subclasses make their stubs in `_bind`, called once the channel is open.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from encdis.client.channels import CHANNEL_OPTIONS, ChannelSecurity, open_aio_channel, open_channel

C = TypeVar("C", bound="_ClientBase")


class _ClientBase:
    _open: Callable[..., Any]  # open_channel or open_aio_channel

    def __init__(self, target: str, *, timeout: float | None = None,
                 channel: grpc.Channel | grpc.aio.Channel | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, certificate_chain: bytes | None = None,
                 private_key: bytes | None = None, api_key: str | None = None,
                 server_name: str | None = None) -> None:
        self.target = target
        self.timeout = timeout
        security = ChannelSecurity(tls, root_certificates, certificate_chain, private_key, api_key, server_name)
        if channel is not None and security != ChannelSecurity():
            raise ValueError("give either a channel or TLS / API key options, not both")
        self._channel = channel or type(self)._open(target, CHANNEL_OPTIONS, security)
        self._bind()

    def _bind(self) -> None:
        """Make the stubs on self._channel."""
        raise NotImplementedError


class SyncClient(_ClientBase):
    """A blocking client of one node (give it a grpc.Channel, or options to open one)."""

    _open = staticmethod(open_channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """An asyncio client of one node (give it a grpc.aio.Channel, or options to open one)."""

    _open = staticmethod(open_aio_channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self: C) -> C:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
