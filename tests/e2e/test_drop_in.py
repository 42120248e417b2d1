"""encdis as a drop-in for `vllm serve`: the same raw requests to both, the same answers.

A copy of the tiny checkpoint whose generation_config.json carries Instruct-style sampling
defaults (Qwen2.5 Instruct's repetition_penalty 1.05, temperature 0.1, top_p 0.001, top_k 1), so
a request with no sampling fields is answered with them by both. A real monolithic `vllm serve`
(tower loaded) and a real encdis LLM node (tower not loaded, images from the session's encoder
nodes) get the very same request JSON; their answers must be equal, field by field, but for what
differs by design on every call (ids, timestamps). Logprobs of requests with images are compared
to 1e-4: the encoders' float32 embeddings and vLLM's own tower round differently in the last bits.
"""

from __future__ import annotations

import base64
import json
import math
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from encdis.launcher import NodeProcess, start_node
from tests import encoder_images as images
from tests.vllm_serve import reference_key, vllm_serve

pytestmark = pytest.mark.vllm

INSTRUCT_DEFAULTS = {"repetition_penalty": 1.05, "temperature": 0.1, "top_p": 0.001, "top_k": 1}
MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
TEXT = [{"role": "user", "content": "Tell me a story about a cat and a dog."}]
BIASED = 42  # a token id the bias cases force
# Two tokens pushed far above all others, so greedy picks between them by the model's small
# differences; a penalty on what was already generated tips that choice, so the penalty visibly
# changes the answer.
TWO_BIASED = {"logit_bias": {"42": 100, "43": 100}}
# `vllm serve`'s flags the cases need, given to both servers: a named tool choice needs a tool parser.
SURFACE_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def image_part(data: bytes, mime: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def with_image() -> list[dict]:
    return [{"role": "user", "content": [image_part(images.rgba_png(), "image/png"),
                                         {"type": "text", "text": "Describe the picture."}]}]


def multi_turn_with_image() -> list[dict]:
    return [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(images.rgb_jpeg(), "image/jpeg")]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "What colour was it?"},
    ]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def chat(messages: list[dict] | None = None, **fields: Any) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": messages or TEXT, "max_tokens": MAX_TOKENS, **fields}


# The checkpoint's defaults keep one candidate token (top_k 1, top_p 0.001): sampled cases lift them.
UNRESTRICTED = {"top_k": -1, "top_p": 1.0}


def cases() -> dict[str, tuple[str, dict]]:
    """name -> (path, body without "model"): the raw requests both servers get."""
    bias = {"logit_bias": {str(BIASED): 100}}
    return {
        "no_sampling_fields": chat(),
        "greedy": chat(temperature=0),
        "logprobs": chat(temperature=0, logprobs=True, top_logprobs=3),
        "two_biased": chat(temperature=0, repetition_penalty=1.0, **TWO_BIASED),
        "presence_penalty": chat(temperature=0, presence_penalty=2.0, repetition_penalty=1.0, **TWO_BIASED),
        "frequency_penalty": chat(temperature=0, frequency_penalty=2.0, repetition_penalty=1.0, **TWO_BIASED),
        "repetition_penalty": chat(temperature=0, repetition_penalty=1.5, **TWO_BIASED),
        "min_p": chat(temperature=1.0, seed=3, min_p=0.3, **UNRESTRICTED),
        "logit_bias": chat(temperature=0, **bias),
        "stop_token_ids": chat(temperature=0, stop_token_ids=[BIASED], **bias),
        "min_tokens": chat(temperature=0, stop_token_ids=[BIASED], min_tokens=6, **bias),
        "json_object": chat(temperature=0, response_format={"type": "json_object"}),
        "json_schema": chat(temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA}}),
        "n2_seeded": chat(temperature=1.0, n=2, seed=11, **UNRESTRICTED),
        "seeded": chat(temperature=0.9, seed=5, **UNRESTRICTED),
        "named_tool": chat(temperature=0, tools=[WEATHER_TOOL],
                           tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "image": chat(with_image(), temperature=0, logprobs=True, top_logprobs=2),
        "multi_turn_image": chat(multi_turn_with_image(), temperature=0),
        "stream_logprobs": chat(temperature=0, logprobs=True, top_logprobs=3, stream=True,
                                stream_options={"include_usage": True}),
        "stream_image": chat(with_image(), temperature=0, logprobs=True, top_logprobs=2, stream=True),
        "completions": ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
                                            "temperature": 0, "logprobs": 2}),
        "tokenize_chat": ("/tokenize", {"messages": with_image()}),
        "tokenize_prompt": ("/tokenize", {"prompt": "Once upon a time"}),
        "detokenize": ("/detokenize", {"tokens": [10, 20, 30, 40]}),
        "error_top_logprobs_without_logprobs": chat(top_logprobs=2),
        "error_unknown_model": chat(model="no-such-model"),
    }


