"""encdis client SDK: typed gRPC clients for encoder nodes and the LLM node.

Depends on grpcio, protobuf and numpy only (no torch), so any service can call encdis.
"""

from encdis.client.chat_request import chat_request
from encdis.client.encoder_client import AsyncEncoderClient, EncoderClient, EncoderDescription
from encdis.client.errors import (
    DeadlineExceeded,
    EncdisError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    WireError,
)
from encdis.client.generate_client import (
    AsyncGenerateClient,
    ChatResult,
    EncoderInfo,
    GenerateChunk,
    GenerateClient,
    GenerateResult,
    TimeSplit,
    Usage,
)
from encdis.client.wire import Embedding

__all__ = [
    "AsyncEncoderClient",
    "AsyncGenerateClient",
    "ChatResult",
    "DeadlineExceeded",
    "Embedding",
    "EncdisError",
    "EncoderClient",
    "EncoderDescription",
    "EncoderInfo",
    "FailedPrecondition",
    "GenerateChunk",
    "GenerateClient",
    "GenerateResult",
    "Internal",
    "InvalidArgument",
    "ResourceExhausted",
    "TimeSplit",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "chat_request",
    "WireError",
]
