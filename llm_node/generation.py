"""One generation, whichever front door it came through: images -> embeddings -> vLLM -> deltas.

Both front doors (gRPC GenerateService, OpenAI-compatible HTTP) turn their request into a
GenerationRequest (chat messages whose image parts are placeholders, the image bytes in
the same order, sampling) and relay the Steps this yields; so they share the engine, the
coordinator, the limits, the drain and the metrics. The last step carries usage and the
time split (queue, encode, transfer: the coordinator's; prefill, decode: the engine's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from encdis.client.errors import InvalidArgument, ResourceExhausted, Unavailable
from encdis.llm_node.admission import Admission, Slot
from encdis.llm_node.coordinator import Coordinator, ImageEmbedding
from encdis.llm_node.engine import EngineHost, SamplingSpec
from encdis.llm_node.media_parts import ImagePart, message_text, replace_images
from encdis.llm_node.metrics import LLMNodeMetrics
from encdis.llm_node.prompt import PromptRenderer
from encdis.llm_node.settings import LLMSettings
from encdis.llm_node.timed_engine import DoorRequest
from encdis.serving import InFlight
from encdis.tracing import context_from_metadata, trace_metadata

# Embedding bytes are reserved at the widest wire datatype (FP32), whatever the encoders send.
MAX_ITEMSIZE = 4


@dataclass(frozen=True)
class GenerationRequest:
    messages: list[dict[str, Any]]  # chat turns; each image part is {"type": "image"}, in image order
    images: Sequence[bytes]
    sampling: SamplingSpec
    request_id: str
    deadline: float | None = None  # time.monotonic() seconds the caller waits until (gRPC's deadline)
    # The admission slot the front door took before reading the request (None: generate takes one).
    slot: Slot | None = None
    trace_context: Mapping[str, str] = field(default_factory=dict)  # the caller's traceparent/tracestate


@dataclass(frozen=True)
class EncodedImages:
    images: list[ImageEmbedding]
    cached: int  # how many came from a cache
    split: dict[str, float]  # seconds: queue, preprocess, encode, transfer (the coordinator's)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    image_tokens: int
    images: int
    cached_images: int


@dataclass(frozen=True)
class Step:
    """Text and token ids since the previous step; the last one has `finished` and the totals."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""
    usage: Usage | None = None
    timing: dict[str, float] = field(default_factory=dict)  # seconds per part of the split, on the last step


def validate_images(images: Sequence[bytes], settings: LLMSettings) -> None:
    if len(images) > settings.max_images_per_request:
        raise InvalidArgument(f"{len(images)} images in one request; the limit is {settings.max_images_per_request}")
    for i, im in enumerate(images):
        if not im:
            raise InvalidArgument.for_image(i, "empty")
        if len(im) > settings.max_image_bytes:
            raise InvalidArgument.for_image(i, f"{len(im)} bytes exceeds the limit {settings.max_image_bytes}")


