"""The coordinator dials a TLS + mTLS + API-key encoder node, verifying it by the name it was found by.

One real encoder node (subprocess) serves with a certificate naming only the DNS name
`encoders.encdis.test` (no IP), requires client certificates from the test CA and an API
key. The test's DNS server (tests/dns_server.py) resolves that name to 127.0.0.1, as a
Kubernetes headless Service resolves to pod IPs. An in-process coordinator (no vLLM) with
the right CA, client certificate and key reaches it through the name; every missing or
wrong part leaves the encoder out of rotation with the reason, and a request fails with
UNAVAILABLE naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
from PIL import Image

from encdis.client.channels import ChannelSecurity
from encdis.client.errors import Unavailable
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.coordinator.coordinator import Coordinator
from encdis.llm_node.coordinator.settings import CoordinatorSettings
from tests.certificates import Leaf, TestPKI
from tests.dns_server import LoopbackDNS

NAME = "encoders.encdis.test"
KEY = "encoder-side-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def client_cert(pki: TestPKI) -> Leaf:
    return pki.issue("llm-node", client=True)


@pytest.fixture(scope="module")
def dns() -> Iterator[LoopbackDNS]:
    server = LoopbackDNS()
    server.set_addresses(NAME, ["127.0.0.1"])
    yield server
    server.close()


@pytest.fixture(scope="module")
def secured_encoder(tiny_ckpt, pki: TestPKI, tmp_path_factory) -> Iterator[NodeProcess]:
    work = tmp_path_factory.mktemp("encoder")
    leaf = pki.issue("encoder", dns=[NAME], directory=work)
    key_file = work / "api-keys"
    key_file.write_text(KEY + "\n")
    node = start_node(["encoder", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key), "--tls-client-ca", str(pki.ca),
                       "--api-key-file", str(key_file)], timeout=300)
    try:
        yield node
    finally:
        node.stop()


def png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@contextlib.asynccontextmanager
async def coordinator(ckpt, target: str, dns: LoopbackDNS, security: ChannelSecurity | None
                      ) -> AsyncIterator[Coordinator]:
    settings = CoordinatorSettings(encoders=(target,), dns_server=dns.address, encoder_wait_seconds=2.0)
    coord = Coordinator.from_checkpoint(settings, None, ckpt, channel_security=security)
    await coord.start()
    try:
        yield coord
    finally:
        await coord.stop()


async def settled(coord: Coordinator, timeout: float = 30.0) -> tuple[str, str]:
    """(state, reason) of the one encoder once its connection attempt has an outcome."""
    deadline = time.monotonic() + timeout
    while True:
        [h] = coord.pool.encoders()
        if h.state.value != "connecting" and not h.settling:
            return h.state.value, h.reason
        left = deadline - time.monotonic()
        assert left > 0, f"encoder still {h.state.value} after {timeout}s"
        await coord.pool.wait_changed(left)


def security(pki: TestPKI, client: Leaf | None, *, key: str | None = KEY, ca: bytes | None = None) -> ChannelSecurity:
    return ChannelSecurity(root_certificates=ca or pki.ca_pem, certificate_chain=client.cert_pem if client else None,
                           private_key=client.key_pem if client else None, api_key=key)


async def test_encoder_found_by_name_is_verified_against_the_name(secured_encoder, tiny_ckpt, dns, pki,
                                                                   client_cert) -> None:
    target = f"{NAME}:{secured_encoder.grpc_port}"
    async with coordinator(tiny_ckpt, target, dns, security(pki, client_cert)) as coord:
        assert await settled(coord) == ("serving", "")
        result = await coord.encode([png(120, 90), png(64, 96)])
        assert coord.encoders()[0].assigned_images == 2
    assert len(result.images) == 2 and all(im.embeds.shape[0] > 0 for im in result.images)


@pytest.mark.parametrize("case", ["by_ip", "no_client_cert", "untrusted_ca", "no_key", "wrong_key", "plaintext"])
async def test_each_missing_part_keeps_the_encoder_out(secured_encoder, tiny_ckpt, dns, pki, client_cert,
                                                       tmp_path, case) -> None:
    port = secured_encoder.grpc_port
    target, sec, why = f"{NAME}:{port}", None, "UNAVAILABLE"
    if case == "by_ip":  # its certificate names the DNS name only: an IP target must not verify
        sec, why = security(pki, client_cert), "Hostname Verification Check failed"
        target = f"127.0.0.1:{port}"
    elif case == "no_client_cert":
        sec = security(pki, None)
    elif case == "untrusted_ca":
        sec, why = security(pki, client_cert, ca=TestPKI(tmp_path / "other").ca_pem), "certificate"
    elif case == "no_key":
        sec, why = security(pki, client_cert, key=None), "UNAUTHENTICATED: missing API key"
    elif case == "wrong_key":
        sec, why = security(pki, client_cert, key="not-the-key"), "UNAUTHENTICATED: invalid API key"
    async with coordinator(tiny_ckpt, target, dns, sec) as coord:
        state, reason = await settled(coord)
        assert state == "unhealthy" and why in reason, reason
        with pytest.raises(Unavailable, match=r"no encoder can serve this request \(1 encoder\(s\): 1 unhealthy"):
            await asyncio.wait_for(coord.encode([png(56, 56)]), 30)
