"""TLS on the nodes' listeners: certificate files given by flags, re-read when they change.

- ServerTLS: a listener's --tls-cert / --tls-key / --tls-client-ca files (a client CA makes
  client certificates required: mTLS). `check_flags` is the settings' validation.
- CertificateFiles: the files as last loaded; `reload_if_changed()` re-reads them when
  their stat (mtime, size, inode: a Kubernetes Secret update swaps a symlink) changes,
  and checks that the key matches the certificate first, so a half-written rotation
  never replaces a working pair (the old one stays until the files are whole again).
- gRPC: `add_port` binds a plaintext or TLS port; TLS uses grpc's dynamic credentials,
  whose fetcher runs before every new connection's handshake: new connections get the
  new certificate, established ones keep theirs.
- HTTP (uvicorn): `uvicorn_options` gives uvicorn.Config its ssl_* settings and a context
  factory whose SNI callback (it runs on every ClientHello, SNI sent or not) swaps in a
  context rebuilt from the files when they changed: the same rule as gRPC's.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerTLS:
    """The certificate files of one listener; `client_ca` set: clients must present a certificate it signed."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    @classmethod
    def from_flags(cls, cert: Path | None, key: Path | None, client_ca: Path | None) -> ServerTLS | None:
        """None when no certificate is given (a plaintext listener); ValueError naming a file that
        cannot be read or a key that is not the certificate's."""
        check_flags(cert, key, client_ca)
        if cert is None or key is None:
            return None
        tls = cls(Path(cert), Path(key), Path(client_ca) if client_ca is not None else None)
        CertificateFiles(tls)  # reads and checks them now, before the node loads anything
        return tls


def check_flags(cert: Path | None, key: Path | None, client_ca: Path | None, prefix: str = "--tls") -> None:
    """ValueError for an incomplete combination of a listener's TLS flags."""
    if (cert is None) != (key is None):
        raise ValueError(f"{prefix}-cert and {prefix}-key go together (got only {prefix}-{'cert' if cert else 'key'})")
    if client_ca is not None and cert is None:
        raise ValueError(f"{prefix}-client-ca needs {prefix}-cert and {prefix}-key (client certificates need TLS)")


@dataclass(frozen=True)
class CertificateMaterial:
    cert: bytes
    key: bytes
    client_ca: bytes | None


def _stamp(paths: list[Path]) -> tuple | None:
    try:
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in (os.stat(p) for p in paths))
    except OSError:
        return None


class CertificateFiles:
    """A listener's certificate files as last loaded; reloaded when they change."""

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._paths = [p for p in (tls.cert, tls.key, tls.client_ca) if p is not None]
        self._stamp = _stamp(self._paths)
        self.material = self._load()  # at startup a bad file is an error naming it

    def _load(self) -> CertificateMaterial:
        t = self.tls
        data = {}
        for name, path in (("--tls-cert", t.cert), ("--tls-key", t.key), ("--tls-client-ca", t.client_ca)):
            if path is None:
                continue
            try:
                data[name] = path.read_bytes()
            except OSError as e:
                raise ValueError(f"{name} {path}: {e.strerror or e}") from None
        # Parsed as OpenSSL will; a key that is not the certificate's is refused here.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(t.cert, t.key)
        except ssl.SSLError as e:
            raise ValueError(f"--tls-cert {t.cert} / --tls-key {t.key}: {e.reason or e}") from None
        if t.client_ca is not None:
            try:
                ctx.load_verify_locations(t.client_ca)
            except ssl.SSLError as e:
                raise ValueError(f"--tls-client-ca {t.client_ca}: {e.reason or e}") from None
        if [p.read_bytes() for p in (t.cert, t.key)] != [data["--tls-cert"], data["--tls-key"]]:
            raise ValueError("the certificate files changed while being read")
        return CertificateMaterial(data["--tls-cert"], data["--tls-key"], data.get("--tls-client-ca"))

    def reload_if_changed(self) -> CertificateMaterial | None:
        """The new material if the files changed and load cleanly; None otherwise (keep the current)."""
        stamp = _stamp(self._paths)
        if stamp is None or stamp == self._stamp:
            return None
        try:
            material = self._load()
        except ValueError as e:
            # Mid-rotation (the certificate written, the key not yet) or broken: keep serving the
            # old pair; the next write changes the stamp again and is tried then.
            log.warning("TLS files changed but cannot be used yet, keeping the current ones: %s", e)
            self._stamp = stamp
            return None
        self._stamp = stamp
        self.material = material
        log.info("TLS certificate reloaded from %s", self.tls.cert)
        return material


def _grpc_config(m: CertificateMaterial) -> Any:
    return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.client_ca)


def grpc_server_credentials(tls: ServerTLS) -> grpc.ServerCredentials:
    """Credentials whose certificate follows the files (checked before each new connection)."""
    files = CertificateFiles(tls)

    def fetch() -> Any:
        try:
            m = files.reload_if_changed()
        except Exception:  # raising here would fail the handshake; keep the current certificate
            log.exception("checking the TLS files failed")
            return None
        return None if m is None else _grpc_config(m)

    return grpc.dynamic_ssl_server_credentials(_grpc_config(files.material), fetch,
                                               require_client_authentication=tls.client_ca is not None)


def add_port(server: grpc.aio.Server, address: str, tls: ServerTLS | None) -> int:
    """Bind `address` with TLS when `tls` is given, plaintext otherwise; the port (0: failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, grpc_server_credentials(tls))


def uvicorn_options(tls: ServerTLS) -> dict[str, Any]:
    """uvicorn.Config keyword arguments: the files, and a context that follows them."""
    files = CertificateFiles(tls)

    def factory(config: Any, default_factory: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        return reloading_context(default_factory, files)

    return {
        "ssl_certfile": str(tls.cert),
        "ssl_keyfile": str(tls.key),
        "ssl_ca_certs": str(tls.client_ca) if tls.client_ca is not None else None,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.client_ca is not None else ssl.CERT_NONE,
        "ssl_context_factory": factory,
    }


def reloading_context(build: Callable[[], ssl.SSLContext], files: CertificateFiles) -> ssl.SSLContext:
    """`build()`'s context, which hands each new handshake a context rebuilt by `build` once the files changed."""
    listening = build()
    current = [listening]

    def on_client_hello(sslobj: Any, server_name: str | None, ctx: ssl.SSLContext) -> None:
        try:
            if files.reload_if_changed() is not None:
                current[0] = build()
            if sslobj.context is not current[0]:
                sslobj.context = current[0]
        except Exception:  # an exception here would abort the handshake; serve the current certificate
            log.exception("reloading the TLS certificate failed")

    listening.sni_callback = on_client_hello
    return listening