def gathered(events: list[dict]) -> dict:
    """A stream's chunks gathered: per choice its role, text, logprobs and finish reason; the usage.
    (How tokens are split into chunks depends on timing, in `vllm serve` too: not compared.)"""
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    choices: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            g = choices.setdefault(c["index"], {"role": None, "content": "", "logprobs": [], "finish_reason": None})
            g["role"] = g["role"] or c["delta"].get("role")
            g["content"] += c["delta"].get("content") or ""
            g["logprobs"] += (c.get("logprobs") or {}).get("content") or []
            g["finish_reason"] = c.get("finish_reason") or g["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": events[-1].get("usage")}


def send(base: str, model: str, path: str, body: dict) -> dict:
    """The answer's status and JSON (SSE: its events gathered)."""
    body = {"model": model, **body}
    if body.get("stream"):
        with httpx.stream("POST", base + path, json=body, timeout=300) as r:
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            return {"status": r.status_code, "stream": gathered([json.loads(e) for e in events[:-1]])}
    r = httpx.post(base + path, json=body, timeout=300)
    return {"status": r.status_code, "json": r.json()}


# What differs on every call (ids, timestamps), and the model's name: the checkpoint's temporary path,
# which differs between the run that cached the reference and this one (the cache key holds its files).
VARYING = {"id", "created", "system_fingerprint", "model"}


def normalised(value: Any) -> Any:
    """`value` without what differs on every call (VARYING)."""
    if isinstance(value, dict):
        return {k: normalised(v) for k, v in value.items() if k not in VARYING}
    if isinstance(value, list):
        return [normalised(v) for v in value]
    return value


def assert_same(ours: Any, theirs: Any, where: str, tolerance: float) -> None:
    if isinstance(theirs, float) and isinstance(ours, float):
        assert math.isclose(ours, theirs, rel_tol=tolerance, abs_tol=tolerance), (where, ours, theirs)
    elif isinstance(theirs, dict) and isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), (where, sorted(ours.keys() ^ theirs.keys()))
        for k in theirs:
            assert_same(ours[k], theirs[k], f"{where}.{k}", tolerance)
    elif isinstance(theirs, list) and isinstance(ours, list):
        assert len(ours) == len(theirs), (where, len(ours), len(theirs))
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]", tolerance)
    else:
        assert ours == theirs, (where, ours, theirs)


@pytest.fixture(scope="module")
def instruct_ckpt(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session checkpoint (same weights: the session's encoders serve it) with Instruct-style defaults."""
    ckpt = tmp_path_factory.mktemp("instruct") / "tiny-instruct"
    shutil.copytree(tiny_ckpt, ckpt)
    config = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**config, **INSTRUCT_DEFAULTS}, indent=2))
    return ckpt


