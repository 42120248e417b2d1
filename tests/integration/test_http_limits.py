"""The HTTP door's limits before work, on the real door (uvicorn, the node's app, its
GenerationService and Admission) over a raw socket, so the test sees what the node answers
while a body is still unsent. Every refusal here comes before the engine, so the service has
none (named: NO_ENGINE) and no vLLM engine starts."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.needs import require_module

require_module("fastapi")
require_module("uvicorn")

from encdis.llm_node.coordinator import Coordinator  # noqa: E402
from encdis.llm_node.generation import GenerationService  # noqa: E402
from encdis.llm_node.http_front import HttpFront, build_app  # noqa: E402
from encdis.llm_node.metrics import LLMNodeMetrics  # noqa: E402
from encdis.llm_node.prompt import PromptRenderer  # noqa: E402
from encdis.llm_node.settings import LLMSettings  # noqa: E402

MAX_IMAGE_BYTES = 64 * 1024
MAX_IMAGES = 4
MAX_CONCURRENT_REQUESTS = 2
NO_ENGINE = None  # nothing here reaches the engine
# Only a guard against hanging when a door waits for a body that never ends (the failure these
# tests catch); never a timing claim.
HANG_GUARD_SECONDS = 120


def engineless_door(tiny_ckpt: Path, **limits) -> tuple[HttpFront, GenerationService, Any]:
    """The real door and service with `limits` (LLMSettings fields), no engine behind them."""
    settings = LLMSettings(model=str(tiny_ckpt), **limits)
    settings = dataclasses.replace(settings, coordinator=dataclasses.replace(settings.coordinator,
                                                                             encoder_datatype="FP32"))
    registry = CollectorRegistry()
    coordinator = Coordinator.from_checkpoint(settings.coordinator, registry, tiny_ckpt)
    service = GenerationService(settings, NO_ENGINE, coordinator, PromptRenderer(tiny_ckpt), LLMNodeMetrics(registry))
    app = build_app(settings, service, lambda: (True, "ok"))
    return HttpFront(app, "127.0.0.1", 0), service, app


@pytest.fixture(scope="module")
async def door(tiny_ckpt: Path):
    front, service, _ = engineless_door(tiny_ckpt, max_image_bytes=MAX_IMAGE_BYTES, max_images_per_request=MAX_IMAGES,
                                        max_concurrent_requests=MAX_CONCURRENT_REQUESTS)
    port = await front.start()
    max_body = MAX_IMAGES * MAX_IMAGE_BYTES * 4 // 3 + (1 << 20)  # as the door computes it
    yield port, service, max_body
    await front.stop()


async def open_post(port: int, headers: dict[str, str]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{k}: {v}\r\n" for k, v in {"host": "127.0.0.1", "content-type": "application/json",
                                                  **headers}.items())
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode())
    await writer.drain()
    return reader, writer


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, dict[str, str]]:
    status_line = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), json.loads(body), headers


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict, dict[str, str]]:
    return await asyncio.wait_for(read_response(reader), HANG_GUARD_SECONDS)


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(door) -> None:
    port, service, max_body = door
    reader, writer = await open_post(port, {"content-length": str(max_body + 1)})
    try:
        status, body, _ = await answer(reader)  # not a byte of the body sent
    finally:
        writer.close()
    assert status == 413 and body["error"]["type"] == "PayloadTooLargeError"
    assert f"{max_body + 1} bytes exceeds the limit {max_body}" in body["error"]["message"]
    assert service.admission.requests == 0  # its slot came back


async def test_a_chunked_body_is_413_as_soon_as_it_passes_the_limit(door) -> None:
    port, service, max_body = door
    reader, writer = await open_post(port, {"transfer-encoding": "chunked"})
    try:
        sent, piece = 0, b" " * (1 << 16)
        while sent <= max_body:  # never the terminating chunk: the body has no end
            writer.write(chunk(piece))
            await writer.drain()
            sent += len(piece)
        status, body, _ = await answer(reader)
    finally:
        writer.close()
    assert status == 413 and body["error"]["type"] == "PayloadTooLargeError"
    assert f"exceeds the limit {max_body}" in body["error"]["message"]
    assert service.admission.requests == 0


async def test_a_full_node_answers_429_without_reading_the_body(door) -> None:
    port, service, _ = door
    held = [service.admission.take() for _ in range(MAX_CONCURRENT_REQUESTS)]  # requests in flight
    try:
        reader, writer = await open_post(port, {"transfer-encoding": "chunked"})
        writer.write(chunk(b'{"model": "x", "messages": ['))  # and never the rest
        await writer.drain()
        try:
            status, body, headers = await answer(reader)  # while the body is unfinished
        finally:
            writer.close()
    finally:
        for slot in held:
            slot.release()
    assert status == 429 and "requests in flight" in body["error"]["message"]
    assert headers["retry-after"] == "1"
    assert service.admission.requests == 0


async def test_a_refused_body_gives_back_its_slot(door) -> None:
    """A body that is read but refused (bad JSON) releases its slot: the node is not left full."""
    port, service, _ = door
    for _ in range(MAX_CONCURRENT_REQUESTS + 1):
        payload = b'{"model": "x", "messages": ['
        reader, writer = await open_post(port, {"content-length": str(len(payload))})
        writer.write(payload)
        await writer.drain()
        try:
            status, body, _ = await answer(reader)
        finally:
            writer.close()
        assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert service.admission.requests == 0
