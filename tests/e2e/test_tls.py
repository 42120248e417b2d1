"""TLS end to end: real nodes with --tls-cert / --tls-client-ca, real clients, certificates made here.

- An encoder node with mTLS (a certificate for 127.0.0.1 and localhost, client certificates
  from the test CA required), reflection off, a plaintext health port and metrics on another
  loopback address: plaintext clients, clients without (or with a foreign) certificate, and
  a certificate naming another host are refused; the files replaced while it runs reach new
  connections, established ones keep working.
- An LLM node (one vLLM engine) that dials that encoder with --encoder-tls-ca and a client
  certificate, and serves both front doors (gRPC, OpenAI HTTP) with its own certificate.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from encdis.client import EncoderClient, GenerateClient, Unavailable
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.demo import synthetic_photo
from tests.certificates import Leaf, TestPKI, replace_files, served_certificate

ENCODER_SERVICE = "encdis.encoder.v1.EncoderService"
METRICS_HOST = "127.0.0.2"  # the encoder's metrics bind here, its gRPC port on 127.0.0.1


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TestPKI:
    return TestPKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def client_cert(pki: TestPKI) -> Leaf:
    return pki.issue("client", client=True)


@pytest.fixture(scope="module")
def encoder_cert(pki: TestPKI, tmp_path_factory) -> Leaf:
    """The files the encoder node serves (a test may replace them)."""
    return pki.issue("encoder", dns=["localhost"], ips=["127.0.0.1"], directory=tmp_path_factory.mktemp("live"))


@pytest.fixture(scope="module")
def tls_encoder(tiny_ckpt: Path, pki: TestPKI, encoder_cert: Leaf) -> Iterator[NodeProcess]:
    node = start_node(["encoder", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--tls-cert", str(encoder_cert.cert), "--tls-key", str(encoder_cert.key),
                       "--tls-client-ca", str(pki.ca), "--no-reflection", "--health-port", "0",
                       "--metrics-port", "0", "--metrics-host", METRICS_HOST], timeout=300)
    try:
        yield node
    finally:
        node.stop()


def mtls_client(node: NodeProcess, pki: TestPKI, leaf: Leaf | None, **kw) -> EncoderClient:
    return EncoderClient(node.address, timeout=30, root_certificates=pki.ca_pem,
                         certificate_chain=leaf.cert_pem if leaf else None,
                         private_key=leaf.key_pem if leaf else None, **kw)


def refused(client: EncoderClient) -> str:
    with client, pytest.raises(Unavailable) as e:
        client.describe(timeout=10)
    return e.value.message


def connects(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


def test_encoder_refuses_plaintext_and_clients_without_a_trusted_certificate(tls_encoder, pki, client_cert,
                                                                             tmp_path) -> None:
    refused(EncoderClient(tls_encoder.address))  # plaintext to a TLS port
    refused(mtls_client(tls_encoder, pki, None))  # TLS, but no client certificate
    refused(mtls_client(tls_encoder, pki, TestPKI(tmp_path / "stranger").issue("stranger", client=True)))
    stranger_ca = TestPKI(tmp_path / "other-ca")  # the client does not trust the node's CA
    with EncoderClient(tls_encoder.address, root_certificates=stranger_ca.ca_pem,
                       certificate_chain=client_cert.cert_pem, private_key=client_cert.key_pem) as c:
        assert "certificate" in refused(c)
    with mtls_client(tls_encoder, pki, client_cert) as client:
        assert client.describe().out_hidden_size > 0
        [emb] = client.encode([synthetic_photo(112, 84, seed=1)])
        assert emb.array().shape[0] == emb.grid_thw[1] * emb.grid_thw[2] // 4


def test_certificate_for_another_name_is_refused(tls_encoder, pki, client_cert) -> None:
    """The client dials 127.0.0.1 but asks for a name the node's certificate does not carry."""
    assert "Hostname Verification" in refused(mtls_client(tls_encoder, pki, client_cert, server_name="wrong.example"))
    with mtls_client(tls_encoder, pki, client_cert, server_name="localhost") as client:  # a name it carries
        assert client.describe().out_hidden_size > 0


