"""Encoder node settings: flags, ENCDIS_* environment defaults, validation."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from encdis.encoder_node import settings as s


def _parse(argv, monkeypatch=None, env=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    s.add_arguments(p)
    return s.from_args(p.parse_args(argv))


def test_defaults():
    cfg = _parse(["--model", "/m"])
    assert str(cfg.model) == "/m" and cfg.port == 50051 and cfg.metrics_port == -1
    assert cfg.max_batch_patches == 16384 and cfg.max_images_per_request == 64
    assert cfg.max_image_bytes == 32 * 1024 * 1024 and cfg.max_chunk_bytes == 4 * 1024 * 1024
    assert cfg.torch_dtype_name == "float32"


def test_environment_gives_defaults_and_flags_override_it(monkeypatch):
    env = {"ENCDIS_MODEL": "/env-model", "ENCDIS_MAX_BATCH_PATCHES": "4096", "ENCDIS_DEVICE": "cuda:1",
           "ENCDIS_DRAIN_GRACE_SECONDS": "2.5"}
    cfg = _parse(["--max-batch-patches", "8192"], monkeypatch, env)
    assert str(cfg.model) == "/env-model" and cfg.device == "cuda:1" and cfg.drain_grace_seconds == 2.5
    assert cfg.max_batch_patches == 8192
    assert cfg.torch_dtype_name == "bfloat16"  # auto on cuda


@pytest.mark.parametrize("argv, match", [
    (["--device", "tpu"], "--device"),
    (["--max-batch-patches", "0"], "must be positive"),
    (["--min-pixels", "500", "--max-pixels", "100"], "above"),
])
def test_invalid_settings_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        _parse(["--model", "/m", *argv])


def test_encoder_command_without_a_model_exits_2(monkeypatch):
    monkeypatch.delenv("ENCDIS_MODEL", raising=False)
    r = subprocess.run([sys.executable, "-m", "encdis.cli", "encoder"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--model is required" in r.stderr
