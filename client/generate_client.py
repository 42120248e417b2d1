"""Clients for the LLM node's GenerateService, sync and asyncio (streaming).

    with GenerateClient("127.0.0.1:50050") as llm:
        for chunk in llm.generate_stream("What is in this picture?", [open("cat.jpg", "rb").read()]):
            print(chunk.text, end="", flush=True)
        result = llm.generate("Describe it.", images)   # the whole completion at once
        print(result.text, result.token_ids, result.timing)

TLS and an API key: `GenerateClient(target, root_certificates=ca_pem, api_key=key)`; the
options are those of EncoderClient (encoder_client.py).

The full form, a conversation with vLLM's sampling parameters (chat_request.py), answers as
`vllm serve`'s chat API does for the same request:

        answer = llm.chat([{"role": "user", "content": [image, "Describe it."]}], max_tokens=64,
                          repetition_penalty=1.1, logprobs=True, top_logprobs=2)
        print(answer.choices[0].text, answer.choices[0].logprobs[0])

The simple form is greedy unless a temperature is given. Failed calls raise the typed exceptions of
`encdis.client.errors` (InvalidArgument names the bad image, Unavailable when no encoder
can serve the request, ...).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from encdis.client.chat_request import chat_request
from encdis.client.client_base import AsyncClient, SyncClient
from encdis.client.errors import from_rpc_error
from encdis.client.pb import llm_pb2, llm_pb2_grpc


@dataclass(frozen=True)
class TimeSplit:
    """Where a request's time went, in seconds (llm.proto's TimeSplit says what each part holds)."""

    queue: float
    encode: float
    transfer: float
    prefill: float
    decode: float
    total: float
    preprocess: float = 0.0  # the encoder's decoding and preprocessing (0 from a node that does not say)

    @classmethod
    def from_proto(cls, t: llm_pb2.TimeSplit) -> TimeSplit:
        return cls(t.queue_seconds, t.encode_seconds, t.transfer_seconds, t.prefill_seconds, t.decode_seconds,
                   t.total_seconds, t.preprocess_seconds)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    image_tokens: int
    images: int
    cached_images: int

    @classmethod
    def from_proto(cls, u: llm_pb2.Usage) -> Usage:
        return cls(u.prompt_tokens, u.completion_tokens, u.image_tokens, u.images, u.cached_images)


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message: a text delta and its token ids; the last has usage and timing."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str
    request_id: str
    usage: Usage | None = None
    timing: TimeSplit | None = None
    index: int = 0  # which of the request's n sequences this continues
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked for

    @classmethod
    def from_proto(cls, m: llm_pb2.GenerateResponse) -> GenerateChunk:
        return cls(
            text=m.text,
            token_ids=tuple(m.token_ids),
            finished=m.finished,
            finish_reason=m.finish_reason,
            request_id=m.request_id,
            usage=Usage.from_proto(m.usage) if m.HasField("usage") else None,
            timing=TimeSplit.from_proto(m.timing) if m.HasField("timing") else None,
            index=m.index,
            logprobs=tuple(TokenLogprob.from_proto(t) for t in m.logprobs),
        )


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the most likely tokens at its position (token id, text, logprob)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()

    @classmethod
    def from_proto(cls, t: llm_pb2.TokenLogprob) -> TokenLogprob:
        return cls(t.token_id, t.token, t.logprob, tuple((a.token_id, a.token, a.logprob) for a in t.top))


@dataclass
class GenerateResult:
    """A whole completion, gathered from the stream."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    request_id: str = ""
    usage: Usage | None = None
    timing: TimeSplit | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, c: GenerateChunk) -> None:
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs)
        self.request_id = c.request_id or self.request_id
        self.finish_reason = c.finish_reason or self.finish_reason
        if c.finished:
            self.usage, self.timing = c.usage, c.timing


@dataclass
class ChatResult:
    """A whole answer to a full-form request: one GenerateResult per sequence (n), by index."""

    choices: list[GenerateResult] = field(default_factory=list)
    usage: Usage | None = None
    timing: TimeSplit | None = None

    def add(self, c: GenerateChunk) -> None:
        while len(self.choices) <= c.index:
            self.choices.append(GenerateResult())
        self.choices[c.index].add(c)
        if c.finished:
            self.usage, self.timing = c.usage, c.timing


