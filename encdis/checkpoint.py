"""Reading a Qwen2.5-VL checkpoint directory: configs, the visual tensors, their fingerprint.

Only the vision tower's tensors (`visual.` or `model.visual.`) are ever read, and only from
the safetensors shards that `model.safetensors.index.json` says hold them, so an encoder
node never touches the language model's weights. The fingerprint hashes the stored bytes
straight from the files, so the encoder node and the LLM node compute the same value from
the same weights, whatever dtype either runs in and however the checkpoint is sharded.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

VISUAL_PREFIXES = ("model.visual.", "visual.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: is this a Qwen2.5-VL checkpoint directory?") from None


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    return _read_json(Path(model_dir) / "config.json")


def read_vision_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    cfg = read_config(model_dir)
    if "vision_config" not in cfg:
        raise ValueError(f"{model_dir}/config.json has no vision_config")
    return cfg["vision_config"]


def read_processor_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    return _read_json(Path(model_dir) / "preprocessor_config.json")


def text_hidden_size(model_dir: str | os.PathLike) -> int:
    """The LLM's hidden size: what every image embedding row must have."""
    cfg = read_config(model_dir)
    return int(cfg.get("text_config", {}).get("hidden_size") or cfg["hidden_size"])


def _strip_visual_prefix(name: str) -> str | None:
    for prefix in VISUAL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(tensor table, offset of the data section) of one safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def visual_shards(model_dir: str | os.PathLike) -> dict[str, list[str]]:
    """Shard file name -> the visual tensor names (as stored) it holds."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    shards: dict[str, list[str]] = {}
    if index.exists():
        for name, fname in _read_json(index)["weight_map"].items():
            if _strip_visual_prefix(name) is not None:
                shards.setdefault(fname, []).append(name)
    elif (d / SINGLE_FILE).exists():
        header, _ = _safetensors_header(d / SINGLE_FILE)
        names = [n for n in header if _strip_visual_prefix(n) is not None]
        if names:
            shards[SINGLE_FILE] = names
    else:
        raise FileNotFoundError(f"{d} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    if not shards:
        raise ValueError(f"{d} holds no vision-tower tensors (names starting with {' or '.join(VISUAL_PREFIXES)})")
    return {k: sorted(v) for k, v in sorted(shards.items())}


def visual_weight_names(model_dir: str | os.PathLike) -> list[str]:
    """Visual tensor names without their prefix, sorted."""
    return sorted(_strip_visual_prefix(n) for names in visual_shards(model_dir).values() for n in names)


def load_visual_state_dict(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The vision tower's tensors (torch, as stored), keyed without the `visual.` prefix."""
    from safetensors import safe_open

    d = Path(model_dir)
    state = {}
    for fname, names in visual_shards(d).items():
        with safe_open(str(d / fname), framework="pt") as f:
            for name in names:
                state[_strip_visual_prefix(name)] = f.get_tensor(name)
    return state


def weights_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 over the visual tensors' names, dtypes, shapes and stored bytes."""
    d = Path(model_dir)
    entries = []
    for fname, names in visual_shards(d).items():
        header, base = _safetensors_header(d / fname)
        for name in names:
            entries.append((_strip_visual_prefix(name), fname, header[name], base))
    h = hashlib.sha256()
    for short, fname, meta, base in sorted(entries, key=lambda e: e[0]):
        start, end = meta["data_offsets"]
        h.update(f"{short}|{meta['dtype']}|{meta['shape']}|{end - start}\n".encode())
        with open(d / fname, "rb") as f:
            f.seek(base + start)
            remaining = end - start
            while remaining:
                block = f.read(min(remaining, 16 << 20))
                if not block:
                    raise ValueError(f"{d / fname} is truncated inside tensor {short}")
                h.update(block)
                remaining -= len(block)
    return h.hexdigest()
