"""Session-wide fixtures: the tiny checkpoints every test runs on, and an offline environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Counts vLLM engine starts and prints them in the terminal summary.
pytest_plugins = ["tests.engine_starts"]

# No hub access anywhere, and vLLM's CPU build must not reserve most of the machine's memory
# (it would refuse to start a second engine beside the first).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _build(root: Path, name: str, seed: int, shards: int) -> Path:
    from encdis.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(root / name, seed=seed, shards=shards)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-VL checkpoint (seed 0), sharded: visual tensors alone in shard 1."""
    return _build(tmp_path_factory.mktemp("ckpt"), "tiny-seed0", seed=0, shards=3)


@pytest.fixture(scope="session")
def other_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes, other weights (seed 1): an encoder serving it must be refused."""
    return _build(tmp_path_factory.mktemp("ckpt"), "tiny-seed1", seed=1, shards=1)