class GenerationService:
    """The node's one path from a request to tokens."""

    def __init__(self, settings: LLMSettings, engine: EngineHost, coordinator: Coordinator,
                 renderer: PromptRenderer, metrics: LLMNodeMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.coordinator = coordinator
        self.renderer = renderer
        self.metrics = metrics
        self.draining = False
        self._calls = InFlight(metrics.in_flight)
        self.admission = Admission(settings.max_concurrent_requests, settings.max_inflight_embedding_bytes)
        metrics.watch_admission(self.admission)
        self.tracing = coordinator.tracing  # one tracer per node, shared with its coordinator

    def tracked(self) -> contextlib.AbstractContextManager[None]:
        """Counts a request in flight (one the front door serves itself) for the drain to wait on."""
        return self._calls.track()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no generation is in flight (within `timeout`)."""
        return await self._calls.wait_idle(timeout)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Step]:
        """The request's steps; errors are encdis.client.errors exceptions. The request's
        admission slot (`req.slot`, or one taken here first) is released when it ends."""
        if self.draining:
            if req.slot is not None:
                req.slot.release()
            raise Unavailable("the LLM node is draining; send the request to another node")
        code = "OK"
        finished = False  # the last step (with the totals) was delivered
        # The request's span; made current only around plain awaits (never across a yield).
        span = self.tracing.tracer.start_span("encdis.generate", context=context_from_metadata(req.trace_context),
                                              kind=SpanKind.SERVER, attributes={"encdis.images": len(req.images),
                                                                                "encdis.request_id": req.request_id})
        with self._calls.track():
            try:
                with req.slot or self.admission.take() as slot:
                    async for step in self._generate(req, slot, span):
                        finished = step.finished
                        yield step
            except (asyncio.CancelledError, GeneratorExit):
                # A caller that closes the stream once it holds the last step (the HTTP door
                # does) was served in full; only one that leaves before it cancelled.
                code = "OK" if finished else "CANCELLED"
                raise
            except Exception as e:
                code = getattr(getattr(e, "code", None), "name", "INTERNAL")
                raise
            finally:
                if req.slot is not None:
                    req.slot.release()  # also when the generator is closed before it started
                self.metrics.requests.labels(code).inc()
                span.set_attribute("rpc.grpc.status_code", code)
                span.end()

    async def _generate(self, req: GenerationRequest, slot: Slot, span: Span) -> AsyncIterator[Step]:
        t_start = time.monotonic()
        images = list(req.images)
        validate_images(images, self.settings)
        # Cheap checks before expensive work, off the event loop (megabytes of prompt or image
        # headers take milliseconds each): the image grids from the headers, the prompt's
        # length with them against the context, then the bytes the embeddings will take.
        grids, digests, prompt, sampling = await asyncio.to_thread(self._prepare, images, req.messages, req.sampling)
        encoded = await self.encode_images(images, grids, digests, slot, deadline=req.deadline, span=span)
        # vLLM traces only when the node does (the same endpoint), and warns when handed headers otherwise.
        trace_headers = dict(trace_metadata(trace.set_span_in_context(span))) if self.tracing.enabled else None
        async for step in self._run_engine(prompt, sampling, encoded.images, req.request_id, encoded.cached,
                                           t_start, encoded.split, trace_headers):
            yield step

    def image_grids_and_digests(self, images: list[bytes]) -> tuple[list[tuple[int, int, int]], list[str]]:
        """The images' grids from their headers, then their digests. Blocking: run it in a worker thread."""
        validate_images(images, self.settings)
        grids = self.coordinator.image_grids(images) if images else []
        return grids, self.coordinator.digests(images) if images else []

    async def encode_images(self, images: list[bytes], grids: list[tuple[int, int, int]], digests: list[str],
                            slot: Slot, *, deadline: float | None = None, span: Span | None = None) -> EncodedImages:
        """The images' embeddings from the pool, their bytes reserved on `slot` first (admission)."""
        image_tokens = [self.coordinator.grid_tokens(g) for g in grids]
        slot.reserve(sum(image_tokens) * self.coordinator.hidden_size * MAX_ITEMSIZE)
        self.metrics.images.inc(len(images))
        if not images:
            return EncodedImages([], 0, {})
        with trace.use_span(span) if span is not None else contextlib.nullcontext():
            result = await self.coordinator.encode(images, deadline=deadline, grids=grids, digests=digests)
        split = dict(queue=result.queue_seconds, preprocess=result.preprocess_seconds, encode=result.encode_seconds,
                     transfer=result.transfer_seconds)
        return EncodedImages(list(result.images), sum(result.cached), split)

    async def embed_parts(self, messages: list[dict[str, Any]], parts: Sequence[ImagePart], images: list[bytes],
                          slot: Slot, door: DoorRequest, *, span: Span | None = None,
                          deadline: float | None = None, encode: bool = True,
                          probe: tuple[list[tuple[int, int, int]], list[str]] | None = None) -> None:
        """Each image part of `messages` (chat messages in vLLM's form) replaced by its embedding's digest
        and grid: encoded by the pool and held in the shared region for the request (`door.held`,
        released by the caller), or, without `encode`, only its grid read (counting tokens). `probe`: the
        images' grids and digests (image_grids_and_digests) when the caller has them already."""
        grids, digests = probe or await asyncio.to_thread(self.image_grids_and_digests, images)
        # Before any encoding: a lower bound of the prompt's tokens from its text's bytes, with the images'.
        expansion = sum(self.coordinator.grid_tokens(g) for g in grids)
        self._fit_to_context(self.renderer.min_tokens(message_text(messages)) + expansion,
                             SamplingSpec(max_tokens=None), at_least=True)
        if encode:
            encoded = await self.encode_images(images, grids, digests, slot, deadline=deadline, span=span)
            door.split = encoded.split
            door.cached = encoded.cached
            door.image_tokens = sum(int(e.embeds.shape[0]) for e in encoded.images)
            try:
                await self.engine.handoff.mm_data(encoded.images)
            except OSError as e:
                raise ResourceExhausted(f"no room for the request's embeddings in the shared region ({e})") from None
            door.held = encoded.images
        replace_images(messages, parts, grids, digests)

    def _prepare(self, images: list[bytes], messages: list[dict[str, Any]],
                 sampling: SamplingSpec) -> tuple[list[tuple[int, int, int]], list[str], str, SamplingSpec]:
        """The images' grids, the prompt, and `sampling` fitted to the context (see _fit_to_context),
        then the images' digests (the coordinator's cache keys: hashed here, off every loop, once the
        request has passed its checks). Blocking: run it in a worker thread."""
        grids = self.coordinator.image_grids(images) if images else []
        # Each image's one placeholder token expands to its embedding's rows.
        expansion = sum(self.coordinator.grid_tokens(g) for g in grids) - len(grids)
        prompt = self.renderer.render_messages(messages)
        # A lower bound from the prompt's bytes first: a prompt far too long is never tokenised.
        self._fit_to_context(self.renderer.min_tokens(prompt) + expansion, sampling, at_least=True)
        sampling = self._fit_to_context(self.renderer.count_tokens(prompt) + expansion, sampling)
        return grids, self.coordinator.digests(images) if images else [], prompt, sampling

    def _fit_to_context(self, prompt_len: int, sampling: SamplingSpec, *, at_least: bool = False) -> SamplingSpec:
        """`sampling` with max_tokens set (default: what the context leaves, as `vllm serve` does);
        InvalidArgument when a prompt of `prompt_len` tokens (with its images; `at_least`: a lower
        bound of that) and max_tokens cannot fit."""
        limit = self.settings.max_model_len
        left = limit - prompt_len
        length = f"at least {prompt_len}" if at_least else f"{prompt_len}"
        if left <= 0:
            raise InvalidArgument(f"the prompt is {length} tokens with its images; the context length is {limit}",
                                  reason="PROMPT_TOO_LONG", metadata={"context_length": str(limit)})
        if sampling.max_tokens is None:
            return dataclasses.replace(sampling, max_tokens=left)
        if sampling.max_tokens > left:
            raise InvalidArgument(f"the prompt is {length} tokens with its images and max_tokens is "
                                  f"{sampling.max_tokens}: more than the context length {limit}",
                                  reason="PROMPT_TOO_LONG", metadata={"context_length": str(limit)})
        return sampling

    async def _run_engine(self, prompt: str, sampling: SamplingSpec, embedded: list[ImageEmbedding],
                          request_id: str, cached: int, t_start: float,
                          coordinator_split: dict[str, float],
                          trace_headers: dict[str, str] | None = None) -> AsyncIterator[Step]:
        queue_s, preprocess_s, encode_s, transfer_s = (coordinator_split.get(k, 0.0) for k in
                                                       ("queue", "preprocess", "encode", "transfer"))
        image_tokens = sum(int(e.embeds.shape[0]) for e in embedded)
        # The caller's id is theirs to reuse: two in flight with the same id never collide in vLLM.
        engine_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        t_submit = time.monotonic()
        t_first: float | None = None
        completion = 0
        prompt_tokens = 0
        async for d in self.engine.generate(prompt, sampling, images=embedded, request_id=engine_id,
                                            trace_headers=trace_headers):
            now = time.monotonic()
            if t_first is None and d.token_ids:
                t_first = now
                self.metrics.ttft.observe(now - t_start)
            completion += len(d.token_ids)
            prompt_tokens = d.prompt_tokens or prompt_tokens
            if not d.finished:
                yield Step(text=d.text, token_ids=d.token_ids)
                continue
            first = t_first if t_first is not None else now
            split = dict(queue=queue_s, preprocess=preprocess_s, encode=encode_s, transfer=transfer_s,
                         prefill=first - t_submit, decode=now - first, total=now - t_start)
            self.metrics.observe_split(**split)
            self.metrics.prompt_tokens.inc(prompt_tokens)
            self.metrics.image_tokens.inc(image_tokens)
            self.metrics.completion_tokens.inc(completion)
            usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, image_tokens=image_tokens,
                          images=len(embedded), cached_images=cached)
            yield Step(text=d.text, token_ids=d.token_ids, finished=True, finish_reason=d.finish_reason or "",
                       usage=usage, timing={k: max(0.0, v) for k, v in split.items()})
