"""LLM node settings: one frozen dataclass built from command-line flags and the environment.

Every flag reads its default from ENCDIS_<FLAG_UPPER_SNAKE> (e.g. --dns-refresh-seconds ->
ENCDIS_DNS_REFRESH_SECONDS), so a systemd EnvironmentFile or a Kubernetes env block can
configure a node without changing its command line (the mechanism is
encdis/settings_flags.py; this module has the fields and their help).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from encdis import settings_flags
from encdis.settings_flags import DTYPES

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
    http_port: int = -1  # OpenAI-compatible HTTP front door; -1 disables, 0 binds an ephemeral port
    served_model_name: str = ""  # "" : the --model argument as given, as vLLM names it
    allowed_media_domains: tuple[str, ...] = ()  # hosts image URLs may be fetched from (none: data: URIs only)
    media_timeout_seconds: float = 10.0
    image_loader: str = "vllm"  # encoders must use the same (it changes the embeddings)
    # Admission control: beyond these, requests get RESOURCE_EXHAUSTED (HTTP 429), never OOM.
    max_concurrent_requests: int = 64
    max_inflight_embedding_bytes: int = 4 * 1024**3  # predicted from image headers before encoding

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
        if self.image_loader not in ("vllm", "transformers"):
            raise ValueError(f"--image-loader must be vllm or transformers, got {self.image_loader!r}")
        if self.max_concurrent_requests < 1 or self.max_inflight_embedding_bytes < 1:
            raise ValueError("--max-concurrent-requests and --max-inflight-embedding-bytes must be positive")
        if self.media_timeout_seconds <= 0:
            raise ValueError(f"--media-timeout-seconds must be positive, got {self.media_timeout_seconds}")


_HELP = {
    "model": "checkpoint directory (Qwen2.5-VL)",
    "encoders": "encoder nodes, comma-separated host:port (DNS names allowed)",
    "host": "address to bind",
    "port": "gRPC port; 0 binds an ephemeral port (the ready line reports it)",
    "tp": "vLLM tensor_parallel_size",
    "metrics_port": "Prometheus port; -1 disables, 0 ephemeral",
    "dns_server": "DNS server host:port used to resolve encoder names (empty: the system's resolver)",
    "dns_refresh_seconds": "how often encoder names are re-resolved",
    "max_model_len": "vLLM max_model_len",
    "dtype": f"LLM dtype, one of {', '.join(DTYPES)}",
    "cache_bytes": "embedding cache size in bytes (0 disables)",
    "max_retries": "re-sends of a failed image to another encoder",
    "drain_grace_seconds": "on SIGTERM, time left to in-flight work",
    "max_num_seqs": "vLLM max_num_seqs",
    "kv_cache_gib": "CPU KV cache GiB (VLLM_CPU_KVCACHE_SPACE if unset)",
    "gpu_memory_utilization": "vLLM gpu_memory_utilization",
    "mm_tensor_ipc": f"how embeddings reach vLLM's engine, one of {', '.join(MM_TENSOR_IPC)}",
    "max_images_per_request": "images allowed in one request",
    "max_image_bytes": "largest encoded image accepted",
    "encode_timeout_seconds": "deadline of one Encode call",
    "encoder_wait_seconds": "how long a request waits for an encoder to become usable before UNAVAILABLE",
    "describe_timeout_seconds": "deadline of an encoder's Describe",
    "http_port": "OpenAI-compatible HTTP port (/v1/chat/completions, /v1/models, /health); -1 disables, 0 ephemeral",
    "served_model_name": "model name in the OpenAI API (empty: the --model argument)",
    "allowed_media_domains": "comma-separated hosts image URLs may be fetched from (empty: data: URIs only)",
    "media_timeout_seconds": "time limit of fetching one image URL",
    "image_loader": "the encoders' image loader (vllm or transformers); encoders using another are refused",
    "max_concurrent_requests": "requests served at once; more get RESOURCE_EXHAUSTED (HTTP 429)",
    "max_inflight_embedding_bytes": "embedding bytes of requests in flight (predicted from image headers); "
                                    "a request beyond it gets RESOURCE_EXHAUSTED (HTTP 429)",
}


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The `encdis llm` flags; defaults come from the environment, then LLMSettings.

    --dtype and --mm-tensor-ipc take any string: LLMSettings refuses bad ones with a ValueError."""
    settings_flags.add_arguments(p, LLMSettings, _HELP, environ=environ)


def from_args(args: argparse.Namespace) -> LLMSettings:
    return settings_flags.from_args(LLMSettings, args)
