"""vLLM's own serving benchmark (`vllm bench serve`, random-mm over /v1/chat/completions) against encdis.

The LLM node's HTTP front door must work unchanged with the tools built for `vllm serve`:
the runner of vLLM's benchmark client (bench/serving/vllm_bench.py) completes every request against a
real LLM node fed by real encoder nodes, and the node keeps serving afterwards.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from encdis.launcher import NodeProcess
from tests.needs import require_module

pytestmark = pytest.mark.vllm

NUM_PROMPTS = 4
CONCURRENCY = 2
OUTPUT_LEN = 8
RUNNER = Path(__file__).resolve().parents[2] / "bench" / "serving" / "vllm_bench.py"


def load_runner() -> ModuleType:
    """Load the runner from its path, as a script runs it (its folder must not shadow vLLM's imports)."""
    spec = importlib.util.spec_from_file_location("vllm_bench", RUNNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_bench_serve_completes_against_encdis(llm_node: NodeProcess, tiny_ckpt: Path, tmp_path: Path) -> None:
    require_module("vllm.benchmarks.serve", "pip install -e .[llm-cpu] (vLLM's benchmark client)")
    base = f"http://127.0.0.1:{llm_node.info['http_port']}"
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    assert model == str(tiny_ckpt)

    result = load_runner().run_vllm_bench(base, model, tiny_ckpt, num_prompts=NUM_PROMPTS,
                                          max_concurrency=CONCURRENCY, out_dir=tmp_path, input_len=32,
                                          output_len=OUTPUT_LEN, image_size=224, seed=0, timeout=600)

    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result.get("bench_output_tail")
    # ignore_eos: every request decodes exactly OUTPUT_LEN tokens, as the usage chunks report.
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["mean_ttft_ms"] > 0 and result["request_throughput"] > 0
    # Each request had text and one image (its tokens count in the prompt).
    assert result["total_input_tokens"] > NUM_PROMPTS * 32

    assert llm_node.proc.poll() is None
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    after = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Still there?"}]})
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"]
