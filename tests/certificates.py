"""Test certificates, made at test time with `cryptography`: a CA and leaves it signs.

    pki = TestPKI(tmp_path)
    server = pki.issue("server", dns=["localhost"], ips=["127.0.0.1"])   # Leaf: .cert, .key paths
    wrong = pki.issue("wrong", dns=["wrong.example"])
    client = pki.issue("client", client=True)
    other = TestPKI(tmp_path / "other")                                  # a CA nobody trusts

Files are PEM under the given directory; `pki.ca` is the CA certificate's path. EC P-256
keys keep generation fast.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Leaf:
    cert: Path
    key: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key.read_bytes()

    def serial(self) -> int:
        return x509.load_pem_x509_certificate(self.cert_pem).serial_number


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class TestPKI:
    """A certificate authority writing its certificate and the leaves it issues to `directory`."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory: Path, name: str = "encdis test CA") -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca = self.dir / "ca.pem"
        self.ca.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    @property
    def ca_pem(self) -> bytes:
        return self.ca.read_bytes()

    def issue(self, name: str, *, dns: Sequence[str] = (), ips: Sequence[str] = (), client: bool = False,
              directory: Path | None = None) -> Leaf:
        """A leaf for these names (a server certificate, or a client one); written as NAME.pem / NAME-key.pem."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(self._cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                  else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        out = Path(directory) if directory is not None else self.dir
        out.mkdir(parents=True, exist_ok=True)
        leaf = Leaf(out / f"{name}.pem", out / f"{name}-key.pem")
        leaf.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        leaf.key.write_bytes(_key_pem(key))
        return leaf


def replace_files(src: Leaf, dst: Leaf) -> None:
    """Put `src`'s certificate and key at `dst`'s paths as a rotation does: atomic renames
    (new inodes), the key first so the pair is whole once the certificate lands."""
    for a, b in ((src.key, dst.key), (src.cert, dst.cert)):
        tmp = b.with_name(b.name + ".new")
        tmp.write_bytes(a.read_bytes())
        tmp.replace(b)


def served_certificate(host: str, port: int) -> x509.Certificate:
    """The certificate a TLS server on host:port presents to a new connection (unverified)."""
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection((host, port), timeout=10) as sock, ctx.wrap_socket(sock) as tls:
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der)
