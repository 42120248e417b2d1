"""The OpenAI-compatible HTTP front door: /v1/chat/completions, /v1/models, /health.

FastAPI + uvicorn (both ship with vLLM; this module is imported only with --http-port) in
the node's own event loop, on the same
GenerationService as the gRPC front door. Requests parse with vLLM's own
ChatCompletionRequest and answers are vLLM's own response models, so any OpenAI client,
`vllm bench serve`, guidellm or aiperf sees exactly what `vllm serve` would send.

A message's content is a string or `text` / `image_url` parts; each image becomes a
placeholder in the chat template, in order, as vLLM renders it. Streaming is server-sent
events ending with `data: [DONE]`; `stream_options.include_usage` adds a last usage chunk.
Errors are OpenAI's error object: 400 (names the bad image's index), 401 without a valid
API key (when the node has keys; /health stays open), 413, 429 with
Retry-After, 503 while draining or with no encoder, 500 with a fixed message otherwise.

Limits come before work: a request takes its admission slot before its body is read (a full
node answers 429 without reading it), the body is read as a stream against a running limit
(413 as soon as it passes it, whatever Content-Length said or with none: chunked), and the
JSON and base64 decoding run in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from encdis.client.errors import EncdisError, InvalidArgument, ResourceExhausted, Unavailable
from encdis.llm_node.engine import SamplingSpec
from encdis.llm_node.generation import GenerationRequest, GenerationService, Step
from encdis.llm_node.media import MediaLoader
from encdis.llm_node.settings import LLMSettings
from encdis.tracing import TRACE_KEYS

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal error (details are in the node's log)"
MAX_BODY_BYTES_OVER_IMAGES = 1 << 20  # room for the JSON around the base64 images
RETRY_AFTER_SECONDS = "1"
ROLES = ("system", "user", "assistant")


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def default_sampling(model_dir: str) -> dict[str, Any]:
    """The checkpoint's generation_config.json defaults, as `vllm serve` applies them."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    cfg = json.loads(path.read_text())
    return {k: cfg[k] for k in ("temperature", "top_p", "top_k") if cfg.get(k) is not None}


def _error_for(e: Exception) -> HttpError:
    if isinstance(e, HttpError):
        return e
    if isinstance(e, InvalidArgument):
        # The field the details name (images[i]: the request's i-th image, in order of appearance).
        return HttpError(400, e.message, param=e.violations[0].field if e.violations else None)
    if isinstance(e, ResourceExhausted):
        return HttpError(429, e.message, "RateLimitError")
    if isinstance(e, Unavailable):
        return HttpError(503, e.message, "ServiceUnavailableError")
    if isinstance(e, EncdisError) and e.code.name == "UNAUTHENTICATED":
        return HttpError(401, e.message, "AuthenticationError")
    log.exception("chat completion failed")
    return HttpError(500, INTERNAL_MESSAGE, "InternalServerError")


def error_body(err: HttpError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.status}}


