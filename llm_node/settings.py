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
from pathlib import Path

from encdis import settings_flags
from encdis.settings_flags import DTYPES
from encdis.tls import check_flags as check_tls_flags

MM_TENSOR_IPC = ("auto", "torch_shm", "direct_rpc")
COLOCATED_MODES = ("auto", "off", "require")
ENCODER_DATATYPES = ("FP32", "BF16", "FP16")  # client.wire.DATATYPES, without importing the SDK here
# Encoder nodes accept HTTP/2 pings this often (encoder_node/server.py's keepalive permit).
MIN_KEEPALIVE_SECONDS = 1.0


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
    # Hung and misbehaving encoders (the coordinator's; see coordinator.CoordinatorSettings).
    keepalive_time_seconds: float = 10.0
    keepalive_timeout_seconds: float = 5.0
    attempt_timeout_floor_seconds: float = 2.0
    attempt_timeout_margin: float = 3.0
    quarantine_seconds: float = 5.0
    quarantine_max_seconds: float = 300.0
    slow_seconds: float = 5.0
    slow_max_seconds: float = 60.0
    busy_seconds: float = 2.0
    retry_backoff_seconds: float = 0.05
    retry_backoff_max_seconds: float = 1.0
    # Exposure: TLS (mTLS with a client CA) and API keys on both front doors (encdis/tls.py, encdis/auth.py).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    api_key_file: Path | None = None
    # How the coordinator dials encoders: TLS verified against this CA, a client certificate, a key.
    encoder_tls_ca: Path | None = None
    encoder_tls_cert: Path | None = None
    encoder_tls_key: Path | None = None
    encoder_api_key_file: Path | None = None
    reflection: bool = True
    metrics_host: str | None = None  # None: --host
    health_port: int = -1  # plaintext grpc.health.v1 only, for probes that cannot speak TLS; -1 disables
    # Co-located transport (llm_node/coordinator/colocated.py): auto, off or require.
    colocated: str = "auto"
    colocated_timeout_seconds: float = 10.0
    encoder_datatype: str = "auto"  # of the embeddings encoders send; auto: the engine's dtype

    def __post_init__(self) -> None:
        check_tls_flags(self.tls_cert, self.tls_key, self.tls_client_ca)
        if (self.encoder_tls_cert is None) != (self.encoder_tls_key is None):
            raise ValueError("--encoder-tls-cert and --encoder-tls-key go together")
        if self.encoder_tls_cert is not None and self.encoder_tls_ca is None:
            raise ValueError("--encoder-tls-cert needs --encoder-tls-ca (the CA the encoders' certificates come from)")
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
        if self.colocated not in COLOCATED_MODES:
            raise ValueError(f"--colocated must be one of {COLOCATED_MODES}, got {self.colocated!r}")
        if self.colocated_timeout_seconds <= 0:
            raise ValueError(f"--colocated-timeout-seconds must be positive, got {self.colocated_timeout_seconds}")
        if self.encoder_datatype not in ("auto", *ENCODER_DATATYPES):
            raise ValueError(f"--encoder-datatype must be auto or one of {ENCODER_DATATYPES}, "
                             f"got {self.encoder_datatype!r}")
        if self.media_timeout_seconds <= 0:
            raise ValueError(f"--media-timeout-seconds must be positive, got {self.media_timeout_seconds}")
        self._check_encoder_bounds()

    def _check_encoder_bounds(self) -> None:
        positive = ("keepalive_timeout_seconds", "attempt_timeout_floor_seconds", "quarantine_seconds",
                    "slow_seconds", "retry_backoff_seconds")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.keepalive_time_seconds < MIN_KEEPALIVE_SECONDS:
            # Encoders refuse pings more frequent than that (encoder_node/server.py).
            raise ValueError(f"--keepalive-time-seconds must be >= {MIN_KEEPALIVE_SECONDS}, "
                             f"got {self.keepalive_time_seconds}")
        if self.attempt_timeout_margin < 1 or self.busy_seconds < 0:
            raise ValueError("--attempt-timeout-margin must be >= 1 and --busy-seconds >= 0")
        for first, cap in (("quarantine_seconds", "quarantine_max_seconds"), ("slow_seconds", "slow_max_seconds"),
                           ("retry_backoff_seconds", "retry_backoff_max_seconds")):
            if getattr(self, cap) < getattr(self, first):
                raise ValueError(f"--{cap.replace('_', '-')} must be >= --{first.replace('_', '-')}")


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
    "encode_timeout_seconds": "longest bound of one Encode attempt (the bound until an encoder's cost is known)",
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
    "keepalive_time_seconds": "HTTP/2 ping interval on each encoder channel (>= 1; encoders permit that often)",
    "keepalive_timeout_seconds": "an encoder silent this long after a ping is disconnected",
    "attempt_timeout_floor_seconds": "smallest bound of one Encode attempt once the encoder's cost is known",
    "attempt_timeout_margin": "one Encode attempt may take this many times its predicted cost (with backlog)",
    "quarantine_seconds": "first back-off of an encoder that sent a wrong embedding (doubles on repeat)",
    "quarantine_max_seconds": "longest quarantine back-off",
    "slow_seconds": "first back-off of an encoder whose attempt ran past its bound (doubles on repeat)",
    "slow_max_seconds": "longest slow back-off",
    "busy_seconds": "predicted seconds added, decaying, to the backlog of an encoder that answered "
                    "RESOURCE_EXHAUSTED",
    "retry_backoff_seconds": "first pause between retry rounds when every encoder failed a request (jittered)",
    "retry_backoff_max_seconds": "longest pause between retry rounds",
    "tls_cert": "PEM certificate chain of the gRPC and HTTP ports (TLS; re-read when the file changes); "
                "empty: plaintext",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: clients must present a certificate it signed (mTLS); empty: none required",
    "api_key_file": "accepted API keys, one per line, re-read when the file changes (or ENCDIS_API_KEY holding "
                    "one key); clients send 'authorization: Bearer KEY'; health stays open",
    "encoder_tls_ca": "PEM CA bundle the encoders' certificates are verified with (TLS to encoders; a DNS "
                      "target's addresses are verified against its name); empty: plaintext",
    "encoder_tls_cert": "PEM client certificate chain for encoders that require one (mTLS)",
    "encoder_tls_key": "PEM private key of --encoder-tls-cert",
    "encoder_api_key_file": "file whose first line is the API key sent to encoders (or ENCDIS_ENCODER_API_KEY)",
    "reflection": "serve gRPC server reflection",
    "metrics_host": "address the metrics endpoint binds (empty: --host)",
    "health_port": "plaintext port serving only grpc.health.v1, for probes that cannot use TLS; "
                   "-1 disables, 0 picks one",
    "colocated": "embedding bytes from encoders on this host over a pairwise torch.distributed group: auto "
                 "(NCCL pairs when both sides are on CUDA), off, or require (every encoder must open one; "
                 "gloo on CPU); failed transfers fall back to gRPC",
    "colocated_timeout_seconds": "bound of a co-located rendezvous and of each co-located transfer",
    "encoder_datatype": "datatype encoders must send embeddings in (FP32, BF16, FP16); auto: the engine's "
                        "dtype, as monolithic vLLM runs its tower; encoders sending another are refused",
}


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The `encdis llm` flags; defaults come from the environment, then LLMSettings.

    --dtype and --mm-tensor-ipc take any string: LLMSettings refuses bad ones with a ValueError."""
    settings_flags.add_arguments(p, LLMSettings, _HELP, environ=environ)


def from_args(args: argparse.Namespace) -> LLMSettings:
    return settings_flags.from_args(LLMSettings, args)
