"""The OpenAI-compatible front door against monolithic `vllm serve`, and with real OpenAI clients.

`vllm serve` (python -m vllm.entrypoints.openai.api_server: the CPU wheel's `vllm` command
cannot find its own metadata) runs the same tiny checkpoint with the tower loaded, in
float32 like the LLM node's engine, and gets the very same request JSON. Its answers are
kept in pytest's cache under a key of everything that decides them (library versions,
every checkpoint file's bytes, the requests, the server's arguments), so a change to any
of them runs it again.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from encdis.launcher import NodeProcess
from tests import encoder_images as images
from tests.vllm_serve import reference_key, vllm_serve

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12


def image_part(data: bytes, mime: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def user(*parts: dict | str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}


def cases() -> dict[str, list[dict]]:
    png, jpeg = "image/png", "image/jpeg"
    return {
        "rgba_png": [user(image_part(images.rgba_png(), png), "Describe the picture.")],
        "exif_rotated_jpeg": [user(image_part(images.exif_rotated_jpeg(), jpeg), "Which way is up?")],
        "palette_trns_png": [user(image_part(images.palette_trns_png(), png), "What is in this image?")],
        "la_png": [user(image_part(images.la_png(), png), "Describe it.")],
        "cmyk_jpeg": [user(image_part(images.cmyk_jpeg(), jpeg), "What colours are there?")],
        "three_mixed": [user(image_part(images.rgb_jpeg(), jpeg), "First,", image_part(images.rgba_png(), png),
                             "then", image_part(images.palette_trns_png(), png), "compare them.")],
        "multi_turn": [
            {"role": "system", "content": "You answer in one sentence."},
            user(image_part(images.gray_jpeg(), jpeg), "What is this?"),
            {"role": "assistant", "content": "A grey picture."},
            {"role": "user", "content": "And what else?"},
        ],
        "text_only": [{"role": "user", "content": "Count from one to ten."}],
    }


def body(messages: list[dict], model: str, **extra) -> dict:
    return {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def answers_key(ckpt: Path, requests: dict[str, list[dict]]) -> str:
    return reference_key(ckpt, MAX_TOKENS, requests)


@pytest.fixture(scope="module")
def vllm_serve_answers(request: pytest.FixtureRequest, tiny_ckpt: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each case's text from monolithic `vllm serve` (tower loaded), one request at a time."""
    requests = cases()
    cache = getattr(request.config, "cache", None)
    key = f"encdis/vllm-serve/{answers_key(tiny_ckpt, requests)}"
    cached = cache.get(key, None) if cache is not None else None
    if cached is not None:
        return cached
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    with vllm_serve(tiny_ckpt, log) as base:
        answers = {}
        for name, messages in requests.items():
            r = httpx.post(f"{base}/v1/chat/completions", json=body(messages, str(tiny_ckpt)), timeout=300)
            assert r.status_code == 200, (name, r.text)
            answers[name] = r.json()["choices"][0]["message"]["content"]
    if cache is not None:
        cache.set(key, answers)
    return answers


@pytest.fixture(scope="module")
def http_base(llm_node: NodeProcess) -> str:
    return f"http://127.0.0.1:{llm_node.info['http_port']}"


@pytest.fixture(scope="module")
def model_name(http_base: str) -> str:
    return httpx.get(f"{http_base}/v1/models", timeout=10).json()["data"][0]["id"]


def ours(http_base: str, messages: list[dict], model: str, **extra) -> httpx.Response:
    return httpx.post(f"{http_base}/v1/chat/completions", json=body(messages, model, **extra), timeout=300)


