from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "images", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "request_id", "messages", "sampling")
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
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
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
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    sampling: Sampling
    def __init__(self, prompt: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: bytes
    def __init__(self, text: _Optional[str] = ..., image: _Optional[bytes] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "n", "logprobs", "top_logprobs", "structured", "include_stop_str_in_output", "skip_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    n: int
    logprobs: bool
    top_logprobs: int
    structured: StructuredOutput
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "regex", "choice", "grammar", "json_object")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    choice: Choices
    grammar: str
    json_object: bool
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finished", "finish_reason", "usage", "timing", "request_id", "index", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    usage: Usage
    timing: TimeSplit
    request_id: str
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[TimeSplit, _Mapping]] = ..., request_id: _Optional[str] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

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
