"""The base of the SDK's clients: one channel to one node, its security, timeout and closing.

    class EncoderClient(SyncClient): ...        # blocking API (grpc.Channel)
    class AsyncEncoderClient(AsyncClient): ...  # asyncio API (grpc.aio.Channel)

A client is given a target and either a ready channel or the TLS / API key options to open
one (never both: the options would be silently unused); it closes the channel it holds, also
as a context manager. Subclasses make their stubs in `_bind`, called once the channel is open.
"""

from __future__ import annotations

from typing import TypeVar

import grpc

from encdis.client.channels import CHANNEL_OPTIONS, ChannelSecurity, open_aio_channel, open_channel

C = TypeVar("C", bound="_ClientBase")


class _ClientBase:
    def __init__(self, target: str, *, timeout: float | None, tls: bool, root_certificates: bytes | None,
                 certificate_chain: bytes | None, private_key: bytes | None, api_key: str | None,
                 server_name: str | None, channel_given: bool) -> None:
        self.target = target
        self.timeout = timeout
        self._security = ChannelSecurity(tls, root_certificates, certificate_chain, private_key, api_key, server_name)
        if channel_given and self._security != ChannelSecurity():
            raise ValueError("give either a channel or TLS / API key options, not both")

    def _bind(self) -> None:
        """Make the stubs on self._channel."""
        raise NotImplementedError


class SyncClient(_ClientBase):
    """A blocking client of one node."""

    def __init__(self, target: str, *, timeout: float | None = None, channel: grpc.Channel | None = None,
                 tls: bool = False, root_certificates: bytes | None = None,
                 certificate_chain: bytes | None = None, private_key: bytes | None = None,
                 api_key: str | None = None, server_name: str | None = None) -> None:
        super().__init__(target, timeout=timeout, tls=tls, root_certificates=root_certificates,
                         certificate_chain=certificate_chain, private_key=private_key, api_key=api_key,
                         server_name=server_name, channel_given=channel is not None)
        self._channel = channel or open_channel(target, CHANNEL_OPTIONS, self._security)
        self._bind()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """An asyncio client of one node."""

    def __init__(self, target: str, *, timeout: float | None = None, channel: grpc.aio.Channel | None = None,
                 tls: bool = False, root_certificates: bytes | None = None,
                 certificate_chain: bytes | None = None, private_key: bytes | None = None,
                 api_key: str | None = None, server_name: str | None = None) -> None:
        super().__init__(target, timeout=timeout, tls=tls, root_certificates=root_certificates,
                         certificate_chain=certificate_chain, private_key=private_key, api_key=api_key,
                         server_name=server_name, channel_given=channel is not None)
        self._channel = channel or open_aio_channel(target, CHANNEL_OPTIONS, self._security)
        self._bind()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self: C) -> C:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
