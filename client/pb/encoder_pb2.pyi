from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("images", "min_pixels", "max_pixels", "max_chunk_bytes", "colocated_session", "colocated_tag_base")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_SESSION_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_TAG_BASE_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    min_pixels: int
    max_pixels: int
    max_chunk_bytes: int
    colocated_session: str
    colocated_tag_base: int
    def __init__(self, images: _Optional[_Iterable[bytes]] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., colocated_session: _Optional[str] = ..., colocated_tag_base: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("header", "chunk", "first_chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: EmbeddingHeader
    chunk: EmbeddingChunk
    first_chunk: EmbeddingChunk
    def __init__(self, header: _Optional[_Union[EmbeddingHeader, _Mapping]] = ..., chunk: _Optional[_Union[EmbeddingChunk, _Mapping]] = ..., first_chunk: _Optional[_Union[EmbeddingChunk, _Mapping]] = ...) -> None: ...

class EmbeddingHeader(_message.Message):
    __slots__ = ("image_index", "grid_thw", "num_tokens", "hidden_size", "datatype", "digest", "total_bytes", "num_chunks", "batch", "queue_seconds", "preprocess_seconds", "colocated", "colocated_tag", "has_accepted_backlog", "accepted_backlog_seconds", "accepted_queued_patches", "cached")
    IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_TAG_FIELD_NUMBER: _ClassVar[int]
    HAS_ACCEPTED_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BACKLOG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_QUEUED_PATCHES_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    image_index: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    hidden_size: int
    datatype: str
    digest: str
    total_bytes: int
    num_chunks: int
    batch: BatchTiming
    queue_seconds: float
    preprocess_seconds: float
    colocated: bool
    colocated_tag: int
    has_accepted_backlog: bool
    accepted_backlog_seconds: float
    accepted_queued_patches: int
    cached: bool
    def __init__(self, image_index: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ..., datatype: _Optional[str] = ..., digest: _Optional[str] = ..., total_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., batch: _Optional[_Union[BatchTiming, _Mapping]] = ..., queue_seconds: _Optional[float] = ..., preprocess_seconds: _Optional[float] = ..., colocated: _Optional[bool] = ..., colocated_tag: _Optional[int] = ..., has_accepted_backlog: _Optional[bool] = ..., accepted_backlog_seconds: _Optional[float] = ..., accepted_queued_patches: _Optional[int] = ..., cached: _Optional[bool] = ...) -> None: ...

class EmbeddingChunk(_message.Message):
    __slots__ = ("image_index", "chunk_index", "data")
    IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    image_index: int
    chunk_index: int
    data: bytes
    def __init__(self, image_index: _Optional[int] = ..., chunk_index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class BatchTiming(_message.Message):
    __slots__ = ("seconds", "image_patches")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PATCHES_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    image_patches: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seconds: _Optional[float] = ..., image_patches: _Optional[_Iterable[int]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("vision_config_json", "out_hidden_size", "weights_fingerprint", "device", "datatype", "max_batch_patches", "max_images_per_request", "max_image_bytes", "max_image_pixels", "min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size", "boot_id", "hostname", "version", "max_chunk_bytes", "image_loader", "net_namespace", "tower_impl", "cache_bytes")
    VISION_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    OUT_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_PATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MERGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_LOADER_FIELD_NUMBER: _ClassVar[int]
    NET_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOWER_IMPL_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    vision_config_json: str
    out_hidden_size: int
    weights_fingerprint: str
    device: str
    datatype: str
    max_batch_patches: int
    max_images_per_request: int
    max_image_bytes: int
    max_image_pixels: int
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    boot_id: str
    hostname: str
    version: str
    max_chunk_bytes: int
    image_loader: str
    net_namespace: str
    tower_impl: str
    cache_bytes: int
    def __init__(self, vision_config_json: _Optional[str] = ..., out_hidden_size: _Optional[int] = ..., weights_fingerprint: _Optional[str] = ..., device: _Optional[str] = ..., datatype: _Optional[str] = ..., max_batch_patches: _Optional[int] = ..., max_images_per_request: _Optional[int] = ..., max_image_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., patch_size: _Optional[int] = ..., merge_size: _Optional[int] = ..., temporal_patch_size: _Optional[int] = ..., boot_id: _Optional[str] = ..., hostname: _Optional[str] = ..., version: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., image_loader: _Optional[str] = ..., net_namespace: _Optional[str] = ..., tower_impl: _Optional[str] = ..., cache_bytes: _Optional[int] = ...) -> None: ...

class OpenColocatedRequest(_message.Message):
    __slots__ = ("session_id", "store_host", "store_port", "backend", "boot_id", "timeout_seconds", "net_namespace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NET_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    store_host: str
    store_port: int
    backend: str
    boot_id: str
    timeout_seconds: float
    net_namespace: str
    def __init__(self, session_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., backend: _Optional[str] = ..., boot_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., net_namespace: _Optional[str] = ...) -> None: ...

class OpenColocatedResponse(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: str
    def __init__(self, device: _Optional[str] = ...) -> None: ...

class CloseColocatedRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseColocatedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HasRequest(_message.Message):
    __slots__ = ("digests",)
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, digests: _Optional[_Iterable[str]] = ...) -> None: ...

class HasResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...
