"""API keys: the key set (file, environment, rotation), the gRPC interceptor and the SDK's key.

The gRPC tests run a real grpc.aio server on loopback with a minimal EncoderService written
for the test (what is under test is the interceptor every node installs, and the SDK
clients' channels that send the key).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from encdis.auth import ApiKeyInterceptor, ApiKeys
from encdis.client import AsyncEncoderClient, EncoderClient, Unauthenticated
from encdis.client.channels import ChannelSecurity, read_api_key_file
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.serving import ErrorMappingInterceptor, add_health_and_reflection

SERVICE = "encdis.encoder.v1.EncoderService"


class EchoEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """Describe answers; Encode streams one empty message: enough to see a call got through."""

    async def Describe(self, request, context):
        return encoder_pb2.DescribeResponse(version="test")

    async def Encode(self, request, context):
        yield encoder_pb2.EncodeResponse(chunk=encoder_pb2.EmbeddingChunk(image_index=0))


def test_problem_names_what_is_wrong_without_echoing_the_key():
    keys = ApiKeys(["s3cret-key"])
    assert keys.problem("Bearer s3cret-key") is None
    assert keys.problem("bearer s3cret-key") is None  # the scheme is case-insensitive (RFC 6750)
    assert "missing API key" in keys.problem(None)
    assert "missing API key" in keys.problem("")
    assert "must be 'Bearer <key>'" in keys.problem("Basic dXNlcjpwYXNz")
    assert "must be 'Bearer <key>'" in keys.problem("Bearer ")
    wrong = keys.problem("Bearer s3cret-kez")
    assert wrong == "invalid API key"
    assert "s3cret" not in wrong


def test_key_file_lists_keys_and_rotates_without_restart(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# clients\nold-key\n\n  other-key  \n")
    keys = ApiKeys.configured(path, environ={})
    assert keys.problem("Bearer old-key") is None
    assert keys.problem("Bearer other-key") is None
    assert keys.problem("Bearer # clients") == "invalid API key"

    # Rotation: write the new list elsewhere and rename it over the old one (as a Secret update does).
    new = tmp_path / "keys.new"
    new.write_text("new-key\n")
    new.replace(path)
    assert keys.problem("Bearer new-key") is None
    assert keys.problem("Bearer old-key") == "invalid API key"

    # A broken rewrite keeps the keys that worked.
    path.write_text("\n# nothing\n")
    assert keys.problem("Bearer new-key") is None


def test_configuration_errors_are_clear(tmp_path):
    assert ApiKeys.configured(None, environ={}) is None  # no keys: no check
    assert ApiKeys.configured(None, environ={"ENCDIS_API_KEY": "k1"}).problem("Bearer k1") is None
    path = tmp_path / "keys"
    path.write_text("k2\n")
    with pytest.raises(ValueError, match="--api-key-file or ENCDIS_API_KEY, not both"):
        ApiKeys.configured(path, environ={"ENCDIS_API_KEY": "k1"})
    with pytest.raises(ValueError, match=f"cannot read API key file {tmp_path / 'missing'}"):
        ApiKeys.configured(tmp_path / "missing", environ={})
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.configured(empty, environ={})
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        ApiKeys.configured(spaced, environ={})
    assert read_api_key_file(path) == "k2"


@pytest.fixture
async def keyed_server():
    srv = grpc.aio.server(interceptors=[ApiKeyInterceptor(ApiKeys(["right-key"])), ErrorMappingInterceptor()])
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(EchoEncoder(), srv)
    health = await add_health_and_reflection(srv, [SERVICE])
    await health.set_serving()
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"127.0.0.1:{port}"
    await srv.stop(None)


async def test_async_client_needs_the_key_for_unary_and_streaming_calls(keyed_server):
    for key, expected in ((None, "missing API key"), ("wrong-key", "invalid API key")):
        async with AsyncEncoderClient(keyed_server, api_key=key) as client:
            with pytest.raises(Unauthenticated, match=expected) as e:
                await client.describe(timeout=10)
            assert e.value.code is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(Unauthenticated, match=expected):
                async for _ in client.encode_iter([b"x"], timeout=10):
                    pass
    async with AsyncEncoderClient(keyed_server, api_key="right-key") as client:
        assert (await client.describe(timeout=10)).version == "test"
        call = encoder_pb2_grpc.EncoderServiceStub(client.channel).Encode(encoder_pb2.EncodeRequest(), timeout=10)
        assert len([m async for m in call]) == 1


async def test_blocking_client_sends_the_key(keyed_server):
    def describe(key: str) -> str:
        with EncoderClient(keyed_server, api_key=key) as client:
            return client.describe(timeout=10).version

    # In a thread: the server answers on this test's event loop.
    with pytest.raises(Unauthenticated, match="invalid API key"):
        await asyncio.to_thread(describe, "wrong-key")
    assert await asyncio.to_thread(describe, "right-key") == "test"


async def test_health_and_reflection_stay_open_without_a_key(keyed_server):
    async with grpc.aio.insecure_channel(keyed_server) as channel:
        r = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = [m async for m in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]))]
        assert SERVICE in {s.name for s in replies[0].list_services_response.service}


def test_client_options_are_checked():
    with pytest.raises(ValueError, match="both certificate_chain and private_key"):
        ChannelSecurity(certificate_chain=b"pem")
    with pytest.raises(ValueError, match="printable ASCII"):
        ChannelSecurity(api_key="has space")
    assert ChannelSecurity(root_certificates=b"pem").tls  # certificates imply TLS
    assert "k3y" not in repr(ChannelSecurity(api_key="k3y"))
    with pytest.raises(ValueError, match="a channel or TLS / API key options, not both"):
        EncoderClient("127.0.0.1:1", channel=grpc.insecure_channel("127.0.0.1:1"), api_key="k")
