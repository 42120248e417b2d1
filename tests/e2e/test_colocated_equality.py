"""Through the co-located path, encdis still generates exactly what the monolithic model does.

Real processes on loopback: the session's two encoder nodes and an LLM node started with
`--colocated require`, so every embedding's header comes over gRPC and its bytes over a gloo
pair (the CPU form of the NCCL path). Greedy token ids must equal vLLM's monolithic run
(the cached reference of test_llm_equality), and the node's metrics must show the bytes
came co-located, none fell back, and the received-bytes counter counted them.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from encdis.client import AsyncGenerateClient
from encdis.launcher import start_node
from encdis.pair_group import read_boot_id
from tests.e2e.conftest import LLM_NODE_MAX_CONCURRENT, concurrent_cases
from tests.e2e.test_llm_equality import generate_ids
from tests.needs import require_or_skip

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

require_or_skip(bool(read_boot_id()), "a host boot id (/proc/sys/kernel/random/boot_id)",
                "the co-located transport pairs processes of one Linux host")


@pytest.fixture(scope="module")
def colocated_node(tiny_ckpt, encoder_nodes):
    node = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0", "--max-concurrent-requests", str(LLM_NODE_MAX_CONCURRENT),
                       "--colocated", "require", "--encoders", ",".join(n.address for n in encoder_nodes)],
                      timeout=900, name="llm-colocated")
    try:
        yield node
    finally:
        node.stop()


def samples(node) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def test_colocated_path_equals_monolithic(monolithic, colocated_node, equality_cases):
    for name in ("one_image", "three_images", "three_images_reordered"):
        assert generate_ids(colocated_node.address, equality_cases[name]) == monolithic[name], name
    cases = concurrent_cases(equality_cases)
    async with AsyncGenerateClient(colocated_node.address, timeout=600) as client:
        results = await asyncio.gather(*(
            client.generate(c.prompt, c.images, max_tokens=c.max_tokens, ignore_eos=True) for c in cases))
    assert {c.name: r.token_ids for c, r in zip(cases, results, strict=True)} == {
        c.name: monolithic[c.name] for c in cases}
    m = samples(colocated_node)
    assert m.get("encdis_coordinator_colocated_pairs", 0) == 2
    assert m.get("encdis_coordinator_colocated_embeddings_total", 0) >= 4  # distinct images, cache aside
    assert not any(k.startswith("encdis_coordinator_colocated_fallbacks_total") and v for k, v in m.items())
    assert m["encdis_coordinator_embedding_bytes_received_total"] > 0
