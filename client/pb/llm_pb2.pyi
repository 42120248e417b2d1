from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "images", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "request_id")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    def __init__(self, prompt: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finished", "finish_reason", "usage", "timing", "request_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    usage: Usage
    timing: TimeSplit
    request_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[TimeSplit, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "image_tokens", "images", "cached_images")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    image_tokens: int
    images: int
    cached_images: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ..., images: _Optional[int] = ..., cached_images: _Optional[int] = ...) -> None: ...

class TimeSplit(_message.Message):
    __slots__ = ("queue_seconds", "encode_seconds", "transfer_seconds", "prefill_seconds", "decode_seconds", "total_seconds", "preprocess_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    encode_seconds: float
    transfer_seconds: float
    prefill_seconds: float
    decode_seconds: float
    total_seconds: float
    preprocess_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., encode_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., preprocess_seconds: _Optional[float] = ...) -> None: ...

class ListEncodersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncoderInfo(_message.Message):
    __slots__ = ("address", "state", "reason", "backlog_seconds", "backlog_patches", "patches_per_second", "assigned_patches", "assigned_images", "name", "backoff_seconds", "faults", "backoff_remaining_seconds", "has_report", "report_age_seconds", "report_queued_patches", "report_images_in_flight", "report_drain_seconds", "report_utilization", "lateness_seconds")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_PATCHES_FIELD_NUMBER: _ClassVar[int]
    PATCHES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_PATCHES_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HAS_REPORT_FIELD_NUMBER: _ClassVar[int]
    REPORT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPORT_QUEUED_PATCHES_FIELD_NUMBER: _ClassVar[int]
    REPORT_IMAGES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REPORT_DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPORT_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    LATENESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: str
    reason: str
    backlog_seconds: float
    backlog_patches: int
    patches_per_second: float
    assigned_patches: int
    assigned_images: int
    name: str
    backoff_seconds: float
    faults: int
    backoff_remaining_seconds: float
    has_report: bool
    report_age_seconds: float
    report_queued_patches: float
    report_images_in_flight: float
    report_drain_seconds: float
    report_utilization: float
    lateness_seconds: float
    def __init__(self, address: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., backlog_seconds: _Optional[float] = ..., backlog_patches: _Optional[int] = ..., patches_per_second: _Optional[float] = ..., assigned_patches: _Optional[int] = ..., assigned_images: _Optional[int] = ..., name: _Optional[str] = ..., backoff_seconds: _Optional[float] = ..., faults: _Optional[int] = ..., backoff_remaining_seconds: _Optional[float] = ..., has_report: _Optional[bool] = ..., report_age_seconds: _Optional[float] = ..., report_queued_patches: _Optional[float] = ..., report_images_in_flight: _Optional[float] = ..., report_drain_seconds: _Optional[float] = ..., report_utilization: _Optional[float] = ..., lateness_seconds: _Optional[float] = ...) -> None: ...

class ListEncodersResponse(_message.Message):
    __slots__ = ("encoders",)
    ENCODERS_FIELD_NUMBER: _ClassVar[int]
    encoders: _containers.RepeatedCompositeFieldContainer[EncoderInfo]
    def __init__(self, encoders: _Optional[_Iterable[_Union[EncoderInfo, _Mapping]]] = ...) -> None: ...
