"""LLM node settings: one frozen dataclass built from command-line flags and the environment.

Every flag reads its default from ENCDIS_<FLAG_UPPER_SNAKE> (e.g. --dns-refresh-seconds ->
ENCDIS_DNS_REFRESH_SECONDS), so a systemd EnvironmentFile or a Kubernetes env block can
configure a node without changing its command line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
MM_TENSOR_IPC = ("auto", "torch_shm", "direct_rpc")


@dataclass(frozen=True)
class LLMSettings:
    """Everything an LLM node needs to start; read by the engine host, coordinator and server."""

    model: str
    encoders: tuple[str, ...] = ()  # host:port, static or DNS names (re-resolved)
    host: str = "0.0.0.0"
    port: int = 50050
    tp: int = 1
    metrics_port: int = -1  # -1 disables metrics; 0 binds an ephemeral port
    dns_server: str | None = None  # host:port of a DNS server to resolve encoder names with
    dns_refresh_seconds: float = 10.0
    max_model_len: int = 4096
    dtype: str = "auto"  # "auto": float32 on CPU, the checkpoint's dtype otherwise
    cache_bytes: int = 256 * 1024 * 1024  # embedding cache (LRU by bytes); 0 disables
    max_retries: int = 3  # re-sends of one image to another encoder after a failure
    drain_grace_seconds: float = 30.0
    max_num_seqs: int = 16
    kv_cache_gib: float = 1.0  # CPU only: VLLM_CPU_KVCACHE_SPACE when not already set
    gpu_memory_utilization: float = 0.9
    mm_tensor_ipc: str = "auto"  # "auto": torch_shm when tp == 1, else direct_rpc
    max_images_per_request: int = 16
    max_image_bytes: int = 32 * 1024 * 1024
    encode_timeout_seconds: float = 120.0
    # A request finding no serving encoder waits this long for encoders still connecting or
    # being re-checked after a failure, then fails with UNAVAILABLE.
    encoder_wait_seconds: float = 10.0
    describe_timeout_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.mm_tensor_ipc not in MM_TENSOR_IPC:
            raise ValueError(f"--mm-tensor-ipc must be one of {MM_TENSOR_IPC}, got {self.mm_tensor_ipc!r}")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.port < 0:
            raise ValueError(f"--port must be >= 0, got {self.port}")


def _env(flag: str) -> str:
    return "ENCDIS_" + flag.lstrip("-").replace("-", "_").upper()


def _parse_list(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (tuple, list)):
        parts = [p for v in value for p in str(v).split(",")]
    else:
        parts = value.split(",")
    return tuple(p.strip() for p in parts if p.strip())


def _add(p: argparse.ArgumentParser, flag: str, conv: Callable[[str], Any], default: Any, help_text: str,
         environ: Mapping[str, str]) -> None:
    env = _env(flag)
    raw = environ.get(env)
    value = conv(raw) if raw not in (None, "") else default
    p.add_argument(flag, type=conv, default=value, help=f"{help_text} (env {env}; default {value!r})")


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The `encdis llm` flags; defaults come from the environment, then LLMSettings."""
    env = os.environ if environ is None else environ
    d = LLMSettings(model="")
    _add(p, "--model", str, None, "checkpoint directory (Qwen2.5-VL)", env)
    _add(p, "--encoders", str, "", "encoder nodes, comma-separated host:port (DNS names allowed)", env)
    _add(p, "--host", str, d.host, "address to bind", env)
    _add(p, "--port", int, d.port, "gRPC port; 0 binds an ephemeral port (the ready line reports it)", env)
    _add(p, "--tp", int, d.tp, "vLLM tensor_parallel_size", env)
    _add(p, "--metrics-port", int, d.metrics_port, "Prometheus port; -1 disables, 0 ephemeral", env)
    _add(p, "--dns-server", str, d.dns_server, "DNS server host:port used to resolve encoder names", env)
    _add(p, "--dns-refresh-seconds", float, d.dns_refresh_seconds, "how often encoder names are re-resolved", env)
    _add(p, "--max-model-len", int, d.max_model_len, "vLLM max_model_len", env)
    _add(p, "--dtype", str, d.dtype, f"LLM dtype, one of {DTYPES}", env)
    _add(p, "--cache-bytes", int, d.cache_bytes, "embedding cache size in bytes (0 disables)", env)
    _add(p, "--max-retries", int, d.max_retries, "re-sends of a failed image to another encoder", env)
    _add(p, "--drain-grace-seconds", float, d.drain_grace_seconds, "on SIGTERM, time left to in-flight work", env)
    _add(p, "--max-num-seqs", int, d.max_num_seqs, "vLLM max_num_seqs", env)
    _add(p, "--kv-cache-gib", float, d.kv_cache_gib, "CPU KV cache GiB (VLLM_CPU_KVCACHE_SPACE if unset)", env)
    _add(p, "--gpu-memory-utilization", float, d.gpu_memory_utilization, "vLLM gpu_memory_utilization", env)
    _add(p, "--mm-tensor-ipc", str, d.mm_tensor_ipc, f"how embeddings reach vLLM's engine, one of {MM_TENSOR_IPC}",
         env)
    _add(p, "--max-images-per-request", int, d.max_images_per_request, "images allowed in one request", env)
    _add(p, "--max-image-bytes", int, d.max_image_bytes, "largest encoded image accepted", env)
    _add(p, "--encode-timeout-seconds", float, d.encode_timeout_seconds, "deadline of one Encode call", env)
    _add(p, "--encoder-wait-seconds", float, d.encoder_wait_seconds,
         "how long a request waits for an encoder to become usable before UNAVAILABLE", env)
    _add(p, "--describe-timeout-seconds", float, d.describe_timeout_seconds, "deadline of an encoder's Describe", env)


def from_args(args: argparse.Namespace) -> LLMSettings:
    if not args.model:
        raise ValueError("--model is required (or ENCDIS_MODEL)")
    return LLMSettings(
        model=str(args.model),
        encoders=_parse_list(args.encoders),
        host=args.host,
        port=args.port,
        tp=args.tp,
        metrics_port=args.metrics_port,
        dns_server=args.dns_server or None,
        dns_refresh_seconds=args.dns_refresh_seconds,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        cache_bytes=args.cache_bytes,
        max_retries=args.max_retries,
        drain_grace_seconds=args.drain_grace_seconds,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        mm_tensor_ipc=args.mm_tensor_ipc,
        max_images_per_request=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes,
        encode_timeout_seconds=args.encode_timeout_seconds,
        encoder_wait_seconds=args.encoder_wait_seconds,
        describe_timeout_seconds=args.describe_timeout_seconds,
    )