def test_health_port_is_plaintext_reflection_is_off_metrics_bind_their_host(tls_encoder, pki, client_cert) -> None:
    health_port = tls_encoder.info["health_port"]
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=ENCODER_SERVICE), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    creds = grpc.ssl_channel_credentials(pki.ca_pem, client_cert.key_pem, client_cert.cert_pem)
    with grpc.secure_channel(tls_encoder.address, creds) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=ENCODER_SERVICE), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING  # the TLS port has it too
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                           timeout=10))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED  # --no-reflection
    metrics_port = tls_encoder.metrics_port
    assert connects(METRICS_HOST, metrics_port)
    assert not connects("127.0.0.1", metrics_port)  # bound to --metrics-host only


def test_replaced_certificates_reach_new_connections(tls_encoder, pki, client_cert, encoder_cert,
                                                     tmp_path) -> None:
    port = tls_encoder.grpc_port
    original = pki.issue("encoder-original", dns=["localhost"], ips=["127.0.0.1"], directory=tmp_path / "orig")
    replace_files(original, encoder_cert)  # known starting point, whatever ran before
    established = mtls_client(tls_encoder, pki, client_cert)
    try:
        assert established.describe().out_hidden_size > 0
        assert served_certificate("127.0.0.1", port).serial_number == original.serial()

        # A certificate for another host: new connections refuse it, the established one keeps working.
        wrong = pki.issue("encoder-wrong", dns=["wrong.example"], directory=tmp_path / "wrong")
        replace_files(wrong, encoder_cert)
        assert served_certificate("127.0.0.1", port).serial_number == wrong.serial()
        assert "Hostname Verification" in refused(mtls_client(tls_encoder, pki, client_cert))
        assert established.describe().out_hidden_size > 0

        # A good one again: new connections verify and get it.
        renewed = pki.issue("encoder-renewed", dns=["localhost"], ips=["127.0.0.1"], directory=tmp_path / "new")
        replace_files(renewed, encoder_cert)
        assert served_certificate("127.0.0.1", port).serial_number == renewed.serial()
        with mtls_client(tls_encoder, pki, client_cert) as fresh:
            assert fresh.describe().out_hidden_size > 0
    finally:
        replace_files(original, encoder_cert)
        established.close()


@pytest.mark.vllm
def test_llm_node_serves_through_tls_encoders_and_its_own_tls(tls_encoder, tiny_ckpt, pki, client_cert,
                                                              tmp_path) -> None:
    llm_cert = pki.issue("llm", dns=["localhost"], ips=["127.0.0.1"], directory=tmp_path)
    node = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                       "--metrics-port", "0", "--encoders", tls_encoder.address,
                       "--encoder-tls-ca", str(pki.ca), "--encoder-tls-cert", str(client_cert.cert),
                       "--encoder-tls-key", str(client_cert.key),
                       "--tls-cert", str(llm_cert.cert), "--tls-key", str(llm_cert.key)], timeout=900)
    try:
        image = synthetic_photo(224, 168, seed=3)

        # gRPC front door: plaintext refused; TLS verified against the node's certificate.
        with GenerateClient(node.address, timeout=120) as plain, pytest.raises(Unavailable):
            plain.generate("Describe the picture.", [image], max_tokens=4)
        with GenerateClient(node.address, timeout=300, root_certificates=pki.ca_pem) as client:
            result = client.generate("Describe the picture.", [image], max_tokens=8, ignore_eos=True)
            [enc] = client.list_encoders()
        assert len(result.token_ids) == 8
        assert result.usage.images == 1 and result.usage.image_tokens > 0
        # The image was encoded by the TLS encoder (mTLS, its certificate verified against its IP).
        assert (enc.address, enc.state, enc.assigned_images) == (tls_encoder.address, "serving", 1)

        # HTTP front door: HTTPS with the same certificate; plaintext HTTP refused.
        http_port = node.info["http_port"]
        body = {"model": str(tiny_ckpt), "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Count to three."}]}
        with httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca)), timeout=300) as http:
            assert http.get(f"https://127.0.0.1:{http_port}/health").json() == {"status": "ok"}
            r = http.post(f"https://127.0.0.1:{http_port}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
        with httpx.Client(timeout=30) as http, pytest.raises(httpx.TransportError):
            http.get(f"http://127.0.0.1:{http_port}/health")
        assert served_certificate("127.0.0.1", http_port).serial_number == llm_cert.serial()

        # Metrics bind --host (127.0.0.1), not every interface.
        assert connects("127.0.0.1", node.metrics_port)
        assert not connects(METRICS_HOST, node.metrics_port)
    finally:
        node.stop()
