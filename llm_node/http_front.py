"""The OpenAI-compatible HTTP front door: encdis's checks in front of vLLM's own OpenAI serving layer.

Behind the door is vLLM's serving layer on the node's engine (openai_layer.py): /v1/chat/completions,
/v1/completions, /v1/models, /tokenize, /detokenize, /version answer as `vllm serve` answers them.
The door does what only encdis does, in this order, each before the work it bounds:

- API keys (401; /health stays open), drain (503) and an admission slot (429 with Retry-After),
  all before the body is read;
- the body: one request's limit (413 as soon as a body passes it, declared or chunked) and one
  budget for all bodies being read at once (429 before reading a body that does not fit); parsed
  in a worker thread and held once (the buffer it was read into);
- the fields vLLM's models have that the node cannot honour are refused by name (request_fields.py);
- media: each image part is loaded (data: URIs; URLs from --allowed-media-domains), its grid read
  from its header, its bytes reserved by admission, encoded by the pool, held in the shared region
  for the request, and replaced by an `image_embeds` part of grid and digest (media_parts.py);
  /tokenize needs only the grids, so its images are never encoded.

Then vLLM's handler gets the rewritten request, with the door's span as its trace parent; the
node's metrics count every answered request by its status and, through timed_engine.py, time it.
Errors before vLLM are OpenAI's error object: 400 naming what was wrong, 401, 413, 429, 503, 500
with a fixed message (details in the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from encdis.client.errors import EncdisError, InvalidArgument, ResourceExhausted, Unavailable
from encdis.llm_node.admission import Slot
from encdis.llm_node.generation import GenerationService
from encdis.llm_node.media import MediaLoader, decode_data_uri
from encdis.llm_node.media_parts import ImagePart, image_parts
from encdis.llm_node.request_fields import refuse_unsupported
from encdis.llm_node.settings import LLMSettings
from encdis.llm_node.timed_engine import CURRENT, DoorRequest
from encdis.tracing import TRACE_KEYS, context_from_metadata, trace_metadata

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal error (details are in the node's log)"
RETRY_AFTER_SECONDS = "1"
# Requests whose bodies the door reads: what they may carry is checked before vLLM sees them.
CHAT_PATHS = frozenset({"/v1/chat/completions", "/tokenize"})
BODY_PATHS = CHAT_PATHS | {"/v1/completions", "/detokenize"}
# Bodies up to this size are parsed and written back on the loop (less than a thread hop costs).
INLINE_BODY_BYTES = 64 * 1024
# A body's bytes are held at most twice while it is parsed (its text, then the objects made of it).
PARSE_PEAK = 2
CLIENT_CLOSED = 499  # the client went away before its answer began (nginx's number for it)
STATUS_CODES = {CLIENT_CLOSED: "CANCELLED", 200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED",
                404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error_for(e: Exception) -> HttpError:
    if isinstance(e, HttpError):
        return e
    if isinstance(e, InvalidArgument):
        return HttpError(400, e.message, param=e.violations[0].field if e.violations else None)
    if isinstance(e, ResourceExhausted):
        return HttpError(429, e.message, "RateLimitError")
    if isinstance(e, Unavailable):
        return HttpError(503, e.message, "ServiceUnavailableError")
    if isinstance(e, EncdisError) and e.code.name == "UNAUTHENTICATED":
        return HttpError(401, e.message, "AuthenticationError")
    log.exception("request failed before vLLM's handler")
    return HttpError(500, INTERNAL_MESSAGE, "InternalServerError")


def error_body(err: HttpError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.status}}


async def _send_json(send: Callable, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


class BodyBudget:
    """Bytes of request bodies being read at once, all requests together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class Door:
    """The ASGI app: encdis's checks and media, then `inner` (vLLM's serving app)."""

    def __init__(self, settings: LLMSettings, service: GenerationService, serving_state: Callable[[], Any],
                 inner: Any) -> None:
        self.settings = settings
        self.service = service
        self.serving_state = serving_state
        self.inner = inner
        self.max_body = settings.http_body_bytes
        self.budget = BodyBudget(settings.http_body_budget)
        self.media = MediaLoader(allowed_domains=settings.allowed_media_domains, max_bytes=settings.max_image_bytes,
                                 timeout_seconds=settings.media_timeout_seconds)

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return  # no lifespan: the node starts and stops what the app uses
        if scope["path"] == "/health":
            ok, why = self.serving_state()
            await _send_json(send, 200 if ok else 503, {"status": "ok"} if ok else {"status": why})
            return
        if scope["method"] == "POST" and scope["path"] in BODY_PATHS:
            await self._post(scope, receive, send)
            return
        if self.inner is None:
            await _send_json(send, 404, error_body(HttpError(404, f"{scope['path']} not found", "NotFoundError")))
            return
        await self.inner(scope, receive, send)

    async def _post(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        status = [500]

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        from opentelemetry.trace import SpanKind

        service = self.service
        span = service.tracing.tracer.start_span(
            "encdis.generate", kind=SpanKind.SERVER, context=context_from_metadata(
                {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                 if k.decode("latin-1") in TRACE_KEYS}))
        door = DoorRequest()
        with service.tracked():
            slot: Slot | None = None
            try:
                if service.draining:
                    raise Unavailable("the LLM node is draining; send the request to another node")
                slot = service.admission.take()  # before the body is read: a full node reads nothing
                body = await self._prepare(scope, receive, slot, span, door)
                headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"traceparent",
                                                                               b"tracestate")]
                headers.append((b"content-length", str(len(body)).encode()))
                if service.tracing.enabled:  # vLLM's request span joins the door's
                    from opentelemetry import trace

                    headers += [(k.encode(), v.encode()) for k, v in
                                trace_metadata(trace.set_span_in_context(span))]
                token = CURRENT.set(door)
                try:
                    await self.inner({**scope, "headers": headers}, _replay(body, receive), send_status)
                finally:
                    CURRENT.reset(token)
            except asyncio.CancelledError:
                status[0] = CLIENT_CLOSED
                raise
            except Exception as e:
                err = _error_for(e)
                status[0] = err.status
                retry = {"Retry-After": RETRY_AFTER_SECONDS} if err.status in (429, 503) else None
                await _send_json(send, err.status, error_body(err), retry)
            finally:
                if door.held:
                    service.engine.handoff.done(door.held)
                if slot is not None:
                    slot.release()
                code = STATUS_CODES.get(status[0], "INTERNAL")
                service.metrics.requests.labels(code).inc()
                span.set_attribute("http.response.status_code", status[0])
                span.end()

    async def _prepare(self, scope: dict[str, Any], receive: Callable, slot: Slot, span: Any,
                       door: DoorRequest) -> bytes:
        """The body vLLM gets: media parts as embeddings, held for the request (door.held)."""
        raw, reserved = await self._read_body(scope, receive)
        size = len(raw)
        try:
            # One worker-thread trip (none for a small body) parses, checks, decodes the data: URIs
            # and reads the images' grids from their headers.
            if size <= INLINE_BODY_BYTES:
                body, parts, images, probe = self._parse_and_probe(raw, scope["path"])
            else:
                body, parts, images, probe = await asyncio.to_thread(self._parse_and_probe, raw, scope["path"])
        finally:
            self.budget.give(reserved)
        if parts:
            if images is None:  # URLs to fetch
                images = await self.media.load_all([p.url for p in parts])
            # Counting tokens needs the grids only: /tokenize's images are never encoded.
            await self.service.embed_parts(body["messages"], parts, images, slot, door, span=span, probe=probe,
                                           encode=scope["path"] != "/tokenize")
            del images
        left = size - sum(len(p.url) for p in parts)  # what is left of the body without its images
        return _dumps(body) if left <= INLINE_BODY_BYTES else await asyncio.to_thread(_dumps, body)

    def _parse_and_probe(self, raw: bytearray, path: str) -> tuple[dict[str, Any], list[ImagePart],
                                                                    list[bytes] | None, Any]:
        """The body, its image parts, and (when every image is a data: URI) their bytes and grids and
        digests (GenerationService.image_grids_and_digests). Blocking."""
        body = _parse(raw)
        refuse_unsupported(body)
        parts = image_parts(body.get("messages")) if path in CHAT_PATHS else []
        if len(parts) > self.settings.max_images_per_request:
            raise InvalidArgument(f"{len(parts)} images in one request; the limit is "
                                  f"{self.settings.max_images_per_request}")
        if not parts or any(p.url[:5].lower() != "data:" for p in parts):
            return body, parts, None, None
        images = [decode_data_uri(i, p.url, self.settings.max_image_bytes) for i, p in enumerate(parts)]
        return body, parts, images, self.service.image_grids_and_digests(images)

    async def _read_body(self, scope: dict[str, Any], receive: Callable) -> tuple[bytearray, int]:
        """The body and the budget it holds (give it back once parsed): refused (413) as soon as it passes
        the limit and (429) when all bodies being read would pass the budget; a declared length is
        checked before a byte is read. A body is counted at its peak while parsed (PARSE_PEAK)."""
        limit = self.max_body
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        declared = int(declared) if declared is not None and declared.isdigit() else None
        if declared is not None and declared > limit:
            raise HttpError(413, f"request body of {declared} bytes exceeds the limit {limit}", "PayloadTooLargeError")
        reserved = 0
        body = bytearray()
        try:
            if declared is not None:
                self._take(declared * PARSE_PEAK)
                reserved = declared * PARSE_PEAK
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise asyncio.CancelledError("the client went away")
                body += message.get("body", b"")
                if len(body) > limit:
                    raise HttpError(413, f"request body exceeds the limit {limit}", "PayloadTooLargeError")
                if len(body) * PARSE_PEAK > reserved:
                    self._take(len(body) * PARSE_PEAK - reserved)
                    reserved = len(body) * PARSE_PEAK
                if not message.get("more_body", False):
                    return body, reserved
        except BaseException:
            self.budget.give(reserved)
            raise

    def _take(self, n: int) -> None:
        if not self.budget.take(n):
            raise ResourceExhausted(f"request bodies being read hold {self.budget.held} bytes of the node's budget "
                                    f"of {self.budget.limit}; this one needs {n} more (retry later)")


