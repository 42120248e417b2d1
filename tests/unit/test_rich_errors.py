"""Errors as data: a node's typed error reaches the SDK with its ErrorInfo and BadRequest
details over a real gRPC call, and a peer's malformed details cannot break the caller."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from encdis import serving
from encdis.client.errors import (
    IMAGE_INVALID,
    FieldViolation,
    InvalidArgument,
    ResourceExhausted,
    from_rpc_error,
)

METHOD = "/encdis.test.v1.Errors/Fail"


def _server(behavior) -> tuple[grpc.aio.Server, str]:
    async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await behavior(context)
        return b""

    handler = grpc.method_handlers_generic_handler("encdis.test.v1.Errors", {
        "Fail": grpc.unary_unary_rpc_method_handler(fail)})
    server = grpc.aio.server(interceptors=[serving.ErrorMappingInterceptor()])
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


async def _call(behavior) -> Exception:
    server, address = _server(behavior)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary(METHOD)(b"")
        return from_rpc_error(info.value)
    finally:
        await server.stop(None)


async def test_a_handlers_typed_error_arrives_with_its_details() -> None:
    async def raise_bad_image(context):
        raise InvalidArgument.for_image(2, "cannot decode PNG: truncated")

    err = await _call(raise_bad_image)
    assert isinstance(err, InvalidArgument) and err.message == "image 2: cannot decode PNG: truncated"
    assert (err.reason, err.image_index, err.image_reason) == (IMAGE_INVALID, 2, "cannot decode PNG: truncated")
    assert err.violations == (FieldViolation("images[2]", "cannot decode PNG: truncated"),)

    async def raise_busy(context):
        raise ResourceExhausted("queue full", reason="ENCODER_QUEUE_FULL", metadata={"limit": "10"})

    err = await _call(raise_busy)
    assert isinstance(err, ResourceExhausted)
    assert (err.reason, err.metadata, err.image_index) == ("ENCODER_QUEUE_FULL", {"limit": "10"}, None)


async def test_an_error_without_details_gets_its_codes_name_as_reason() -> None:
    async def plain_abort(context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "image 1: bad")  # text only: not an image index

    err = await _call(plain_abort)
    assert isinstance(err, InvalidArgument)
    assert (err.reason, err.image_index, err.violations) == ("INVALID_ARGUMENT", None, ())


@pytest.mark.parametrize("trailer", [
    b"\xff\x00 not a google.rpc.Status",
    # A well-formed Status whose code and message disagree with the call's own.
    status_pb2.Status(code=grpc.StatusCode.OK.value[0], message="other").SerializeToString(),
])
async def test_a_peers_malformed_details_are_ignored_not_raised(trailer: bytes) -> None:
    async def abort_with(context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "image 0: bad",
                            trailing_metadata=(("grpc-status-details-bin", trailer),))

    err = await _call(abort_with)
    assert isinstance(err, InvalidArgument) and err.message == "image 0: bad"
    assert (err.reason, err.image_index) == ("INVALID_ARGUMENT", None)


async def test_details_of_an_unknown_kind_are_skipped() -> None:
    status = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="image 0: bad")
    status.details.add().Pack(error_details_pb2.RetryInfo())
    status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field="images[0]", description="bad")]))

    async def abort_with(context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "image 0: bad",
                            trailing_metadata=(("grpc-status-details-bin", status.SerializeToString()),))

    err = await _call(abort_with)
    assert (err.image_index, err.image_reason, err.reason) == (0, "bad", "INVALID_ARGUMENT")
