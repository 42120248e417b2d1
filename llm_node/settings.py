"""LLM node settings: one frozen dataclass built from command-line flags and the environment.

Every flag reads its default from ENCDIS_<FLAG_UPPER_SNAKE> (e.g. --dns-refresh-seconds ->
ENCDIS_DNS_REFRESH_SECONDS), so a systemd EnvironmentFile or a Kubernetes env block can
configure a node without changing its command line (the mechanism is
encdis/settings_flags.py; this module has the fields and their help).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from encdis import settings_flags
from encdis.llm_node.coordinator import settings as coordinator_settings
from encdis.llm_node.coordinator.settings import CoordinatorSettings
from encdis.settings_flags import DTYPES
from encdis.tls import check_flags as check_tls_flags

MM_TENSOR_IPC = ("auto", "torch_shm", "direct_rpc")
HANDOFFS = ("region", "embeds")
# gRPC calls beyond the requests admitted: health checks and watches, ListEncoders, reflection,
# and the calls being refused with RESOURCE_EXHAUSTED by admission.
RPC_HEADROOM = 64
# A Generate request's bytes beside its images: the prompt, the sampling fields.
REQUEST_ROOM_BYTES = 1 << 20
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1


@dataclass(frozen=True)
class LLMSettings:
    """Everything an LLM node needs to start; read by the engine host, coordinator and server."""

    model: str
    host: str = "0.0.0.0"
    port: int = 50050
    tp: int = 1
    metrics_port: int = -1  # -1 disables metrics; 0 binds an ephemeral port
    max_model_len: int = 4096
    dtype: str = "auto"  # "auto": float32 on CPU, the checkpoint's dtype otherwise
    drain_grace_seconds: float = 30.0
    max_num_seqs: int = 16
    kv_cache_gib: float = 1.0  # CPU only: VLLM_CPU_KVCACHE_SPACE when not already set
    gpu_memory_utilization: float = 0.9
    # "region": embeddings reach vLLM's workers through the shared region and encdis's encoder-cache
    # connector; "embeds": through vLLM's request path as image_embeds (llm_node/handoff.py).
    handoff: str = "region"
    mm_tensor_ipc: str = "auto"  # "auto": torch_shm when tp == 1, else direct_rpc (handoff "embeds")
    # vLLM's own multimodal cache would hold a second copy of embeddings the coordinator's cache
    # already keeps: off unless asked for, so the node's memory is what --cache-bytes says.
    mm_processor_cache_gb: float = 0.0
    max_images_per_request: int = 16
    max_image_bytes: int = 32 * 1024 * 1024
    http_port: int = -1  # OpenAI-compatible HTTP front door; -1 disables, 0 binds an ephemeral port
    served_model_name: str = ""  # "" : the --model argument as given, as vLLM names it
    # `vllm serve`'s flags that shape the OpenAI surface, with the same names and meaning.
    chat_template: str = ""  # "": the checkpoint's
    enable_auto_tool_choice: bool = False
    tool_call_parser: str = ""
    max_logprobs: int | None = None  # None: vLLM's default
    generation_config: str = "auto"  # "auto": the checkpoint's generation_config.json; "vllm": vLLM's defaults
    override_generation_config: str = ""  # JSON object
    structured_outputs_config: str = ""  # JSON object
    disable_log_stats: bool = False  # vLLM's statistics (its vllm:* metrics) off, as `vllm serve --disable-log-stats`
    # Request bodies: one request's limit (0: room for its images), and all bodies being read at once.
    max_body_bytes: int = 0
    body_budget_bytes: int = 0  # 0: an eighth of the machine's memory
    allowed_media_domains: tuple[str, ...] = ()  # hosts image URLs may be fetched from (none: data: URIs only)
    media_timeout_seconds: float = 10.0
    # Admission control: beyond these, requests get RESOURCE_EXHAUSTED (HTTP 429), never OOM.
    max_concurrent_requests: int = 64
    max_inflight_embedding_bytes: int = 4 * 1024**3  # predicted from image headers before encoding
    # The gRPC door's own bounds, before any handler runs: calls at once and a request's size.
    max_concurrent_rpcs: int = 0  # 0: max_concurrent_requests + RPC_HEADROOM
    max_request_message_bytes: int = 0  # 0: room for max_images_per_request images + REQUEST_ROOM_BYTES
    # Exposure: TLS (mTLS with a client CA) and API keys on both front doors (encdis/tls.py, encdis/auth.py).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    api_key_file: Path | None = None
    reflection: bool = True
    metrics_host: str | None = None  # None: --host
    health_port: int = -1  # plaintext grpc.health.v1 only, for probes that cannot speak TLS; -1 disables
    otlp_traces_endpoint: str = ""  # OTLP gRPC collector (host:port) for encdis's and vLLM's spans; empty: off
    # The coordinator's knobs (encoder pool, trust, bounds, retries, cache); flat flags of their own.
    coordinator: CoordinatorSettings = field(default_factory=lambda: CoordinatorSettings(encoder_datatype="auto"))

    @property
    def http_body_bytes(self) -> int:
        """One HTTP request body's limit: its base64 images (4/3 of their bytes) and the JSON around them."""
        return self.max_body_bytes or self.max_images_per_request * self.max_image_bytes * 4 // 3 + REQUEST_ROOM_BYTES

    @property
    def http_body_budget(self) -> int:
        """The bytes all HTTP bodies being read at once may hold."""
        if self.body_budget_bytes:
            return self.body_budget_bytes
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8

    @property
    def grpc_concurrent_rpcs(self) -> int:
        """The gRPC port's cap on calls in progress (beyond it gRPC answers RESOURCE_EXHAUSTED)."""
        return self.max_concurrent_rpcs or self.max_concurrent_requests + RPC_HEADROOM

    @property
    def grpc_request_bytes(self) -> int:
        """The largest request message the gRPC port reads (beyond it: RESOURCE_EXHAUSTED, unread)."""
        derived = self.max_images_per_request * self.max_image_bytes + REQUEST_ROOM_BYTES
        return self.max_request_message_bytes or min(derived, GRPC_MAX_MESSAGE_BYTES)

    def __post_init__(self) -> None:
        check_tls_flags(self.tls_cert, self.tls_key, self.tls_client_ca)
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.handoff not in HANDOFFS:
            raise ValueError(f"--handoff must be one of {HANDOFFS}, got {self.handoff!r}")
        if self.handoff == "embeds" and self.http_port >= 0:
            raise ValueError("--http-port needs --handoff region: vLLM's OpenAI handlers take an image as its digest "
                             "and grid, with the rows in the shared region")
        if self.mm_tensor_ipc not in MM_TENSOR_IPC:
            raise ValueError(f"--mm-tensor-ipc must be one of {MM_TENSOR_IPC}, got {self.mm_tensor_ipc!r}")
        if self.mm_processor_cache_gb < 0:
            raise ValueError(f"--mm-processor-cache-gb must be >= 0, got {self.mm_processor_cache_gb}")
        if self.port < 0:
            raise ValueError(f"--port must be >= 0, got {self.port}")
        if self.max_concurrent_requests < 1 or self.max_inflight_embedding_bytes < 1:
            raise ValueError("--max-concurrent-requests and --max-inflight-embedding-bytes must be positive")
        if self.max_concurrent_rpcs < 0 or self.max_request_message_bytes < 0:
            raise ValueError("--max-concurrent-rpcs and --max-request-message-bytes must be >= 0 (0: derived)")
        if self.max_request_message_bytes > GRPC_MAX_MESSAGE_BYTES:
            raise ValueError(f"--max-request-message-bytes must be at most {GRPC_MAX_MESSAGE_BYTES} (gRPC's limit)")
        if self.max_body_bytes < 0 or self.body_budget_bytes < 0:
            raise ValueError("--max-body-bytes and --body-budget-bytes must be >= 0 (0: derived)")
        if self.media_timeout_seconds <= 0:
            raise ValueError(f"--media-timeout-seconds must be positive, got {self.media_timeout_seconds}")


