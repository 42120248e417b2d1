"""GenerateService: proto <-> domain, validation, and the request's time split.

A Generate call: validate -> the coordinator turns the images into embeddings (encoder
pool, cache) -> the prompt is rendered with the checkpoint's chat template -> vLLM streams
deltas, relayed as they come. The last message carries usage and the time split.
Errors are raised as encdis.client.errors exceptions; the shared interceptor maps them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from encdis.client.errors import InvalidArgument, Unavailable
from encdis.client.pb import llm_pb2, llm_pb2_grpc
from encdis.llm_node.engine import EngineHost, ImageEmbedding, SamplingSpec
from encdis.llm_node.metrics import LLMNodeMetrics
from encdis.llm_node.prompt import PromptRenderer
from encdis.llm_node.settings import LLMSettings
from encdis.serving import InFlight

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 64
MAX_STOP_STRINGS = 16


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


def validate_images(images: list[bytes], settings: LLMSettings) -> None:
    if len(images) > settings.max_images_per_request:
        raise InvalidArgument(f"{len(images)} images in one request; the limit is {settings.max_images_per_request}")
    for i, im in enumerate(images):
        if not im:
            raise InvalidArgument(f"image {i}: empty")
        if len(im) > settings.max_image_bytes:
            raise InvalidArgument(f"image {i}: {len(im)} bytes exceeds the limit {settings.max_image_bytes}")


class GenerateServicer(llm_pb2_grpc.GenerateServiceServicer):
    """The LLM node's front door (gRPC)."""

    def __init__(self, settings: LLMSettings, engine: EngineHost, coordinator: Any, renderer: PromptRenderer,
                 metrics: LLMNodeMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.coordinator = coordinator
        self.renderer = renderer
        self.metrics = metrics
        self.draining = False
        self._calls = InFlight(metrics.in_flight)

    async def wait_idle(self, timeout: float) -> bool:
        """True when no Generate is in flight (within `timeout`)."""
        return await self._calls.wait_idle(timeout)

    async def Generate(self, request: llm_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[llm_pb2.GenerateResponse]:
        if self.draining:
            raise Unavailable("the LLM node is draining; send the request to another node")
        code = "OK"
        with self._calls.track():
            try:
                async for msg in self._generate(request):
                    yield msg
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as e:
                code = getattr(getattr(e, "code", None), "name", "INTERNAL")
                raise
            finally:
                self.metrics.requests.labels(code).inc()

    async def _generate(self, req: llm_pb2.GenerateRequest) -> AsyncIterator[llm_pb2.GenerateResponse]:
        t_start = time.monotonic()
        request_id = req.request_id or uuid.uuid4().hex
        sampling = sampling_from_request(req, self.settings.max_model_len)
        images = list(req.images)
        validate_images(images, self.settings)
        self.metrics.images.inc(len(images))

        embedded: list[ImageEmbedding] = []
        queue_s = encode_s = transfer_s = 0.0
        cached = 0
        if images:
            result = await self.coordinator.encode(images)
            embedded = [ImageEmbedding(im.embeds, tuple(im.grid_thw), im.digest) for im in result.images]
            cached = sum(1 for im in result.images if im.cached)
            queue_s, encode_s, transfer_s = result.queue_seconds, result.encode_seconds, result.transfer_seconds
        prompt = self.renderer.render(req.prompt, len(images))
        image_tokens = sum(int(e.embeds.shape[0]) for e in embedded)

        t_submit = time.monotonic()
        t_first: float | None = None
        completion = 0
        prompt_tokens = 0
        async for d in self.engine.generate(prompt, sampling, images=embedded, request_id=request_id):
            now = time.monotonic()
            if t_first is None and d.token_ids:
                t_first = now
                self.metrics.ttft.observe(now - t_start)
            completion += len(d.token_ids)
            prompt_tokens = d.prompt_tokens or prompt_tokens
            msg = llm_pb2.GenerateResponse(text=d.text, token_ids=d.token_ids, request_id=request_id)
            if d.finished:
                t_end = now
                first = t_first if t_first is not None else t_end
                split = dict(queue=queue_s, encode=encode_s, transfer=transfer_s,
                             prefill=first - t_submit, decode=t_end - first, total=t_end - t_start)
                self.metrics.observe_split(**split)
                self.metrics.prompt_tokens.inc(prompt_tokens)
                self.metrics.image_tokens.inc(image_tokens)
                self.metrics.completion_tokens.inc(completion)
                msg.finished = True
                msg.finish_reason = d.finish_reason or ""
                msg.usage.CopyFrom(llm_pb2.Usage(
                    prompt_tokens=prompt_tokens, completion_tokens=completion, image_tokens=image_tokens,
                    images=len(images), cached_images=cached))
                msg.timing.CopyFrom(llm_pb2.TimeSplit(**{f"{k}_seconds": max(0.0, v) for k, v in split.items()}))
            yield msg

    async def ListEncoders(self, request: llm_pb2.ListEncodersRequest,
                           context: grpc.aio.ServicerContext) -> llm_pb2.ListEncodersResponse:
        return llm_pb2.ListEncodersResponse(encoders=[encoder_info(s) for s in self.coordinator.encoders()])


def encoder_info(status: Any) -> llm_pb2.EncoderInfo:
    """The coordinator's view of one encoder, as the proto has it."""
    def get(name: str, default: Any) -> Any:
        v = getattr(status, name, default)
        return default if v is None else v

    state = get("state", "")
    return llm_pb2.EncoderInfo(
        address=str(get("address", "")),
        state=str(getattr(state, "value", state)),
        reason=str(get("reason", "")),
        backlog_seconds=float(get("backlog_seconds", 0.0)),
        backlog_patches=int(get("backlog_patches", 0)),
        patches_per_second=float(get("patches_per_second", 0.0)),
        assigned_patches=int(get("assigned_patches", 0)),
        assigned_images=int(get("assigned_images", 0)),
        name=str(get("name", "")),
    )
