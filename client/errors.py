"""gRPC status codes as typed exceptions, so callers can `except Unavailable:`."""

from __future__ import annotations

import grpc


class EncdisError(Exception):
    """A call to an encdis node failed; `code` is the gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(EncdisError):
    """A bad image or parameter; the message names which image and why."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(EncdisError):
    """A queue or limit is full (too many images, bytes, concurrent calls)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(EncdisError):
    """The node is loading, draining or unreachable; retrying elsewhere may work."""

    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(EncdisError):
    """A model mismatch: the encoder's weights are not the LLM's."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(EncdisError):
    """No valid API key (or client certificate) came with the call."""

    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(EncdisError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(EncdisError):
    code = grpc.StatusCode.INTERNAL


class WireError(EncdisError):
    """The embedding stream broke the wire contract (sizes, order, missing chunks)."""

    code = grpc.StatusCode.DATA_LOSS


_BY_CODE: dict[grpc.StatusCode, type[EncdisError]] = {
    cls.code: cls
    for cls in (InvalidArgument, ResourceExhausted, Unavailable, FailedPrecondition, Unauthenticated, DeadlineExceeded,
                Internal)
}


def from_rpc_error(err: grpc.RpcError) -> EncdisError:
    """The typed exception for a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, EncdisError)
    return cls(details or code.name, code)
