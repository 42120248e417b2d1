"""In bfloat16, the dtype GPUs serve in, encdis generates what monolithic vLLM generates.

Real processes on loopback: two encoder nodes in bf16 (`--tower-impl auto`: vLLM's own
vision tower below float32), one LLM node in bf16, and vLLM's monolithic run in bf16 on the
same checkpoint with the raw image bytes as the reference. Greedy token ids must be equal:
for one image, for text only, and for three mixed images in one request (a large JPEG, a
grey PNG, a wide PNG). With transformers' tower instead (`--tower-impl transformers`
on the encoders, `--encoder-tower-impl transformers` on the LLM node), which rounds otherwise
than vLLM's in bf16, these very cases differ: one image from the first token, the mixed
three from the sixth; text only stays equal. bench/fidelity/fidelity.py measures vLLM's own noise floor across
batch shapes: here vLLM agrees with itself on every one of its 40 prompts in bf16, so
equality is asserted, not a floor.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from encdis.client import GenerateClient
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.demo import synthetic_photo
from encdis.llm_node.engine import cpu_worker_threads
from encdis.llm_node.reference import Case
from tests.e2e.conftest import encoder_processes, reference_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

MAX_TOKENS = 16


def reencode(png: bytes, fmt: str, mode: str = "RGB", **kw) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(png)).convert(mode).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bf16_cases() -> dict[str, Case]:
    large_jpeg = reencode(synthetic_photo(560, 420, seed=11), "JPEG", quality=90)
    grey_png = reencode(synthetic_photo(196, 252, seed=12), "PNG", mode="L")
    wide_png = synthetic_photo(448, 140, seed=13)
    cases = [
        Case("one_image", "Describe the picture.", (synthetic_photo(224, 224, seed=10),), MAX_TOKENS),
        Case("text_only", "Count from one to ten.", (), MAX_TOKENS),
        Case("mixed_three", "What differs between these pictures?", (large_jpeg, grey_png, wide_png), MAX_TOKENS),
    ]
    return {c.name: c for c in cases}


@pytest.fixture(scope="module")
def monolithic_bf16(request: pytest.FixtureRequest, tiny_ckpt: Path, bf16_cases: dict[str, Case],
                    tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    return reference_tokens(request.config, tiny_ckpt, bf16_cases.values(), tmp_path_factory.mktemp("mono-bf16"),
                            dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_encoders(tiny_ckpt: Path) -> Iterator[list[NodeProcess]]:
    # bf16 reductions round by how they are split across threads: the encoders run the engine
    # worker's count (with 2 threads against the worker's 1 the 224x224 image's embedding differs).
    with encoder_processes(tiny_ckpt, "--dtype", "bfloat16", "--torch-threads", str(cpu_worker_threads())) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def bf16_llm_node(tiny_ckpt: Path, bf16_encoders: list[NodeProcess]) -> Iterator[NodeProcess]:
    node = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                       "--dtype", "bfloat16", "--encoders", ",".join(n.address for n in bf16_encoders)], timeout=900)
    try:
        yield node
    finally:
        node.stop()


def generate_ids(address: str, case: Case) -> list[int]:
    with GenerateClient(address, timeout=300) as client:
        result = client.generate(case.prompt, case.images, max_tokens=case.max_tokens, ignore_eos=True)
    assert result.finish_reason == "length"
    return result.token_ids


@pytest.mark.parametrize("name", ["one_image", "text_only", "mixed_three"])
def test_bf16_equals_monolithic_bf16(name, monolithic_bf16, bf16_llm_node, bf16_cases) -> None:
    ids = generate_ids(bf16_llm_node.address, bf16_cases[name])
    assert len(ids) == MAX_TOKENS
    assert ids == monolithic_bf16[name]


def test_bf16_pool_runs_vllms_tower_on_both_encoders(bf16_llm_node, bf16_encoders, bf16_cases) -> None:
    generate_ids(bf16_llm_node.address, bf16_cases["mixed_three"])
    with GenerateClient(bf16_llm_node.address, timeout=60) as client:
        encoders = client.list_encoders()
    assert sorted(e.address for e in encoders) == sorted(n.address for n in bf16_encoders)
    assert all(e.state == "serving" for e in encoders)
    # The three images went to both encoders, so the equality above held across the pool.
    assert all(e.assigned_images > 0 for e in encoders)
