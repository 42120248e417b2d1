"""The gRPC front door (GenerateService): proto <-> GenerationRequest, and sampling checks.

A Generate call in the simple form is one user turn (the images, then the prompt) handed to the
node's GenerationService (generation.py), whose steps are relayed as they come. The full form
(`messages` and `sampling`) is vLLM's own chat handling, as on the HTTP door (grpc_chat.py), so
both doors answer one request alike. The last message carries usage and the time split. Errors
are encdis.client.errors exceptions; the shared interceptor maps them to status codes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from encdis.client.errors import InvalidArgument, Unavailable
from encdis.client.pb import llm_pb2, llm_pb2_grpc
from encdis.llm_node import grpc_chat
from encdis.llm_node.coordinator import Coordinator, EncoderStatus
from encdis.llm_node.engine import SamplingSpec
from encdis.llm_node.generation import GenerationRequest, GenerationService
from encdis.llm_node.prompt import user_message
from encdis.llm_node.settings import LLMSettings
from encdis.llm_node.timed_engine import CURRENT, DoorRequest
from encdis.tracing import TRACE_KEYS, context_from_metadata, trace_metadata

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 64
MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_LENGTH = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")


def checked_request_id(request_id: str) -> str:
    """The caller's request id, if it is short and plain enough to log and echo safely."""
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidArgument(f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID_LENGTH}")
    if request_id and not _REQUEST_ID.fullmatch(request_id):
        raise InvalidArgument("request_id may hold only letters, digits and . _ : -")
    return request_id


def call_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The caller's gRPC deadline as time.monotonic() seconds; None when it set none."""
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


def sampling_from_request(req: llm_pb2.GenerateRequest, max_model_len: int) -> SamplingSpec:
    """The request's sampling parameters, checked; proto zeros mean "default"."""
    max_tokens = req.max_tokens or DEFAULT_MAX_TOKENS
    if max_tokens > max_model_len:
        raise InvalidArgument(f"max_tokens {max_tokens} exceeds the model's context length {max_model_len}")
    if req.temperature < 0:
        raise InvalidArgument(f"temperature must be >= 0, got {req.temperature}")
    if not 0 <= req.top_p <= 1:
        raise InvalidArgument(f"top_p must be in (0, 1], got {req.top_p}")
    if req.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0, got {req.top_k}")
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}")
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=float(req.temperature),
        top_p=float(req.top_p) or 1.0,
        top_k=int(req.top_k),
        seed=req.seed if req.HasField("seed") else None,
        ignore_eos=req.ignore_eos,
        stop=tuple(req.stop),
    )