class ChatFront:
    """Turns OpenAI chat requests into GenerationRequests and Steps back into OpenAI objects."""

    def __init__(self, settings: LLMSettings, service: GenerationService) -> None:
        self.settings = settings
        self.service = service
        self.model_name = settings.served_model_name or settings.model
        self.defaults = default_sampling(settings.model)
        # Request bodies carry base64 images (4/3 of their bytes).
        self.max_body_bytes = (settings.max_images_per_request * settings.max_image_bytes * 4 // 3
                               + MAX_BODY_BYTES_OVER_IMAGES)
        self.media = MediaLoader(allowed_domains=settings.allowed_media_domains, max_bytes=settings.max_image_bytes,
                                 timeout_seconds=settings.media_timeout_seconds)

    async def read_body(self, request: Request) -> bytes:
        """The request's body, refused (413) as soon as it passes the limit: never read whole first."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"request body of {declared} bytes exceeds the limit {limit}",
                            "PayloadTooLargeError")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise HttpError(413, f"request body exceeds the limit {limit}", "PayloadTooLargeError")
        return bytes(body)

    async def parse(self, raw: bytes, slot: Any = None) -> tuple[Any, GenerationRequest]:
        """The request and its GenerationRequest (holding `slot`, the admission slot taken for it)."""
        req, messages, urls = await asyncio.to_thread(self._parse_sync, raw)
        images = await self.media.load_all(urls)
        return req, self._generation_request(req, messages, images, slot)

    def _parse_sync(self, raw: bytes) -> tuple[Any, list[dict[str, Any]], list[str]]:
        """JSON -> vLLM's ChatCompletionRequest -> messages and image URLs. Blocking (megabytes)."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise HttpError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "request body must be a JSON object")
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise HttpError(400, f"invalid request: {where}: {first.get('msg', e)}", param=where or None) from None
        if (req.n or 1) != 1:
            raise HttpError(400, f"n={req.n} is not supported: only n=1", param="n")
        messages, urls = self._messages(req.messages)
        if len(urls) > self.settings.max_images_per_request:
            raise HttpError(400, f"{len(urls)} images in one request; the limit is "
                                 f"{self.settings.max_images_per_request}")
        return req, messages, urls

    def _generation_request(self, req: Any, messages: list[dict[str, Any]], images: list[bytes],
                            slot: Any) -> GenerationRequest:
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is not None and max_tokens > self.settings.max_model_len:
            raise HttpError(400, f"max_tokens {max_tokens} exceeds the model's context length "
                                 f"{self.settings.max_model_len}", param="max_tokens")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        d = self.defaults
        sampling = SamplingSpec(
            max_tokens=max_tokens,
            temperature=req.temperature if req.temperature is not None else d.get("temperature", 1.0),
            top_p=req.top_p if req.top_p is not None else d.get("top_p", 1.0),
            top_k=req.top_k if req.top_k is not None else d.get("top_k", 0),
            seed=req.seed,
            ignore_eos=bool(getattr(req, "ignore_eos", False)),
            stop=tuple(stop),
        )
        return GenerationRequest(messages=messages, images=images, sampling=sampling,
                                 request_id=f"chatcmpl-{uuid.uuid4().hex}", slot=slot)

    def _messages(self, raw: list[Any]) -> tuple[list[dict[str, Any]], list[str]]:
        """Messages for the chat template (image parts as placeholders) and the image URLs in order."""
        messages: list[dict[str, Any]] = []
        urls: list[str] = []
        for m, msg in enumerate(raw):
            role = msg.get("role")
            if role not in ROLES:
                raise HttpError(400, f"messages[{m}]: role {role!r} is not one of {', '.join(ROLES)}",
                                param=f"messages.{m}.role")
            content = msg.get("content")
            if content is None:
                content = []
            elif isinstance(content, str):
                content = [{"type": "text", "text": content}]
            parts: list[dict[str, Any]] = []
            for p, part in enumerate(content):
                kind = part.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                elif kind == "image_url":
                    image_url = part.get("image_url") or {}
                    url = image_url.get("url") if isinstance(image_url, dict) else image_url
                    if not isinstance(url, str) or not url:
                        raise HttpError(400, f"image {len(urls)}: image_url has no url",
                                        param=f"messages.{m}.content.{p}")
                    urls.append(url)
                    parts.append({"type": "image"})
                else:
                    raise HttpError(400, f"messages[{m}].content[{p}]: part type {kind!r} is not supported "
                                         "(text, image_url)", param=f"messages.{m}.content.{p}")
            messages.append({"role": role, "content": parts})
        return messages, urls

    async def complete(self, req: Any, gen: GenerationRequest) -> dict[str, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            ChatMessage,
        )

        text, last = [], None
        async for step in self.service.generate(gen):
            text.append(step.text)
            last = step
        assert last is not None and last.usage is not None
        resp = ChatCompletionResponse(
            id=gen.request_id, model=self.model_name, usage=_usage(last),
            choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="".join(text)),
                                                  finish_reason=last.finish_reason or "stop")],
        )
        return resp.model_dump(exclude_none=True)

    async def stream(self, req: Any, gen: GenerationRequest, steps: AsyncIterator[Step],
                     first: Step) -> AsyncIterator[str]:
        """Server-sent events; `first` is the first step, already taken (so errors before it are a status)."""
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
        )

        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: DeltaMessage, finish_reason: str | None = None, usage: Any = None,
                  choices: bool = True) -> str:
            body = ChatCompletionStreamResponse(
                id=gen.request_id, created=created, model=self.model_name, usage=usage,
                choices=[ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish_reason)]
                if choices else [],
            )
            return f"data: {body.model_dump_json(exclude_none=True)}\n\n"

        yield chunk(DeltaMessage(role="assistant", content=""))
        step: Step | None = first
        try:
            while step is not None:
                if step.text or step.finished:
                    yield chunk(DeltaMessage(content=step.text),
                                finish_reason=(step.finish_reason or "stop") if step.finished else None)
                if step.finished:
                    if include_usage:
                        yield chunk(DeltaMessage(), usage=_usage(step), choices=False)
                    break
                step = await anext(steps, None)
        except Exception as e:  # after the status line: report in the stream, as vLLM does
            yield f"data: {json.dumps(error_body(_error_for(e)))}\n\n"
        finally:
            await steps.aclose()  # a client that went away cancels its generation now
        yield "data: [DONE]\n\n"