@dataclass(frozen=True)
class EncoderInfo:
    """One encoder as the LLM node's coordinator sees it."""

    address: str
    name: str
    state: str
    reason: str
    backlog_seconds: float
    backlog_patches: int
    patches_per_second: float
    assigned_patches: int
    assigned_images: int
    backoff_seconds: float  # length of its current penalty (quarantined, slow); 0 when none
    faults: int  # consecutive faults behind that penalty
    backoff_remaining_seconds: float  # until it is probed again
    # Its last ORCA load report as the coordinator holds it (None: none received) and its age.
    report: dict[str, float] | None = None
    report_age_seconds: float = 0.0
    lateness_seconds: float = 0.0  # how late its calls recently finished past their prediction

    @classmethod
    def from_proto(cls, e: llm_pb2.EncoderInfo) -> EncoderInfo:
        report = ({"queued_patches": e.report_queued_patches, "images_in_flight": e.report_images_in_flight,
                   "drain_seconds": e.report_drain_seconds, "utilization": e.report_utilization}
                  if e.has_report else None)
        return cls(e.address, e.name, e.state, e.reason, e.backlog_seconds, e.backlog_patches,
                   e.patches_per_second, e.assigned_patches, e.assigned_images, e.backoff_seconds, e.faults,
                   e.backoff_remaining_seconds, report, e.report_age_seconds if e.has_report else 0.0,
                   e.lateness_seconds)


def generate_request(
    prompt: str,
    images: Sequence[bytes] = (),
    *,
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    ignore_eos: bool = False,
    stop: Sequence[str] = (),
    request_id: str = "",
) -> llm_pb2.GenerateRequest:
    req = llm_pb2.GenerateRequest(prompt=prompt, images=list(images), max_tokens=max_tokens,
                                  temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos,
                                  stop=list(stop), request_id=request_id)
    if seed is not None:
        req.seed = seed
    return req


class GenerateClient(SyncClient):
    """Blocking client for an LLM node."""

    def _bind(self) -> None:
        self._stub = llm_pb2_grpc.GenerateServiceStub(self._channel)

    def generate_stream(self, prompt: str, images: Sequence[bytes] = (), *, timeout: float | None = None,
                        **params) -> Iterator[GenerateChunk]:
        """Stream the completion; keyword params as in `generate_request`."""
        yield from self._stream(generate_request(prompt, images, **params), timeout)

    def _stream(self, req: llm_pb2.GenerateRequest, timeout: float | None) -> Iterator[GenerateChunk]:
        try:
            for msg in self._stub.Generate(req, timeout=timeout or self.timeout):
                yield GenerateChunk.from_proto(msg)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def generate(self, prompt: str, images: Sequence[bytes] = (), *, timeout: float | None = None,
                 **params) -> GenerateResult:
        """The whole completion."""
        out = GenerateResult()
        for c in self.generate_stream(prompt, images, timeout=timeout, **params):
            out.add(c)
        return out

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
                    request_id: str = "", **sampling: Any) -> Iterator[GenerateChunk]:
        """Stream the answer to a conversation (see `chat_request` for the messages and sampling)."""
        yield from self._stream(chat_request(messages, request_id=request_id, **sampling), timeout)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None, request_id: str = "",
             **sampling: Any) -> ChatResult:
        """The whole answer to a conversation, as `vllm serve`'s chat API would give it."""
        out = ChatResult()
        for c in self.chat_stream(messages, timeout=timeout, request_id=request_id, **sampling):
            out.add(c)
        return out

    def list_encoders(self, *, timeout: float | None = None) -> list[EncoderInfo]:
        try:
            r = self._stub.ListEncoders(llm_pb2.ListEncodersRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return [EncoderInfo.from_proto(e) for e in r.encoders]


class AsyncGenerateClient(AsyncClient):
    """asyncio client for an LLM node (grpc.aio)."""

    def _bind(self) -> None:
        self._stub = llm_pb2_grpc.GenerateServiceStub(self._channel)

    async def _stream(self, req: llm_pb2.GenerateRequest, timeout: float | None) -> AsyncIterator[GenerateChunk]:
        call = self._stub.Generate(req, timeout=timeout or self.timeout)
        try:
            async for msg in call:
                yield GenerateChunk.from_proto(msg)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op when finished; stops the server's work if we stopped reading

    async def generate_stream(self, prompt: str, images: Sequence[bytes] = (), *, timeout: float | None = None,
                              **params) -> AsyncIterator[GenerateChunk]:
        async for c in self._stream(generate_request(prompt, images, **params), timeout):
            yield c

    async def generate(self, prompt: str, images: Sequence[bytes] = (), *, timeout: float | None = None,
                       **params) -> GenerateResult:
        out = GenerateResult()
        async for c in self.generate_stream(prompt, images, timeout=timeout, **params):
            out.add(c)
        return out

    async def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
                          request_id: str = "", **sampling: Any) -> AsyncIterator[GenerateChunk]:
        async for c in self._stream(chat_request(messages, request_id=request_id, **sampling), timeout):
            yield c

    async def chat(self, messages: Sequence[Mapping[str, Any]], *, timeout: float | None = None,
                   request_id: str = "", **sampling: Any) -> ChatResult:
        out = ChatResult()
        async for c in self.chat_stream(messages, timeout=timeout, request_id=request_id, **sampling):
            out.add(c)
        return out

    async def list_encoders(self, *, timeout: float | None = None) -> list[EncoderInfo]:
        try:
            r = await self._stub.ListEncoders(llm_pb2.ListEncodersRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return [EncoderInfo.from_proto(e) for e in r.encoders]
