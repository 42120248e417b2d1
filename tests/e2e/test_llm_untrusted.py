"""An LLM node beside a misbehaving encoder still answers as the monolithic model, and lives on.

Real processes on loopback: one LLM node (vLLM, tower not loaded) of this module, whose pool
is one of the session's real encoder nodes and a FakeEncoder (tests/fake_encoder.py) serving
from its own thread and event loop. The fake sends embeddings of the wrong size, each
self-consistent with its own header: 4 rows fewer (which crashed vLLM's engine when accepted)
and 4 rows more (which silently changed every answer). The node's cache is off, so every
request encodes again.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from encdis.client import GenerateClient
from encdis.launcher import NodeProcess, start_node
from tests.e2e.conftest import encoders_by_address, wait_until
from tests.fake_encoder import FakeEncoder, FakeEncoderThread

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


@dataclass
class Rig:
    llm: NodeProcess
    real: NodeProcess
    fake: FakeEncoder


def labelled_metric(node: NodeProcess, name: str, **labels: str) -> float:
    """One labelled sample from the node's Prometheus endpoint; fails if it is not exported."""
    with urllib.request.urlopen(f"http://{node.host}:{node.metrics_port}/metrics", timeout=10) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    for family in families:
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"{name}{labels} is not exported by {node.address}")


def generate_ids(llm: NodeProcess, case) -> list[int]:
    with GenerateClient(llm.address, timeout=300) as client:
        result = client.generate(case.prompt, case.images, max_tokens=case.max_tokens, ignore_eos=True)
    assert result.finish_reason == "length"
    return result.token_ids


@pytest.fixture(scope="module")
def rig(tiny_ckpt: Path, encoder_nodes: list[NodeProcess], monolithic) -> Iterator[Rig]:
    # `monolithic` first: its reference engine has exited before this node's engine starts.
    real = encoder_nodes[0]
    with FakeEncoderThread(tiny_ckpt) as fake_thread:
        llm = start_node(
            ["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
             "--encoders", f"{fake_thread.address},{real.address}", "--cache-bytes", "0",
             "--quarantine-seconds", "0.5"],
            timeout=900,
        )
        try:
            wait_until(lambda: {a: e.state for a, e in encoders_by_address(llm).items()}
                       == {fake_thread.address: "serving", real.address: "serving"}, 60, "both encoders serving")
            yield Rig(llm=llm, real=real, fake=fake_thread.fake)
        finally:
            llm.stop()


def test_wrong_sized_embeddings_are_refused_and_answers_equal_monolithic(rig: Rig, monolithic, equality_cases):
    fake = rig.fake
    for round_, (rows_delta, name) in enumerate(((-4, "three_images"), (4, "three_images_reordered"))):
        if round_:
            # Its back-off over and Describe answered, it is routed to again, and misbehaves again.
            wait_until(lambda: encoders_by_address(rig.llm)[fake.address].state == "serving", 60,
                       "the fake back in rotation after its back-off")
        fake.rows_delta = rows_delta
        calls = fake.calls
        assert generate_ids(rig.llm, equality_cases[name]) == monolithic[name], name
        assert fake.calls > calls, "the fake got none of the request's images: nothing was tested"
        encoders = encoders_by_address(rig.llm)
        assert encoders[fake.address].state == "quarantined"
        assert "rows x hidden" in encoders[fake.address].reason, encoders[fake.address].reason
        assert encoders[rig.real.address].state == "serving"
        # The engine is alive: a text-only request is served as the monolithic model serves it.
        assert generate_ids(rig.llm, equality_cases["c0_text_only"]) == monolithic["c0_text_only"]
    assert labelled_metric(rig.llm, "encdis_coordinator_encoder_faults_total",
                           encoder=fake.address, kind="bad_embedding") >= 2