def sse_events(http_base: str, messages: list[dict], model: str, **extra) -> Iterator[str]:
    with httpx.stream("POST", f"{http_base}/v1/chat/completions", timeout=300,
                      json=body(messages, model, stream=True, **extra)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield line[len("data: "):]


@pytest.mark.parametrize("name", list(cases()))
def test_text_equals_vllm_serve(name: str, vllm_serve_answers, http_base, model_name) -> None:
    r = ours(http_base, cases()[name], model_name)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "chat.completion" and got["model"] == model_name and got["id"]
    choice = got["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("length", "stop")
    assert choice["message"]["content"] == vllm_serve_answers[name]
    usage = got["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


@pytest.mark.parametrize("name", ["three_mixed", "multi_turn", "text_only"])
def test_streaming_gives_the_non_streaming_text(name: str, http_base, model_name) -> None:
    messages = cases()[name]
    whole = ours(http_base, messages, model_name).json()
    events = list(sse_events(http_base, messages, model_name, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert finals == [whole["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS


def test_openai_package_sync_async_and_streaming(http_base, model_name) -> None:
    import openai

    messages = cases()["rgba_png"]
    sync = openai.OpenAI(base_url=f"{http_base}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in sync.models.list()] == [model_name]
    whole = sync.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    text = whole.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in sync.chat.completions.create(
        model=model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices)
    assert streamed == text

    async def run_async() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{http_base}/v1", api_key="unused", max_retries=0)
        calls = [client.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0) for _ in range(3)]
        return [r.choices[0].message.content for r in await asyncio.gather(*calls)]

    assert asyncio.run(run_async()) == [text] * 3


TEXT_DATA_URI = "data:text/plain;base64,aGk="
BAD = {
    "malformed_json": (b'{"model": "x", "messages": [', 400, "not valid JSON"),
    "non_image_data_uri": ({"messages": [user({"type": "image_url", "image_url": {"url": TEXT_DATA_URI}}, "hi")]},
                           400, "image 0: data URI of type 'text/plain' is not an image"),
    "unlisted_url_host": ({"messages": [user("a", image_part(images.rgb_jpeg(), "image/jpeg"),
                                             {"type": "image_url", "image_url": {"url": "http://images.example/x.png"}})]},
                          400, "image 1: URL host 'images.example' is not in --allowed-media-domains"),
    "too_many_images": ({"messages": [user(*[image_part(images.smallest(), "image/png")] * 17, "hi")]},
                        400, "17 images in one request; the limit is 16"),
    "media_io_kwargs": ({"messages": [user("hi")], "media_io_kwargs": {"image": {}}}, 400, "media_io_kwargs: "),
    "audio_part": ({"messages": [user({"type": "audio_url", "audio_url": {"url": TEXT_DATA_URI}}, "hi")]}, 400,
                   "messages[0].content[0]: part type 'audio_url' is not supported"),
    "unknown_model": ({"messages": [user("hi")], "model": "not-this-one"}, 404, "not-this-one"),
    "corrupt_image": ({"messages": [user({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()}}, "hi")]},
        400, "image 0: "),
    "prompt_too_long": ({"messages": [user("word " * 20000)]}, 400, "maximum context length is 4096"),
    # With an image, refused by the prompt's bytes before the image is encoded.
    "prompt_too_long_with_image": ({"messages": [user(image_part(images.smallest(), "image/png"), "word " * 20000)]},
                                   400, "tokens with its images; the context length is 4096"),
}
CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND"}


def refused_requests(node: NodeProcess, status: int) -> float:
    try:
        return node.metric(f'encdis_requests_total{{code="{CODES[status]}"}}')
    except AssertionError:  # none yet: the sample is not exported
        return 0.0


@pytest.mark.parametrize("name", list(BAD))
def test_bad_requests_get_the_openai_error_object_and_the_node_keeps_serving(name: str, http_base, model_name,
                                                                             llm_node) -> None:
    payload, status, message = BAD[name]
    url = f"{http_base}/v1/chat/completions"
    counted = refused_requests(llm_node, status)
    if isinstance(payload, bytes):
        r = httpx.post(url, content=payload, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json={"model": model_name, "max_tokens": 4, **payload}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == status and err["type"]
    assert refused_requests(llm_node, status) == counted + 1  # every answered request is counted by its status
    ok = ours(http_base, cases()["text_only"], model_name)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_models_and_health(http_base, model_name, tiny_ckpt) -> None:
    models = httpx.get(f"{http_base}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert model_name == str(tiny_ckpt)  # as vLLM names it: the --model argument
    health = httpx.get(f"{http_base}/health", timeout=10)
    assert health.status_code == 200


def test_vllm_serves_other_routes_and_unknown_ones_get_an_openai_error(http_base, model_name) -> None:
    import vllm

    assert httpx.get(f"{http_base}/version", timeout=10).json() == {"version": vllm.__version__}
    tokens = httpx.post(f"{http_base}/tokenize", json={"model": model_name, "prompt": "hello"}, timeout=30).json()
    text = httpx.post(f"{http_base}/detokenize", json={"model": model_name, "tokens": tokens["tokens"]},
                      timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and text["prompt"] == "hello"
    completion = httpx.post(f"{http_base}/v1/completions", timeout=60, json={
        "model": model_name, "prompt": "Once", "max_tokens": 3, "temperature": 0}).json()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 3
    # Routes of `vllm serve` the door does not serve (they would take media past it): OpenAI's error object.
    for method, path in (("POST", "/v1/responses"), ("POST", "/v1/messages"), ("GET", "/v1/nothing")):
        r = httpx.request(method, f"{http_base}{path}", json={"model": model_name}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, (path, r.text)


def test_vllms_own_metrics_are_on_the_metrics_port(llm_node) -> None:
    text = httpx.get(f"http://127.0.0.1:{llm_node.info['metrics_port']}/metrics", timeout=10).text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert {"vllm:num_requests_running", "vllm:prompt_tokens_total"} <= names, sorted(names)[:20]
    assert any(n.startswith("encdis_") for n in names)
