"""Tensor parallelism: `encdis llm --tp 2` generates what monolithic vLLM generates at TP 2.

Real processes on loopback: two encoder nodes, an LLM node whose vLLM engine runs two
tensor-parallel CPU workers (tower not loaded), and vLLM's own monolithic run at TP 2 (tower
loaded, raw images) as the reference. The checkpoint's vision tower has 3 heads, which do not
divide by 2: the node, which never runs the tower, must start anyway (vLLM would assert on
them in its default "weights" encoder TP mode), as `vllm serve` does with its tower replicated
per rank. The node receives each embedding once, whatever its TP size: the bytes its
coordinator counts as received equal the bytes the encoders sent, and both equal the
embeddings' sizes (rows x hidden x 4, float32 on CPU). Eight concurrent requests (text only to
four images, one repeated) equal it too: their embeddings go through the handoff at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from encdis.client import GenerateClient
from encdis.launcher import NodeProcess, start_node
from encdis.tiny_checkpoint import make_tiny_checkpoint
from tests.e2e.conftest import concurrent_cases, concurrent_token_ids, encoder_processes, reference_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

TP = 2
CASES = ("one_image", "three_images")
RECEIVED = "encdis_coordinator_embedding_bytes_received_total"
SENT = "encdis_encoder_embedding_bytes_total"


@pytest.fixture(scope="module")
def three_head_ckpt(tmp_path_factory) -> Path:
    """The tiny checkpoint with a 3-head vision tower (48 wide: 16 per head)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-3-heads",
                                vision_overrides={"num_heads": 3, "hidden_size": 48})


@pytest.fixture(scope="module")
def monolithic_tp2(request, three_head_ckpt: Path, equality_cases, tmp_path_factory) -> dict[str, list[int]]:
    cases = [equality_cases[name] for name in CASES] + concurrent_cases(equality_cases)
    return reference_tokens(request.config, three_head_ckpt, cases, tmp_path_factory.mktemp("monolithic-tp2"),
                            tp=TP)


@pytest.fixture(scope="module")
def encoder_nodes(three_head_ckpt: Path) -> Iterator[list[NodeProcess]]:
    with encoder_processes(three_head_ckpt) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def llm_node_tp2(three_head_ckpt: Path, encoder_nodes: list[NodeProcess]) -> Iterator[NodeProcess]:
    node = start_node(["llm", "--model", str(three_head_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0", "--tp", str(TP),
                       "--encoders", ",".join(n.address for n in encoder_nodes)], timeout=900)
    try:
        yield node
    finally:
        node.stop()


def test_tp2_tokens_equal_monolithic_tp2_and_each_embedding_arrives_once(
        monolithic_tp2, llm_node_tp2, encoder_nodes, equality_cases, three_head_ckpt):
    hidden = json.loads((three_head_ckpt / "config.json").read_text())["vision_config"]["out_hidden_size"]
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


async def test_tp2_eight_concurrent_requests_equal_monolithic_tp2(monolithic_tp2, llm_node_tp2, equality_cases):
    got = await concurrent_token_ids(llm_node_tp2.address, equality_cases)
    assert got == {name: monolithic_tp2[name] for name in got}
