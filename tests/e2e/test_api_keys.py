"""API keys end to end: real nodes with --api-key-file, real clients (the SDK, httpx, openai).

- An encoder node with a key: Describe and Encode need `authorization: Bearer KEY`
  (UNAUTHENTICATED otherwise); health and reflection answer without one.
- An LLM node (one vLLM engine) with its own keys on both front doors and the encoder's key
  in --encoder-api-key-file: gRPC refuses a missing or wrong key with UNAUTHENTICATED, HTTP
  with 401 and OpenAI's error object; health stays open; the right key gets completions
  whose images went through the keyed encoder; a rewritten key file takes effect within a second.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from encdis.client import EncoderClient, GenerateClient, Unauthenticated
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.demo import synthetic_photo
from tests.needs import require_module

ENCODER_KEY = "encoder-key-0123"
FRONT_KEYS = ("client-key-a", "client-key-b")
ENCODER_SERVICE = "encdis.encoder.v1.EncoderService"
GENERATE_SERVICE = "encdis.llm.v1.GenerateService"


def write_keys(path: Path, keys: tuple[str, ...]) -> None:
    """Replace the key file as a Secret update or a config tool does: a whole new file, renamed over."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text("# accepted keys\n" + "".join(k + "\n" for k in keys))
    tmp.replace(path)


@pytest.fixture(scope="module")
def keyed_encoder(tiny_ckpt: Path, tmp_path_factory) -> Iterator[NodeProcess]:
    key_file = tmp_path_factory.mktemp("encoder-keys") / "keys"
    write_keys(key_file, (ENCODER_KEY,))
    node = start_node(["encoder", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--api-key-file", str(key_file)], timeout=300)
    try:
        yield node
    finally:
        node.stop()


def check_health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_encoder_needs_its_key_but_health_and_reflection_do_not(keyed_encoder) -> None:
    image = synthetic_photo(84, 112, seed=2)
    for key, why in ((None, "missing API key"), ("wrong-key", "invalid API key")):
        with EncoderClient(keyed_encoder.address, timeout=30, api_key=key) as client:
            with pytest.raises(Unauthenticated, match=why):
                client.describe()
            with pytest.raises(Unauthenticated, match=why):
                client.encode([image])
    with EncoderClient(keyed_encoder.address, timeout=60, api_key=ENCODER_KEY) as client:
        assert client.describe().out_hidden_size > 0
        [emb] = client.encode([image])
        assert emb.array().shape[0] > 0

    assert check_health(keyed_encoder.address, ENCODER_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(keyed_encoder.address) as ch:
        replies = list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    assert ENCODER_SERVICE in {s.name for s in replies[0].list_services_response.service}


@pytest.fixture(scope="module")
def keyed_llm(tiny_ckpt: Path, keyed_encoder: NodeProcess, tmp_path_factory) -> Iterator[tuple[NodeProcess, Path]]:
    work = tmp_path_factory.mktemp("llm-keys")
    front_keys, encoder_key = work / "front-keys", work / "encoder-key"
    write_keys(front_keys, FRONT_KEYS)
    encoder_key.write_text(ENCODER_KEY + "\n")
    node = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                       "--encoders", keyed_encoder.address, "--api-key-file", str(front_keys),
                       "--encoder-api-key-file", str(encoder_key)], timeout=900)
    try:
        yield node, front_keys
    finally:
        node.stop()


@pytest.mark.vllm
def test_llm_front_doors_need_a_key_and_health_stays_open(keyed_llm, keyed_encoder, tiny_ckpt) -> None:
    node, key_file = keyed_llm
    image = synthetic_photo(224, 168, seed=4)
    base = f"http://127.0.0.1:{node.info['http_port']}"
    chat = {"model": str(tiny_ckpt), "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Count to three."}]}

    # gRPC: missing and wrong keys are UNAUTHENTICATED, for every method.
    for key, why in ((None, "missing API key"), ("wrong-key", "invalid API key")):
        with GenerateClient(node.address, timeout=60, api_key=key) as client:
            with pytest.raises(Unauthenticated, match=why):
                client.generate("Describe the picture.", [image], max_tokens=4)
            with pytest.raises(Unauthenticated, match=why):
                client.list_encoders()
    # The right key: the image goes through the keyed encoder (the node sends the encoder's key).
    with GenerateClient(node.address, timeout=300, api_key=FRONT_KEYS[1]) as client:
        result = client.generate("Describe the picture.", [image], max_tokens=6, ignore_eos=True)
        [enc] = client.list_encoders()
    assert len(result.token_ids) == 6 and result.usage.images == 1
    assert (enc.address, enc.state, enc.assigned_images) == (keyed_encoder.address, "serving", 1)
    assert check_health(node.address, GENERATE_SERVICE) == health_pb2.HealthCheckResponse.SERVING

    # HTTP: 401 with OpenAI's error object; /health open; the right key served.
    with httpx.Client(timeout=300) as http:
        assert http.get(f"{base}/health").status_code == 200
        for headers, why in (({}, "missing API key"), ({"Authorization": "Bearer wrong-key"}, "invalid API key")):
            for r in (http.get(f"{base}/v1/models", headers=headers),
                      http.post(f"{base}/v1/chat/completions", json=chat, headers=headers)):
                assert r.status_code == 401, r.text
                err = r.json()["error"]
                assert (err["type"], err["code"]) == ("AuthenticationError", 401) and why in err["message"]
        r = http.post(f"{base}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {FRONT_KEYS[0]}"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]

    openai = require_module("openai", "pip install openai")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong-key", max_retries=0).models.list()
    assert openai.OpenAI(base_url=f"{base}/v1", api_key=FRONT_KEYS[0]).models.list().data[0].id == str(tiny_ckpt)

    # Rotation: the rewritten file holds only a new key; once the node has seen the change (its
    # check runs at most once a second) the new key works and the old ones stop working.
    write_keys(key_file, ("client-key-new",))
    with GenerateClient(node.address, timeout=60, api_key="client-key-new") as new:
        for _ in range(100):
            try:
                assert [e.address for e in new.list_encoders()] == [keyed_encoder.address]
                break
            except Unauthenticated:
                time.sleep(0.05)
        else:
            pytest.fail("the rewritten key file never took effect")
    with GenerateClient(node.address, timeout=60, api_key=FRONT_KEYS[0]) as old, \
            pytest.raises(Unauthenticated, match="invalid API key"):
        old.list_encoders()
    with httpx.Client(timeout=60) as http:
        assert http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {FRONT_KEYS[0]}"}).status_code == 401
        assert http.get(f"{base}/v1/models", headers={"Authorization": "Bearer client-key-new"}).status_code == 200
