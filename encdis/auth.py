"""API keys on the nodes' front doors: `authorization: Bearer KEY` on gRPC and HTTP.

- ApiKeys: the accepted keys, from --api-key-file (one key per line, `#` comments; re-read
  when the file changes, so keys rotate without a restart: list old and new, then drop the
  old) or from the ENCDIS_API_KEY variable (one key, never on a command line; taken out of
  the environment once read, so the engine's and reaper's children never inherit it). The
  file's change check (a stat) runs at most once a second, not on every request, and a read
  during which the file changed is retried, so a half-written file is never taken as the
  key list. `problem()` says what is wrong with an authorization value, without echoing
  it. Keys are compared as SHA-256 digests with hmac.compare_digest, against every key, so
  neither a key's bytes nor its length shows in the timing.
- ApiKeyInterceptor: a grpc.aio server interceptor refusing encdis's own methods
  (`/encdis.*`) without a valid key: UNAUTHENTICATED, decided from the metadata alone, so
  a refused call's request message is never read or parsed. Health (grpc.health.v1) and
  reflection stay open: load balancers and probes carry no key.
- HttpApiKeyMiddleware: the same check as plain ASGI middleware for the HTTP front door,
  answering 401 with the body the front door gives (OpenAI's error object); open paths
  (/health) pass.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Callable, Collection, MutableMapping
from pathlib import Path
from typing import Any

import grpc

from encdis.client.channels import check_api_key

log = logging.getLogger(__name__)

API_KEY_ENV = "ENCDIS_API_KEY"
PROTECTED_PREFIX = "/encdis."
# How often the key file's stat is checked for a change: requests between two checks use the
# keys as they are (a rotation lists old and new keys, so a second's lag refuses no one).
CHECK_INTERVAL_SECONDS = 1.0
READ_ATTEMPTS = 3


def take_secret(variable: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """The value of `variable` in `environ` (default os.environ), removed from it: processes
    started later (vLLM's engine core, the reaper) do not inherit it. None when unset or empty."""
    env = os.environ if environ is None else environ
    return env.pop(variable, None) or None


def _stamp(stat: os.stat_result) -> tuple[int, int, int]:
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The keys a node accepts; a file's keys follow the file."""

    def __init__(self, keys: Collection[str] = (), path: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._stamp: tuple | None = None
        self._checked_at = clock()
        self._digests: list[bytes] = [_digest(k) for k in keys]
        if path is not None:
            self._digests = self._read()  # a bad file at startup is an error naming it
        if not self._digests:
            raise ValueError("no API key given")

    @classmethod
    def configured(cls, key_file: Path | None, environ: MutableMapping[str, str] | None = None,
                   variable: str = API_KEY_ENV, flag: str = "--api-key-file") -> ApiKeys | None:
        """The keys from `key_file` or the `variable` in `environ` (taken out of it); None when
        neither is set (no check)."""
        inline = take_secret(variable, environ)
        if key_file is not None and inline is not None:
            raise ValueError(f"set {flag} or {variable}, not both")
        if key_file is not None:
            return cls(path=Path(key_file))
        if inline is not None:
            try:
                check_api_key(inline.strip())
            except ValueError as e:
                raise ValueError(f"{variable}: {e}") from None
            return cls([inline.strip()])
        return None

    def _read_whole(self) -> tuple[str, tuple[int, int, int]]:
        """The file's text and stamp, from a read during which its stat did not change (as TLS reload)."""
        assert self.path is not None
        try:
            for _ in range(READ_ATTEMPTS):
                before = _stamp(os.stat(self.path))
                text = self.path.read_text(encoding="utf-8")
                if _stamp(os.stat(self.path)) == before:
                    return text, before
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read API key file {self.path}: {e}") from None
        raise ValueError(f"API key file {self.path} kept changing while being read")

    def _read(self) -> list[bytes]:
        text, stamp = self._read_whole()
        keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        for k in keys:
            try:
                check_api_key(k)
            except ValueError as e:
                raise ValueError(f"API key file {self.path}: {e}") from None
        if not keys:
            raise ValueError(f"API key file {self.path} holds no key")
        self._stamp = stamp
        return [_digest(k) for k in keys]

    def _refresh(self) -> None:
        if self.path is None:
            return
        now = self._clock()
        if now - self._checked_at < CHECK_INTERVAL_SECONDS:
            return
        self._checked_at = now
        try:
            st = os.stat(self.path)
        except OSError:
            return  # mid-rotation: keep the keys we have
        if _stamp(st) == self._stamp:
            return
        try:
            self._digests = self._read()
            log.info("API keys reloaded from %s (%d keys)", self.path, len(self._digests))
        except ValueError as e:
            log.warning("API key file changed but cannot be used; keeping the current keys: %s", e)
            self._stamp = _stamp(st)

    def problem(self, authorization: str | None) -> str | None:
        """None if `authorization` ("Bearer KEY") carries an accepted key, else why not."""
        if not authorization:
            return "missing API key: send the header 'authorization: Bearer <key>'"
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "the authorization header must be 'Bearer <key>'"
        self._refresh()
        presented = _digest(key.strip())
        matched = False
        for d in self._digests:  # no early exit: the time does not say which key matched
            matched |= hmac.compare_digest(presented, d)
        return None if matched else "invalid API key"


def _authorization(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def _never_parsed(data: bytes) -> None:
    raise AssertionError("a refused call's request is never parsed")  # the refusal reads no message


def _refusal(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    """A handler answering UNAUTHENTICATED at once. It takes the request as a stream it never
    reads (the client cannot tell: the wire is the same), so the body is neither received
    against the message limit nor deserialised."""

    async def refuse(request_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return make(refuse, request_deserializer=_never_parsed, response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses `/encdis.*` calls without an accepted key (UNAUTHENTICATED); other services pass."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(PROTECTED_PREFIX):
            return handler
        problem = self.keys.problem(_authorization(handler_call_details.invocation_metadata))
        if problem is None:
            return handler
        log.info("%s refused: %s", method, problem)
        return _refusal(handler, problem)


def interceptors(keys: ApiKeys | None) -> list[grpc.aio.ServerInterceptor]:
    """The key check for a server's interceptor list: none without keys."""
    return [ApiKeyInterceptor(keys)] if keys is not None else []


class HttpApiKeyMiddleware:
    """ASGI middleware: 401 with `error_body(reason)` for requests without an accepted key."""

    def __init__(self, app: Any, *, keys: ApiKeys, open_paths: Collection[str],
                 error_body: Callable[[str], dict[str, Any]]) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)
        self.error_body = error_body

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        problem = self.keys.problem(header)
        if problem is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps(self.error_body(problem)).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="encdis"')]})
        await send({"type": "http.response.body", "body": body})