def _parse(raw: bytearray) -> dict[str, Any]:
    """The JSON object in `raw`, which it empties: the text is decoded first and the buffer freed, so no
    more than two copies of a body's bytes are held at once (PARSE_PEAK)."""
    try:
        text = raw.decode()
        raw.clear()
        body = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "request body must be a JSON object")
    return body


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _replay(body: bytes, receive: Callable) -> Callable:
    """`receive` for vLLM's handler: the rewritten body, then the client's own messages (disconnects)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def build_app(settings: LLMSettings, service: GenerationService, serving_state: Callable[[], Any],
              api_keys: Any = None, inner: Any = None) -> Any:
    """The door's ASGI app in front of `inner` (vLLM's serving app, openai_layer.build_vllm_app); with
    `api_keys` (encdis.auth.ApiKeys) every path but /health needs `Authorization: Bearer KEY` (else 401)."""
    app: Any = Door(settings, service, serving_state, inner)
    door = app
    if api_keys is not None:
        from encdis.auth import HttpApiKeyMiddleware

        app = HttpApiKeyMiddleware(app, keys=api_keys, open_paths={"/health"},
                                   error_body=lambda why: error_body(HttpError(401, why, "AuthenticationError")))
        app.media = door.media
    return app


class HttpFront:
    """uvicorn serving the app as a task of the running loop; the node's drain owns the signals."""

    def __init__(self, app: Any, host: str, port: int, tls: Any = None) -> None:
        """`tls`: an encdis.tls.ServerTLS for HTTPS (its certificate follows the files), None for HTTP."""
        import uvicorn

        from encdis.tls import uvicorn_options

        ssl_options = uvicorn_options(tls) if tls is not None else {}
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                                lifespan="off", **ssl_options)
        self.server = uvicorn.Server(config)
        # uvicorn would take SIGTERM/SIGINT for itself; the node's drain handles them.
        self.server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        self.host = host
        self.port = port
        self.media = getattr(app, "media", None)
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
