"""API keys: the key set (file, environment, rotation), the gRPC interceptor and the SDK's key.

The gRPC tests run a real grpc.aio server on loopback with a minimal EncoderService written
for the test (what is under test is the interceptor every node installs, and the SDK
clients' channels that send the key).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from encdis.auth import CHECK_INTERVAL_SECONDS, ApiKeyInterceptor, ApiKeys
from encdis.client import AsyncEncoderClient, EncoderClient, Unauthenticated
from encdis.client.channels import ChannelSecurity, read_api_key_file
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.llm_node.coordinator.channel_security import encoder_channel_security
from encdis.llm_node.coordinator.settings import CoordinatorSettings
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


class Clock:
    """A monotonic clock the test moves: the key file's change check is rate-limited by it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self) -> None:
        self.now += CHECK_INTERVAL_SECONDS


def test_key_file_lists_keys_and_rotates_without_restart(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# clients\nold-key\n\n  other-key  \n")
    clock = Clock()
    keys = ApiKeys(path=path, clock=clock)
    assert keys.problem("Bearer old-key") is None
    assert keys.problem("Bearer other-key") is None
    assert keys.problem("Bearer # clients") == "invalid API key"

    # Rotation: write the new list elsewhere and rename it over the old one (as a Secret update does).
    new = tmp_path / "keys.new"
    new.write_text("new-key\n")
    new.replace(path)
    clock.advance()
    assert keys.problem("Bearer new-key") is None
    assert keys.problem("Bearer old-key") == "invalid API key"

    # A broken rewrite keeps the keys that worked.
    path.write_text("\n# nothing\n")
    clock.advance()
    assert keys.problem("Bearer new-key") is None


def test_key_file_change_check_runs_at_most_once_per_interval(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("k1\n")
    clock = Clock()
    keys = ApiKeys(path=path, clock=clock)
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **kw: stats.append(p) or real_stat(p, *a, **kw))
    for _ in range(100):
        assert keys.problem("Bearer k1") is None
    assert stats == []  # within the interval: no stat on the request path
    clock.advance()
    for _ in range(100):
        assert keys.problem("Bearer k1") is None
    assert stats == [path]  # one check per interval, however many requests


def test_key_file_changing_during_the_read_is_read_again(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("old-key\n")
    clock = Clock()
    keys = ApiKeys(path=path, clock=clock)
    real_read = type(path).read_text
    reads = []

    def read_while_written(self, *a, **kw):
        # The first read sees the writer's first half (one whole key, one cut short); the writer then finishes.
        reads.append(self)
        if len(reads) == 1:
            text = real_read(self, *a, **kw)
            with path.open("a") as f:
                f.write("y\n")
            return text
        return real_read(self, *a, **kw)

    monkeypatch.setattr(type(path), "read_text", read_while_written)
    path.write_text("new-key\nsecond-ke")  # a writer has begun rewriting the file in place
    clock.advance()
    assert keys.problem("Bearer second-key") is None  # the whole file, read after the write ended
    assert keys.problem("Bearer second-ke") == "invalid API key"
    assert keys.problem("Bearer old-key") == "invalid API key"
    assert len(reads) == 2


def test_keys_from_the_environment_leave_it(monkeypatch):
    monkeypatch.setenv("ENCDIS_API_KEY", "env-front-key")
    monkeypatch.setenv("ENCDIS_ENCODER_API_KEY", "env-encoder-key")
    keys = ApiKeys.configured(None)
    security = encoder_channel_security(CoordinatorSettings())
    assert keys.problem("Bearer env-front-key") is None
    assert security.api_key == "env-encoder-key"
    assert "ENCDIS_API_KEY" not in os.environ and "ENCDIS_ENCODER_API_KEY" not in os.environ
    # A process started afterwards (as the engine and the reaper are) inherits neither.
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(k for k in os.environ if 'API_KEY' in k))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "[]"


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


class ProbeService(grpc.GenericRpcHandler):
    """Unary and streaming methods under /encdis.* whose request parser counts its calls and fails:
    what a refusal must never reach."""

    def __init__(self) -> None:
        self.parsed = 0

    def _parse(self, data: bytes) -> bytes:
        self.parsed += 1
        raise ValueError("unparseable request")

    def service(self, handler_call_details):
        async def unary(request, context):
            return b"ok"

        async def stream(request, context):
            yield b"ok"

        if handler_call_details.method.endswith("/Unary"):
            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=self._parse)
        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=self._parse)


async def test_refusal_comes_before_the_request_is_received_or_parsed():
    probe = ProbeService()
    srv = grpc.aio.server(interceptors=[ApiKeyInterceptor(ApiKeys(["right-key"]))],
                          options=[("grpc.max_receive_message_length", 1024)])
    srv.add_generic_rpc_handlers([probe])
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    garbage, huge = b"\xff\xff\xff", b"\x0a" * (1 << 20)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            unary = ch.unary_unary("/encdis.test.v1.Probe/Unary")
            stream = ch.unary_stream("/encdis.test.v1.Probe/Stream")

            async def code(call_with, body, key):
                metadata = (("authorization", f"Bearer {key}"),) if key else ()
                try:
                    call = call_with(body, metadata=metadata, timeout=10)
                    if call_with is stream:
                        [_ async for _ in call]
                    else:
                        await call
                except grpc.aio.AioRpcError as e:
                    return e.code()
                return grpc.StatusCode.OK

            for method in (unary, stream):
                for body in (garbage, huge):
                    for key in (None, "wrong-key"):
                        assert await code(method, body, key) is grpc.StatusCode.UNAUTHENTICATED
            assert probe.parsed == 0
            # With the key the same bodies do reach the limit and the parser: the probe can see both.
            assert await code(unary, huge, "right-key") is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await code(unary, garbage, "right-key") is not grpc.StatusCode.OK
            assert probe.parsed == 1
    finally:
        await srv.stop(None)
