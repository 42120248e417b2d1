"""Client channels to encdis nodes: plaintext or TLS (with a client certificate for mTLS), and an API key.

    security = ChannelSecurity.from_files(ca="ca.pem", api_key_file="key.txt")
    channel = open_channel("llm.example:50050", CHANNEL_OPTIONS, security)

ChannelSecurity says how a channel authenticates: `tls` with `root_certificates` (None:
the system's roots), optionally `certificate_chain` + `private_key` (the client's own
certificate, for servers that require one), `server_name` (verify the server's certificate
against this name instead of the target's host: an address found through a DNS name), and
`api_key`, sent as `authorization: Bearer KEY` on every call. The key goes through a client
interceptor rather than call credentials, because gRPC sends call credentials only over
TLS, and nodes behind a mesh that terminates TLS still check keys. Depends on grpcio only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case
# Every SDK client's channel: requests carry encoded images (up to 256 MiB); replies are at most
# one embedding chunk (4 MiB by default), with room for a larger chunk setting.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


@dataclass(frozen=True)
class ChannelSecurity:
    """TLS material and API key of a client channel; the default is plaintext without a key."""

    tls: bool = False
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = dataclasses.field(default=None, repr=False)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs both certificate_chain and private_key")
        if self.api_key is not None:
            check_api_key(self.api_key)
        if self.root_certificates is not None or self.certificate_chain is not None:
            object.__setattr__(self, "tls", True)  # certificates only make sense over TLS

    @classmethod
    def from_files(cls, *, ca: str | os.PathLike | None = None, cert: str | os.PathLike | None = None,
                   key: str | os.PathLike | None = None, api_key_file: str | os.PathLike | None = None,
                   api_key: str | None = None, tls: bool = False,
                   server_name: str | None = None) -> ChannelSecurity:
        """Read PEM files and a key file (its first non-empty line); TLS when `ca` or `cert` is given."""
        if api_key_file is not None and api_key is not None:
            raise ValueError("give an API key or an API key file, not both")
        return cls(
            tls=tls,
            root_certificates=_read(ca),
            certificate_chain=_read(cert),
            private_key=_read(key),
            api_key=read_api_key_file(api_key_file) if api_key_file is not None else api_key,
            server_name=server_name,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """The TLS credentials, or None for a plaintext channel."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.tls and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


def check_api_key(key: str) -> None:
    """ValueError unless `key` can travel in an HTTP/2 header (printable ASCII, no spaces)."""
    if not key:
        raise ValueError("the API key is empty")
    if not all(33 <= ord(c) < 127 for c in key):
        raise ValueError("the API key must be printable ASCII without spaces")


def read_api_key_file(path: str | os.PathLike) -> str:
    """The first non-empty line of `path` (surrounding whitespace dropped); ValueError naming the file."""
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read API key file {os.fspath(path)}: {e}") from None
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key = line.strip()
            check_api_key(key)
            return key
    raise ValueError(f"API key file {os.fspath(path)} holds no key")


def _read(path: str | os.PathLike | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {os.fspath(path)}: {e}") from None


def open_channel(target: str, options: Sequence[tuple[str, Any]],
                 security: ChannelSecurity | None = None) -> grpc.Channel:
    """A blocking-API channel to `target`, secured as `security` says (None: plaintext)."""
    security = security or ChannelSecurity()
    opts = [*options, *security.channel_options()]
    creds = security.channel_credentials()
    channel = grpc.secure_channel(target, creds, options=opts) if creds else grpc.insecure_channel(target, options=opts)
    if security.api_key is None:
        return channel
    return grpc.intercept_channel(channel, _BearerKey(security.api_key))


def open_aio_channel(target: str, options: Sequence[tuple[str, Any]],
                     security: ChannelSecurity | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `target`, secured as `security` says (None: plaintext)."""
    security = security or ChannelSecurity()
    opts = [*options, *security.channel_options()]
    creds = security.channel_credentials()
    interceptors = _aio_bearer_key(security.api_key) if security.api_key is not None else None
    if creds is not None:
        return grpc.aio.secure_channel(target, creds, options=opts, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)


def _with_key(details: Any, value: str, aio: bool = False) -> Any:
    """`details` with this key as its only authorization entry (grpc.aio wants a Metadata object)."""
    pairs = [(k, v) for k, v in (details.metadata or ()) if k != AUTHORIZATION]
    pairs.append((AUTHORIZATION, value))
    return details._replace(metadata=grpc.aio.Metadata(*pairs) if aio else pairs)


class _CallDetails(grpc.ClientCallDetails):
    """grpc.ClientCallDetails is abstract in the blocking API; this one is a plain record."""

    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression

    def _replace(self, metadata: Any) -> _CallDetails:
        return _CallDetails(self.method, self.timeout, metadata, self.credentials, self.wait_for_ready,
                            self.compression)


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call of a blocking-API channel."""

    def __init__(self, key: str) -> None:
        self._value = f"Bearer {key}"

    def _details(self, d: Any) -> _CallDetails:
        plain = _CallDetails(d.method, d.timeout, d.metadata, d.credentials, getattr(d, "wait_for_ready", None),
                             getattr(d, "compression", None))
        return _with_key(plain, self._value)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def _aio_bearer_key(key: str) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call kind: grpc.aio files each interceptor under its first kind only."""
    value = f"Bearer {key}"

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, client_call_details, request):
            return await continuation(_with_key(client_call_details, value, aio=True), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, client_call_details, request):
            return await continuation(_with_key(client_call_details, value, aio=True), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
            return await continuation(_with_key(client_call_details, value, aio=True), request_iterator)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
            return await continuation(_with_key(client_call_details, value, aio=True), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]
