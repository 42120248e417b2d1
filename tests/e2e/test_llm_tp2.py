"""Tensor parallelism: `encdis llm --tp 2` generates what monolithic vLLM generates at TP 2.

Real processes on loopback: the session's two encoder nodes, an LLM node whose vLLM engine
runs two tensor-parallel CPU workers (tower not loaded), and vLLM's own monolithic run at
TP 2 (tower loaded, raw images) as the reference. The node receives each embedding once,
whatever its TP size: the bytes its coordinator counts as received equal the bytes the
encoders sent, and both equal the embeddings' sizes (rows x hidden x 4, float32 on CPU).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from encdis.client import GenerateClient
from encdis.launcher import NodeProcess, start_node
from tests.e2e.conftest import reference_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

TP = 2
CASES = ("one_image", "three_images")
RECEIVED = "encdis_coordinator_embedding_bytes_received_total"
SENT = "encdis_encoder_embedding_bytes_total"


@pytest.fixture(scope="module")
def monolithic_tp2(request, tiny_ckpt: Path, equality_cases, tmp_path_factory) -> dict[str, list[int]]:
    cases = [equality_cases[name] for name in CASES]
    return reference_tokens(request.config, tiny_ckpt, cases, tmp_path_factory.mktemp("monolithic-tp2"), tp=TP)


@pytest.fixture(scope="module")
def llm_node_tp2(tiny_ckpt: Path, encoder_nodes: list[NodeProcess]) -> Iterator[NodeProcess]:
    node = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0", "--tp", str(TP),
                       "--encoders", ",".join(n.address for n in encoder_nodes)], timeout=900)
    try:
        yield node
    finally:
        node.stop()


def test_tp2_tokens_equal_monolithic_tp2_and_each_embedding_arrives_once(
        monolithic_tp2, llm_node_tp2, encoder_nodes, equality_cases, tiny_ckpt):
    hidden = json.loads((tiny_ckpt / "config.json").read_text())["vision_config"]["out_hidden_size"]
    received0 = llm_node_tp2.metric(RECEIVED)
    sent0 = sum(n.metric(SENT) for n in encoder_nodes)
    expected_bytes = 0
    for name in CASES:
        case = equality_cases[name]
        # Images seen before would come from the node's cache: this node is new, these cases
        # have no image in common, so every image is encoded and received once.
        with GenerateClient(llm_node_tp2.address, timeout=600) as client:
            result = client.generate(case.prompt, case.images, max_tokens=case.max_tokens, ignore_eos=True)
        assert result.token_ids == monolithic_tp2[name], name
        expected_bytes += result.usage.image_tokens * hidden * 4
    assert len(monolithic_tp2["three_images"]) == equality_cases["three_images"].max_tokens
    received = llm_node_tp2.metric(RECEIVED) - received0
    sent = sum(n.metric(SENT) for n in encoder_nodes) - sent0
    assert received == expected_bytes
    assert sent == expected_bytes