@pytest.fixture(scope="module")
def vllm_serve_answers(request: pytest.FixtureRequest, instruct_ckpt: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    requests = cases()
    cache = request.config.cache
    key = f"encdis/vllm-serve-drop-in/{reference_key(instruct_ckpt, SURFACE_ARGS, requests)}"
    cached = cache.get(key, None)
    if cached is not None:
        return cached
    with vllm_serve(instruct_ckpt, tmp_path_factory.mktemp("vllm-serve") / "serve.log", *SURFACE_ARGS) as base:
        answers = {name: send(base, str(instruct_ckpt), path, body) for name, (path, body) in requests.items()}
    cache.set(key, answers)
    return answers


@pytest.fixture(scope="module")
def instruct_node(instruct_ckpt: Path, encoder_nodes: list[NodeProcess]) -> NodeProcess:
    node = start_node(["llm", "--model", str(instruct_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0", "--http-port", "0", *SURFACE_ARGS,
                       "--encoders", ",".join(n.address for n in encoder_nodes)], timeout=900)
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def answers(instruct_node: NodeProcess, instruct_ckpt: Path) -> dict[str, dict]:
    base = f"http://127.0.0.1:{instruct_node.info['http_port']}"
    return {name: send(base, str(instruct_ckpt), path, body) for name, (path, body) in cases().items()}


@pytest.mark.parametrize("name", list(cases()))
def test_the_same_request_gets_vllm_serves_answer(name: str, answers, vllm_serve_answers) -> None:
    ours, theirs = answers[name], vllm_serve_answers[name]
    expected_status = 404 if "unknown_model" in name else 400 if name.startswith("error_") else 200
    assert theirs["status"] == expected_status, theirs  # the reference itself answers as the case says
    tolerance = LOGPROB_TOLERANCE if "image" in name else 0.0
    assert_same(normalised(ours), normalised(theirs), name, tolerance)


def test_the_cases_exercise_what_they_name(vllm_serve_answers) -> None:
    """The reference's answers show each field took effect, so equal answers mean honoured fields."""
    def text(name: str, i: int = 0) -> str:
        return vllm_serve_answers[name]["json"]["choices"][i]["message"]["content"]

    # (presence_penalty, bounded to [-2, 2] by vLLM, does not tip this checkpoint's choices: its case
    # is held to equality with `vllm serve` only.)
    for penalty in ("frequency_penalty", "repetition_penalty"):
        assert text(penalty) != text("two_biased"), penalty
    choices = vllm_serve_answers["n2_seeded"]["json"]["choices"]
    assert len(choices) == 2 and choices[0]["message"]["content"] != choices[1]["message"]["content"]
    assert vllm_serve_answers["stop_token_ids"]["json"]["usage"]["completion_tokens"] == 1
    assert vllm_serve_answers["min_tokens"]["json"]["usage"]["completion_tokens"] >= 6
    assert len(vllm_serve_answers["logprobs"]["json"]["choices"][0]["logprobs"]["content"]) == MAX_TOKENS
    # The named tool's call, cut short by max_tokens on this random model: begun in Hermes' format.
    message = vllm_serve_answers["named_tool"]["json"]["choices"][0]["message"]
    assert message.get("tool_calls") or message["content"].startswith("<tool_call>"), message


@pytest.mark.parametrize("streamed, whole", [("stream_logprobs", "logprobs"), ("stream_image", "image")])
def test_streaming_gives_the_non_streaming_answer(streamed: str, whole: str, answers) -> None:
    [got] = answers[streamed]["stream"]["choices"]
    choice = answers[whole]["json"]["choices"][0]
    assert (got["role"], got["content"], got["finish_reason"]) == (
        "assistant", choice["message"]["content"], choice["finish_reason"])
    assert_same(got["logprobs"], choice["logprobs"]["content"], streamed, 0.0)


# The chat cases the gRPC door's full form can express (it has no tools), non-streamed.
GRPC_CASES = [name for name, (path, body) in cases().items()
              if path == "/v1/chat/completions" and not name.startswith("error_")
              and "tools" not in body and not body.get("stream")]


def grpc_messages(messages: list[dict]) -> list[dict]:
    """The same conversation for the SDK: text parts as str, data-URI images as their bytes."""
    def part(p: dict) -> str | bytes:
        if p["type"] == "text":
            return p["text"]
        return base64.b64decode(p["image_url"]["url"].split(",", 1)[1])

    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else [part(p) for p in m["content"]]} for m in messages]


def grpc_sampling(body: dict) -> dict:
    kw = {k: v for k, v in body.items() if k not in ("messages", "response_format")}
    response_format = body.get("response_format")
    if response_format and response_format["type"] == "json_object":
        kw["json_object"] = True
    elif response_format:
        kw["json_schema"] = response_format["json_schema"]["schema"]
    return kw


@pytest.fixture(scope="module")
def grpc_answers(instruct_node: NodeProcess) -> dict:
    from encdis.client import GenerateClient

    with GenerateClient(instruct_node.address, timeout=300) as client:
        return {name: client.chat(grpc_messages(body["messages"]), **grpc_sampling(body))
                for name, (_, body) in cases().items() if name in GRPC_CASES}


@pytest.mark.parametrize("name", GRPC_CASES)
def test_the_grpc_sdk_gets_the_http_doors_answer(name: str, grpc_answers, answers) -> None:
    ours, http = grpc_answers[name], answers[name]["json"]
    assert len(ours.choices) == len(http["choices"])
    for got, want in zip(ours.choices, http["choices"], strict=True):
        assert (got.text, got.finish_reason) == (want["message"]["content"], want["finish_reason"])
        if want.get("logprobs"):
            assert [(t.token, t.logprob, [(tok, lp) for _, tok, lp in t.top]) for t in got.logprobs] == [
                (c["token"], c["logprob"], [(x["token"], x["logprob"]) for x in c["top_logprobs"]])
                for c in want["logprobs"]["content"]]
    assert (ours.usage.prompt_tokens, ours.usage.completion_tokens) == (
        http["usage"]["prompt_tokens"], http["usage"]["completion_tokens"])


def test_the_grpc_door_refuses_what_vllm_refuses(instruct_node: NodeProcess) -> None:
    from encdis.client import GenerateClient, InvalidArgument

    with GenerateClient(instruct_node.address, timeout=60) as client:
        with pytest.raises(InvalidArgument, match="top_logprobs"):
            client.chat(TEXT, top_logprobs=2)
        with pytest.raises(InvalidArgument, match=r"messages\[0\]\.role"):
            client.chat([{"role": "robot", "content": "hi"}])