class GenerateServicer(llm_pb2_grpc.GenerateServiceServicer):
    """The LLM node's gRPC front door."""

    def __init__(self, settings: LLMSettings, service: GenerationService, coordinator: Coordinator,
                 chat: Any = None) -> None:
        """`chat`: vLLM's OpenAIServingChat on the node's engine (openai_layer.py), for the full form."""
        self.settings = settings
        self.service = service
        self.coordinator = coordinator
        self.chat = chat

    async def Generate(self, request: llm_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[llm_pb2.GenerateResponse]:
        request_id = checked_request_id(request.request_id) or uuid.uuid4().hex
        if request.messages:
            async for msg in self._chat(request, context, request_id):
                yield msg
            return
        req = GenerationRequest(
            messages=user_message(request.prompt, len(request.images)),
            images=list(request.images),
            sampling=sampling_from_request(request, self.settings.max_model_len),
            request_id=request_id,
            deadline=call_deadline(context),
            trace_context=trace_headers(context.invocation_metadata()),
        )
        async for step in self.service.generate(req):
            msg = llm_pb2.GenerateResponse(text=step.text, token_ids=step.token_ids, request_id=request_id)
            if step.finished:
                u = step.usage
                msg.finished = True
                msg.finish_reason = step.finish_reason
                msg.usage.CopyFrom(llm_pb2.Usage(
                    prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    image_tokens=u.image_tokens, images=u.images, cached_images=u.cached_images))
                msg.timing.CopyFrom(llm_pb2.TimeSplit(**{f"{k}_seconds": v for k, v in step.timing.items()}))
            yield msg

    async def _chat(self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                    request_id: str) -> AsyncIterator[llm_pb2.GenerateResponse]:
        """The full form: vLLM's chat handling (grpc_chat.py), the images through the pool."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        service, chat = self.service, self.chat
        if chat is None:
            raise Unavailable("this node serves only the simple form (no vLLM chat handler)")
        body, parts, images = grpc_chat.chat_body(request, self.settings.served_model_name or self.settings.model)
        if len(images) > self.settings.max_images_per_request:
            raise InvalidArgument(f"{len(images)} images in one request; the limit is "
                                  f"{self.settings.max_images_per_request}")
        door = DoorRequest()
        span = service.tracing.tracer.start_span("encdis.generate", kind=SpanKind.SERVER, attributes={
            "encdis.images": len(images), "encdis.request_id": request_id},
            context=context_from_metadata(trace_headers(context.invocation_metadata())))
        code = "OK"
        with service.tracked():
            slot = None
            try:
                if service.draining:
                    raise Unavailable("the LLM node is draining; send the request to another node")
                slot = service.admission.take()
                if parts:
                    await service.embed_parts(body["messages"], parts, images, slot, door, span=span,
                                              deadline=call_deadline(context))
                del images
                req, engine_input, sampling = await grpc_chat.render(chat, body)
                headers = dict(trace_metadata(trace.set_span_in_context(span))) if service.tracing.enabled else None
                top = req.top_logprobs if req.logprobs else None
                completion = 0
                token = CURRENT.set(door)
                try:
                    engine_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
                    async for out in chat.engine_client.generate(engine_input, sampling, engine_id,
                                                                 trace_headers=headers):
                        msgs = []
                        for c in out.outputs:
                            completion += len(c.token_ids)
                            msgs.append(llm_pb2.GenerateResponse(
                                text=c.text, token_ids=c.token_ids, index=c.index, request_id=request_id,
                                finish_reason=c.finish_reason or "",
                                logprobs=grpc_chat.token_logprobs(chat, c, top)))
                        if out.finished:
                            last = msgs[-1] if msgs else llm_pb2.GenerateResponse(request_id=request_id)
                            last.finished = True
                            last.usage.CopyFrom(llm_pb2.Usage(
                                prompt_tokens=len(out.prompt_token_ids or ()), completion_tokens=completion,
                                image_tokens=door.image_tokens, images=len(parts), cached_images=door.cached))
                            last.timing.CopyFrom(llm_pb2.TimeSplit(
                                **{f"{k}_seconds": v for k, v in door.timing.items()}))
                            msgs[-1:] = [last]
                        for msg in msgs:
                            yield msg
                finally:
                    CURRENT.reset(token)
            except (asyncio.CancelledError, GeneratorExit):
                code = "CANCELLED"
                raise
            except Exception as e:
                code = getattr(getattr(e, "code", None), "name", "INTERNAL")
                raise
            finally:
                if door.held:
                    service.engine.handoff.done(door.held)
                if slot is not None:
                    slot.release()
                service.metrics.requests.labels(code).inc()
                span.set_attribute("rpc.grpc.status_code", code)
                span.end()

    async def ListEncoders(self, request: llm_pb2.ListEncodersRequest,
                           context: grpc.aio.ServicerContext) -> llm_pb2.ListEncodersResponse:
        return llm_pb2.ListEncodersResponse(encoders=[encoder_info(s) for s in self.coordinator.encoders()])


def trace_headers(metadata) -> dict[str, str]:
    """The caller's W3C trace context (traceparent, tracestate) from the call's metadata."""
    return {k: v for k, v in (metadata or ()) if k in TRACE_KEYS and isinstance(v, str)}


def encoder_info(status: EncoderStatus) -> llm_pb2.EncoderInfo:
    """The coordinator's view of one encoder, as the proto has it."""
    return llm_pb2.EncoderInfo(**dataclasses.asdict(status))
