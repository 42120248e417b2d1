"""EncoderSettings: every knob of an encoder node, built from CLI flags and ENCDIS_* variables.

Each flag `--some-flag` takes its default from the environment variable ENCDIS_SOME_FLAG,
so a systemd EnvironmentFile or a Kubernetes env block configures a node without flags.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path

MiB = 1024 * 1024

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EncoderSettings:
    model: Path
    host: str = "0.0.0.0"
    port: int = 50051
    device: str = "cpu"  # "cpu" or "cuda:N"
    dtype: str = "auto"  # auto: float32 on cpu, bfloat16 on cuda
    metrics_port: int = -1  # <0 disables the metrics endpoint, 0 picks a free port
    max_batch_patches: int = 16384  # patch budget of one forward (an image larger than this runs alone)
    max_images_per_request: int = 64
    max_image_bytes: int = 32 * MiB
    max_image_pixels: int = 8192 * 8192  # decoded width*height, read from the header before decoding
    min_pixels: int = 0  # smallest per-request min_pixels accepted; 0: the checkpoint's min_pixels
    max_pixels: int = 0  # largest per-request max_pixels accepted; 0: the checkpoint's max_pixels
    max_concurrent_rpcs: int = 64
    max_queued_patches: int = 16 * 16384  # accepted, unfinished patches beyond which Encode is refused
    max_chunk_bytes: int = 4 * MiB
    drain_grace_seconds: float = 30.0
    preprocess_workers: int = 2  # threads decoding and resizing images

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device must be cpu or cuda:N, got {self.device!r}")
        positive = ("max_batch_patches", "max_images_per_request", "max_image_bytes", "max_image_pixels",
                    "max_concurrent_rpcs", "max_queued_patches", "max_chunk_bytes", "preprocess_workers")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.min_pixels < 0 or self.max_pixels < 0:
            raise ValueError("--min-pixels and --max-pixels must be >= 0")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"--min-pixels {self.min_pixels} is above --max-pixels {self.max_pixels}")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"


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
    "max_chunk_bytes": "default size of embedding chunks on the wire",
    "drain_grace_seconds": "on SIGTERM, how long in-flight calls may take to finish",
    "preprocess_workers": "threads decoding and resizing images",
}


def env_name(field_name: str) -> str:
    return "ENCDIS_" + field_name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; each defaults to its ENCDIS_* variable, then to the dataclass default."""
    for f in fields(EncoderSettings):
        flag = "--" + f.name.replace("_", "-")
        env = os.environ.get(env_name(f.name))
        kind = {"int": int, "float": float}.get(str(f.type), str)  # annotations are strings here
        if f.name == "model":
            parser.add_argument(flag, type=Path, default=Path(env) if env else None,
                                help=f"{_HELP[f.name]} [env {env_name(f.name)}]")
            continue
        default = kind(env) if env is not None else f.default
        kwargs = {"choices": DTYPES} if f.name == "dtype" else {}
        parser.add_argument(flag, type=kind, default=default,
                            help=f"{_HELP[f.name]} (default {default}) [env {env_name(f.name)}]", **kwargs)


def from_args(args: argparse.Namespace) -> EncoderSettings:
    if getattr(args, "model", None) is None:
        raise ValueError(f"--model is required (or set {env_name('model')})")
    return EncoderSettings(**{f.name: getattr(args, f.name) for f in fields(EncoderSettings)})
