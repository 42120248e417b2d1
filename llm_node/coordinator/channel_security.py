"""How the coordinator's channels to encoders are secured: TLS, a client certificate, an API key.

An encoder's address is an IP: a static target, or one of the addresses a DNS target
resolved to. Its certificate names what operators call it, the DNS target (a Kubernetes
headless Service: `encdis-encoder.encdis.svc.cluster.local`), so a channel to an address
found through a name verifies the certificate against that name
(`grpc.ssl_target_name_override`, also sent as SNI); an address given as an IP is
verified against the IP itself. The files are read once, when the node starts: a rotated
client certificate reaches the encoders after a restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, MutableMapping
from typing import Any

import grpc

from encdis.auth import take_secret
from encdis.client.channels import ChannelSecurity, open_aio_channel, read_api_key_file

from .discovery import is_ip_literal, split_host_port
from .settings import CoordinatorSettings

ENCODER_API_KEY_ENV = "ENCDIS_ENCODER_API_KEY"


def encoder_channel_security(settings: CoordinatorSettings,
                             environ: MutableMapping[str, str] | None = None) -> ChannelSecurity | None:
    """What the settings (--encoder-tls-*, --encoder-api-key-file) ask for; None: plaintext, no key.
    ENCDIS_ENCODER_API_KEY is taken out of `environ` (default os.environ) once read."""
    key_file = settings.encoder_api_key_file
    inline = take_secret(ENCODER_API_KEY_ENV, environ)
    if key_file is not None and inline is not None:
        raise ValueError(f"set --encoder-api-key-file or {ENCODER_API_KEY_ENV}, not both")
    api_key = read_api_key_file(key_file) if key_file is not None else (inline.strip() if inline else None)
    ca = settings.encoder_tls_ca
    if ca is None and api_key is None:
        return None
    return ChannelSecurity.from_files(ca=ca, cert=settings.encoder_tls_cert, key=settings.encoder_tls_key,
                                      api_key=api_key)


def verification_name(names: Iterable[str]) -> str | None:
    """The host name to verify an encoder's certificate against: the first DNS target (sorted)
    listing it; None when it was given by IP (verified against that IP)."""
    hosts = []
    for target in names:
        try:
            host, _port = split_host_port(target)
        except ValueError:
            continue
        if not is_ip_literal(host):
            hosts.append(host)
    return min(hosts) if hosts else None


def open_encoder_channel(address: str, names: Iterable[str], options: list[tuple[str, Any]],
                         security: ChannelSecurity | None) -> grpc.aio.Channel:
    """The channel to the encoder at `address`, known by `names` (its targets)."""
    if security is not None and security.tls:
        security = dataclasses.replace(security, server_name=verification_name(names))
    return open_aio_channel(address, options, security)