_HELP = {
    "model": "checkpoint directory (Qwen2.5-VL)",
    "host": "address to bind",
    "port": "gRPC port; 0 binds an ephemeral port (the ready line reports it)",
    "tp": "vLLM tensor_parallel_size",
    "metrics_port": "Prometheus port; -1 disables, 0 ephemeral",
    "max_model_len": "vLLM max_model_len",
    "dtype": f"LLM dtype, one of {', '.join(DTYPES)}",
    "drain_grace_seconds": "on SIGTERM, time left to in-flight work",
    "max_num_seqs": "vLLM max_num_seqs",
    "kv_cache_gib": "CPU KV cache GiB (VLLM_CPU_KVCACHE_SPACE if unset)",
    "gpu_memory_utilization": "vLLM gpu_memory_utilization",
    "handoff": "how embeddings reach vLLM's workers: region (written once into shared memory, mapped by each "
               "worker through encdis's encoder-cache connector) or embeds (vLLM's request path)",
    "mm_tensor_ipc": f"with --handoff embeds, how embeddings reach vLLM's engine, one of {', '.join(MM_TENSOR_IPC)}",
    "mm_processor_cache_gb": "GiB of vLLM's multimodal processor cache (embeddings already sent to the "
                             "engine); 0: none, the coordinator's --cache-bytes is the node's embedding cache",
    "max_images_per_request": "images allowed in one request",
    "max_image_bytes": "largest encoded image accepted",
    "http_port": "OpenAI-compatible HTTP port (/v1/chat/completions, /v1/models, /health); -1 disables, 0 ephemeral",
    "served_model_name": "model name in the OpenAI API (empty: the --model argument)",
    "chat_template": "as vllm serve's --chat-template (empty: the checkpoint's)",
    "enable_auto_tool_choice": "as vllm serve's --enable-auto-tool-choice (needs --tool-call-parser)",
    "tool_call_parser": "as vllm serve's --tool-call-parser",
    "max_logprobs": "as vllm serve's --max-logprobs (empty: vLLM's default)",
    "generation_config": "as vllm serve's --generation-config: auto (the checkpoint's sampling defaults), vllm, "
                         "or a folder",
    "override_generation_config": "as vllm serve's --override-generation-config (a JSON object)",
    "structured_outputs_config": "as vllm serve's --structured-outputs-config (a JSON object)",
    "disable_log_stats": "as vllm serve's --disable-log-stats: no vLLM statistics (its vllm:* metrics and its "
                         "request spans' timings); a little less work per engine step",
    "max_body_bytes": "largest HTTP request body (413 as soon as a body passes it); 0: room for "
                      "--max-images-per-request images of --max-image-bytes in base64",
    "body_budget_bytes": "HTTP request bodies being read at once, all together; a body that does not fit gets "
                         "429 before it is read (0: an eighth of the machine's memory)",
    "allowed_media_domains": "comma-separated hosts image URLs may be fetched from (empty: data: URIs only)",
    "media_timeout_seconds": "time limit of fetching one image URL",
    "max_concurrent_requests": "requests served at once; more get RESOURCE_EXHAUSTED (HTTP 429)",
    "max_inflight_embedding_bytes": "embedding bytes of requests in flight (predicted from image headers); "
                                    "a request beyond it gets RESOURCE_EXHAUSTED (HTTP 429)",
    "max_concurrent_rpcs": f"gRPC calls in progress at once, health checks included; more get RESOURCE_EXHAUSTED "
                           f"from gRPC itself (0: --max-concurrent-requests + {RPC_HEADROOM})",
    "max_request_message_bytes": "largest gRPC request message read; a larger one is refused (RESOURCE_EXHAUSTED) "
                                 "unread (0: --max-images-per-request x --max-image-bytes + 1 MiB)",
    "tls_cert": "PEM certificate chain of the gRPC and HTTP ports (TLS; re-read when the file changes); "
                "empty: plaintext",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: clients must present a certificate it signed (mTLS); empty: none required",
    "api_key_file": "accepted API keys, one per line, re-read when the file changes (or ENCDIS_API_KEY holding "
                    "one key); clients send 'authorization: Bearer KEY'; health stays open",
    "reflection": "serve gRPC server reflection",
    "metrics_host": "address the metrics endpoint binds (empty: --host)",
    "health_port": "plaintext port serving only grpc.health.v1, for probes that cannot use TLS; "
                   "-1 disables, 0 picks one",
    "otlp_traces_endpoint": "OpenTelemetry collector for traces (encdis's and vLLM's), OTLP over gRPC "
                            "(host:port, http:// plaintext, https:// TLS); empty: tracing off",
    **coordinator_settings.HELP,
}


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The `encdis llm` flags; defaults come from the environment, then LLMSettings.

    --dtype and --mm-tensor-ipc take any string: LLMSettings refuses bad ones with a ValueError."""
    settings_flags.add_arguments(p, LLMSettings, _HELP, environ=environ)


def from_args(args: argparse.Namespace) -> LLMSettings:
    return settings_flags.from_args(LLMSettings, args)
