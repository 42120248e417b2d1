"""gRPC status codes as typed exceptions, so callers can `except Unavailable:`; and their details.

Errors travel with gRPC's rich error model (google.rpc.Status in the `grpc-status-details-bin`
trailer, grpcio-status): an `ErrorInfo` whose `reason` names the failure (UPPER_SNAKE, domain
"encdis") with string metadata, and for bad input a `BadRequest` whose field violations name
the field: `images[3]` for the fourth image of a request. Callers read `e.reason`,
`e.violations` and `e.image_index` and never parse the message text.

    raise InvalidArgument.for_image(3, "cannot decode PNG")   # server side
    except InvalidArgument as e: e.image_index, e.image_reason  # client side: 3, "cannot decode PNG"
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "encdis"
IMAGE_INVALID = "IMAGE_INVALID"  # ErrorInfo.reason of a bad image (BadRequest names which)
_IMAGE_FIELD = re.compile(r"images\[(\d+)\]")


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request (google.rpc.BadRequest.FieldViolation)."""

    field: str  # e.g. "images[3]", "max_pixels"
    description: str


class EncdisError(Exception):
    """A call to an encdis node failed; `code` is the gRPC status code, `reason` its ErrorInfo
    reason (the code's name unless a more exact one was given), `metadata` the ErrorInfo's."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None, *, reason: str | None = None,
                 metadata: Mapping[str, str] | None = None, violations: Sequence[FieldViolation] = ()) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.reason = reason or self.code.name
        self.metadata = dict(metadata or {})
        self.violations = tuple(violations)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @property
    def image_index(self) -> int | None:
        """The request's image this error is about (its first `images[i]` violation), if any."""
        for v in self.violations:
            m = _IMAGE_FIELD.fullmatch(v.field)
            if m is not None:
                return int(m.group(1))
        return None

    @property
    def image_reason(self) -> str | None:
        """Why that image was refused, without the 'image i:' prefix."""
        for v in self.violations:
            if _IMAGE_FIELD.fullmatch(v.field):
                return v.description
        return None

    def to_status(self) -> grpc.Status:
        """This error as a grpc.Status whose trailing metadata carries its details."""
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        status.details.add().Pack(error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN,
                                                              metadata=self.metadata))
        if self.violations:
            status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in self.violations]))
        return rpc_status.to_status(status)


class InvalidArgument(EncdisError):
    """A bad image or parameter; the message names which image and why, `image_index` too."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    @classmethod
    def for_image(cls, index: int, why: str, *, reason: str = IMAGE_INVALID) -> InvalidArgument:
        """The request's image `index` is bad because `why`."""
        return cls(f"image {index}: {why}", reason=reason, violations=[FieldViolation(f"images[{index}]", why)])


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
    """The typed exception for a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`),
    with the rich error details the server sent (none from a peer that sends none)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    reason, metadata, violations = _details(err)
    cls = _BY_CODE.get(code, EncdisError)
    return cls(details or code.name, code, reason=reason, metadata=metadata, violations=violations)


def _details(err: grpc.RpcError) -> tuple[str | None, dict[str, str], list[FieldViolation]]:
    """ErrorInfo and BadRequest out of the call's status trailer; a malformed or mismatched
    trailer (a peer's bytes) gives no details rather than an error of its own."""
    reason, metadata, violations = None, {}, []
    try:
        status = rpc_status.from_call(err) if hasattr(err, "trailing_metadata") else None
    except Exception:  # ValueError on a code/message mismatch, DecodeError on bad bytes
        return reason, metadata, violations
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason or None, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations = [FieldViolation(v.field, v.description) for v in bad.field_violations]
    return reason, metadata, violations
