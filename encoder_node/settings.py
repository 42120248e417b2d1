"""EncoderSettings: every knob of an encoder node, built from CLI flags and ENCDIS_* variables.

Each flag `--some-flag` takes its default from the environment variable ENCDIS_SOME_FLAG,
so a systemd EnvironmentFile or a Kubernetes env block configures a node without flags
(the mechanism is encdis/settings_flags.py; this module has the fields and their help).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from encdis import settings_flags
from encdis.client import wire
from encdis.settings_flags import DTYPES
from encdis.tls import check_flags as check_tls_flags

LOADERS = ("vllm", "transformers")  # encoder_node/image_loader.py
TOWER_IMPLS = ("auto", *wire.TOWER_IMPLS)  # encoder_node/vllm_tower.py, encoder_node/tower.py

log = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass(frozen=True)
class EncoderSettings:
    model: Path
    host: str = "0.0.0.0"
    port: int = 50051
    device: str = "cpu"  # "cpu" or "cuda:N"
    dtype: str = "auto"  # auto: float32 on cpu, bfloat16 on cuda
    # auto: vLLM's tower below float32 (where it rounds otherwise than transformers'), transformers' in float32.
    tower_impl: str = "auto"
    metrics_port: int = -1  # <0 disables the metrics endpoint, 0 picks a free port
    max_batch_patches: int = 16384  # patch budget of one forward (an image larger than this runs alone)
    max_images_per_request: int = 64
    max_image_bytes: int = 32 * MiB
    max_image_pixels: int = 8192 * 8192  # decoded width*height, read from the header before decoding
    min_pixels: int = 0  # smallest per-request min_pixels accepted; 0: the checkpoint's min_pixels
    max_pixels: int = 0  # largest per-request max_pixels accepted; 0: the checkpoint's max_pixels
    max_concurrent_rpcs: int = 64
    max_queued_patches: int = 16 * 16384  # accepted, unfinished patches beyond which Encode is refused
    max_decoding_pixels: int = 128 * MiB  # decoded width*height of images being decoded at once (~400 MB RGB)
    max_chunk_bytes: int = 4 * MiB
    # Embedding cache budget (embedding_cache.py): 0 off, -1 min(2 GiB, 5% of the memory limit).
    cache_bytes: int = -1
    drain_grace_seconds: float = 30.0
    # After SIGTERM the node reports NOT_SERVING at once but still accepts calls this long, so a
    # coordinator's call sent before its health watch saw the drain is served, not refused.
    drain_accept_seconds: float = 1.0
    preprocess_workers: int = 2  # threads decoding and resizing images
    # CPU threads of the tower's forward (torch intra-op); 0: torch's default (the cores). In
    # bf16 a reduction's rounding depends on how it is split across threads, so an encoder equal
    # bit for bit to vLLM's CPU worker runs that worker's thread count.
    torch_threads: int = 0
    image_loader: str = "vllm"  # how a decoded image becomes RGB: vLLM's serving rules or transformers'
    # Exposure: TLS (mTLS with a client CA) and API keys on the gRPC port (encdis/tls.py, encdis/auth.py).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    api_key_file: Path | None = None
    reflection: bool = True
    metrics_host: str | None = None  # None: --host
    health_port: int = -1  # plaintext grpc.health.v1 only, for probes that cannot speak TLS; -1 disables
    otlp_traces_endpoint: str = ""  # OTLP gRPC collector (host:port); empty: no tracing, no exporter

    def __post_init__(self) -> None:
        check_tls_flags(self.tls_cert, self.tls_key, self.tls_client_ca)
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device must be cpu or cuda:N, got {self.device!r}")
        if self.tower_impl not in TOWER_IMPLS:
            raise ValueError(f"--tower-impl must be one of {', '.join(TOWER_IMPLS)}, got {self.tower_impl!r}")
        if self.image_loader not in LOADERS:
            raise ValueError(f"--image-loader must be one of {', '.join(LOADERS)}, got {self.image_loader!r}")
        positive = ("max_batch_patches", "max_images_per_request", "max_image_bytes", "max_image_pixels",
                    "max_concurrent_rpcs", "max_queued_patches", "max_decoding_pixels", "max_chunk_bytes",
                    "preprocess_workers")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.cache_bytes < -1:
            raise ValueError(f"--cache-bytes must be >= 0, or -1 for the default, got {self.cache_bytes}")
        if self.torch_threads < 0:
            raise ValueError(f"--torch-threads must be >= 0 (0: torch's default), got {self.torch_threads}")
        if self.drain_accept_seconds < 0:
            raise ValueError(f"--drain-accept-seconds must be >= 0, got {self.drain_accept_seconds}")
        if self.min_pixels < 0 or self.max_pixels < 0:
            raise ValueError("--min-pixels and --max-pixels must be >= 0")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"--min-pixels {self.min_pixels} is above --max-pixels {self.max_pixels}")

    @property
    def resolved_cache_bytes(self) -> int:
        if self.cache_bytes >= 0:
            return self.cache_bytes
        from encdis.encoder_node.embedding_cache import default_budget, memory_limit_bytes
        return default_budget(memory_limit_bytes())

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def resolved_tower_impl(self) -> str:
        """The tower implementation to load: --tower-impl, with auto resolved by dtype."""
        if self.tower_impl != "auto":
            return self.tower_impl
        if self.torch_dtype_name == "float32":
            return "transformers"
        if importlib.util.find_spec("vllm") is None:
            log.warning("--tower-impl auto: vLLM is not installed, so transformers' tower runs in %s; an LLM node "
                        "expecting vLLM's tower at this dtype will refuse this encoder", self.torch_dtype_name)
            return "transformers"
        return "vllm"


_HELP = {
    "model": "checkpoint directory (config.json, safetensors, preprocessor_config.json)",
    "host": "address to bind",
    "port": "gRPC port; 0 picks a free one (reported in the ready line)",
    "device": "cpu or cuda:N",
    "dtype": "auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16 or float16",
    "metrics_port": "Prometheus HTTP port; 0 picks a free one, -1 disables",
    "max_batch_patches": "patch budget of one forward pass",
    "max_images_per_request": "images accepted in one Encode call",
    "max_image_bytes": "encoded bytes accepted per image",
    "max_image_pixels": "decoded width*height accepted per image (checked before decoding)",
    "min_pixels": "smallest min_pixels a request may ask for (0: the checkpoint's)",
    "max_pixels": "largest max_pixels a request may ask for (0: the checkpoint's)",
    "max_concurrent_rpcs": "concurrent Encode calls before RESOURCE_EXHAUSTED (health checks are not counted)",
    "max_queued_patches": "accepted but unfinished patches before RESOURCE_EXHAUSTED",
    "max_decoding_pixels": "decoded pixels of images being decoded at once before RESOURCE_EXHAUSTED",
    "max_chunk_bytes": "default size of embedding chunks on the wire",
    "cache_bytes": "byte budget of the embedding cache (finished embeddings by content digest, LRU); 0: off; "
                   "-1: min(2 GiB, 5% of the cgroup memory limit or of the RAM)",
    "drain_grace_seconds": "on SIGTERM, how long in-flight calls may take to finish",
    "drain_accept_seconds": "on SIGTERM, how long new calls are still accepted after health turns NOT_SERVING",
    "preprocess_workers": "threads decoding and resizing images",
    "torch_threads": "CPU threads of the tower's forward pass (0: torch's default, one per core); on CPU in "
                     "bfloat16, the LLM engine worker's thread count gives embeddings bit-equal to vllm serve's",
    "tower_impl": "vision tower implementation: vllm (vLLM's own layers, as vllm serve runs them; needs vLLM "
                  "installed), transformers, or auto (vllm below float32, where the two round differently; "
                  "transformers in float32)",
    "image_loader": "vllm (EXIF orientation, transparency onto white, as vllm serve) or transformers (as decoded)",
    "tls_cert": "PEM certificate chain of the gRPC port (TLS; re-read when the file changes); empty: plaintext",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: clients must present a certificate it signed (mTLS); empty: none required",
    "api_key_file": "accepted API keys, one per line, re-read when the file changes (or ENCDIS_API_KEY holding "
                    "one key); callers send 'authorization: Bearer KEY'; health and reflection stay open",
    "reflection": "serve gRPC server reflection",
    "metrics_host": "address the metrics endpoint binds (empty: --host)",
    "health_port": "plaintext port serving only grpc.health.v1, for probes that cannot use TLS; "
                   "-1 disables, 0 picks one",
    "otlp_traces_endpoint": "OpenTelemetry collector for traces, OTLP over gRPC (host:port, http:// plaintext, "
                            "https:// TLS); empty: tracing off",
}


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """One flag per field; each defaults to its ENCDIS_* variable, then to the dataclass default."""
    choices = {"dtype": DTYPES, "image_loader": LOADERS, "tower_impl": TOWER_IMPLS}
    settings_flags.add_arguments(parser, EncoderSettings, _HELP, environ=environ, choices=choices)


def from_args(args: argparse.Namespace) -> EncoderSettings:
    return settings_flags.from_args(EncoderSettings, args)