def _usage(step: Step) -> Any:
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    u = step.usage
    assert u is not None
    return UsageInfo(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                     total_tokens=u.prompt_tokens + u.completion_tokens)


def build_app(settings: LLMSettings, service: GenerationService, serving_state: Any, api_keys: Any = None) -> Any:
    """The FastAPI app; `serving_state()` is True while the node serves (health). With `api_keys`
    (encdis.auth.ApiKeys) every path but /health needs `Authorization: Bearer KEY` (else 401)."""
    front = ChatFront(settings, service)
    app = FastAPI(title="encdis", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.media = front.media  # HttpFront.stop closes its session
    if api_keys is not None:
        from encdis.auth import HttpApiKeyMiddleware

        app.add_middleware(HttpApiKeyMiddleware, keys=api_keys, open_paths={"/health"},
                           error_body=lambda why: error_body(HttpError(401, why, "AuthenticationError")))

    def error_response(err: HttpError) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER_SECONDS} if err.status in (429, 503) else None
        return JSONResponse(error_body(err), status_code=err.status, headers=headers)

    @app.get("/health")
    async def health() -> Any:
        ok, why = serving_state()
        return JSONResponse({"status": "ok"} if ok else {"status": why}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> Any:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        card = ModelCard(id=front.model_name, root=settings.model, max_model_len=settings.max_model_len,
                         owned_by="encdis")
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        slot = None
        streaming = False
        try:
            if service.draining:
                raise Unavailable("the LLM node is draining; send the request to another node")
            slot = service.admission.take()  # before the body is read: a full node reads nothing
            req, gen = await front.parse(await front.read_body(request), slot)
            # The caller's W3C trace context: the request's span joins its trace.
            gen = dataclasses.replace(gen, trace_context={k: request.headers[k] for k in TRACE_KEYS
                                                          if k in request.headers})
            if not req.stream:
                return JSONResponse(await front.complete(req, gen))
            steps = aiter(service.generate(gen))
            # Take the first step before answering, so a bad image or a busy node is a status code.
            first = await anext(steps)
            streaming = True  # the stream's end releases the slot (the generation's own end)
            return StreamingResponse(front.stream(req, gen, steps, first), media_type="text/event-stream")
        except Exception as e:
            return error_response(_error_for(e))
        finally:
            if slot is not None and not streaming:
                slot.release()

    return app


class HttpFront:
    """uvicorn serving the app as a task of the running loop; the node's drain owns the signals."""

    def __init__(self, app: Any, host: str, port: int, tls: Any = None) -> None:
        """`tls`: an encdis.tls.ServerTLS for HTTPS (its certificate follows the files), None for HTTP."""
        import uvicorn

        from encdis.tls import uvicorn_options

        ssl_options = uvicorn_options(tls) if tls is not None else {}
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                                **ssl_options)
        self.server = uvicorn.Server(config)
        # uvicorn would take SIGTERM/SIGINT for itself; the node's drain handles them.
        self.server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        self.host = host
        self.port = port
        self.media = getattr(getattr(app, "state", None), "media", None)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Serve; the bound port once listening."""
        self._task = asyncio.create_task(self.server.serve(), name="encdis-http")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError(f"could not serve HTTP on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await self._task
        if self.media is not None:
            await self.media.close()
