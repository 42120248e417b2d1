"""The shared node plumbing: error mapping, health, reflection, systemd notifications.

The handlers here are minimal servicers written for the test: what is under test is the
interceptor and health wiring that every real node uses.
"""

from __future__ import annotations

import os
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis import sd_notify
from encdis.client.errors import InvalidArgument, Unauthenticated, Unavailable
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.serving import (
    HEALTH_PORT_MAX_REQUEST_BYTES,
    INTERNAL_MESSAGE,
    ErrorMappingInterceptor,
    add_health_and_reflection,
    start_health_port,
)

SERVICE = "encdis.encoder.v1.EncoderService"


class RaisingEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """Describe raises whatever `self.error` is; Encode yields one message then raises it."""

    error: BaseException | None = None

    async def Describe(self, request, context):
        if self.error:
            raise self.error
        return encoder_pb2.DescribeResponse(version="test")

    async def Encode(self, request, context):
        yield encoder_pb2.EncodeResponse(chunk=encoder_pb2.EmbeddingChunk(image_index=0))
        if self.error:
            raise self.error


@pytest.fixture
async def server():
    srv = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    servicer = RaisingEncoder()
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(servicer, srv)
    health = await add_health_and_reflection(srv, [SERVICE])
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, health, channel
    await channel.close()
    await srv.stop(None)


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (InvalidArgument("image 2: not an image"), grpc.StatusCode.INVALID_ARGUMENT, "image 2: not an image"),
        (Unavailable("draining"), grpc.StatusCode.UNAVAILABLE, "draining"),
        (Unauthenticated("invalid API key"), grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
        (RuntimeError("secret internals"), grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE),
    ],
)
async def test_errors_become_status_codes_in_unary_and_stream(server, error, code, message):
    servicer, _, channel = server
    servicer.error = error
    stub = encoder_pb2_grpc.EncoderServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Describe(encoder_pb2.DescribeRequest())
    assert (e.value.code(), e.value.details()) == (code, message)

    got = []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for msg in stub.Encode(encoder_pb2.EncodeRequest()):
            got.append(msg)
    assert (e.value.code(), e.value.details()) == (code, message)
    assert len(got) == 1  # what was sent before the failure still arrives

    servicer.error = None  # the server keeps serving after any of them
    assert (await stub.Describe(encoder_pb2.DescribeRequest())).version == "test"


async def test_health_starts_not_serving_and_follows_state(server):
    _, health, channel = server
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE):
        r = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
    await health.set_serving()
    r = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    await health.set_not_serving()
    r = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_the_health_port_answers_probes_and_refuses_large_requests_unread(server):
    _, health, _ = server
    port_server, port = await start_health_port(health, "127.0.0.1", 0)
    try:
        await health.set_serving()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            r = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Check(health_pb2.HealthCheckRequest(service="x" * HEALTH_PORT_MAX_REQUEST_BYTES))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await port_server.stop(None)


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify_sends_a_datagram(tmp_path, monkeypatch, abstract):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"encdis-test-{os.getpid()}"
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    else:
        path = str(tmp_path / "notify.sock")
        sock.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
    with sock:
        sock.settimeout(5)
        assert sd_notify.notify("READY=1")
        assert sock.recv(64) == b"READY=1"


def test_sd_notify_without_systemd_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify.notify("READY=1") is False
