"""`encdis encode`: encode image files on an encoder node into one .safetensors file.

    encdis encode --server HOST:PORT --out embeds.safetensors cat.jpg dog.png

Writes `embeds.<i>` (num_tokens x hidden, the node's datatype) and `grid_thw.<i>` (int64 [3])
for each image i, with each image's digest in the file's metadata. The light client has no
torch or safetensors package, so the format is written directly: an 8-byte little-endian
header length, a JSON header (dtype, shape, data_offsets per tensor), then the raw bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from encdis.client.encoder_client import EncoderClient
from encdis.client.errors import EncdisError
from encdis.client.wire import DATATYPES, Embedding


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("images", nargs="+", type=Path, help="image files (JPEG, PNG, WebP, GIF, BMP, TIFF)")
    p.add_argument("--server", required=True, help="encoder node address HOST:PORT")
    p.add_argument("--out", required=True, type=Path, help="output .safetensors file")
    p.add_argument("--min-pixels", type=int, default=0, help="resize lower bound (0: the checkpoint's)")
    p.add_argument("--max-pixels", type=int, default=0, help="resize upper bound (0: the checkpoint's)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the call is abandoned")


def run(args: argparse.Namespace) -> int:
    try:
        images = [path.read_bytes() for path in args.images]
    except OSError as e:
        print(f"encdis encode: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    try:
        with EncoderClient(args.server, timeout=args.timeout) as client:
            embeddings = client.encode(images, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    except EncdisError as e:
        print(f"encdis encode: {e}", file=sys.stderr)
        return 1
    write_embeddings(args.out, embeddings, sources=[str(p) for p in args.images])
    for e, path in zip(embeddings, args.images, strict=True):
        print(f"{path}: grid_thw={list(e.grid_thw)} embeds={list(e.shape)} {e.datatype} digest={e.digest[:16]}")
    print(f"wrote {len(embeddings)} embeddings to {args.out}")
    return 0


def write_embeddings(path: str | os.PathLike, embeddings: Sequence[Embedding],
                     sources: Sequence[str] | None = None) -> None:
    """`embeds.<i>` and `grid_thw.<i>` per image, digests (and sources) in the metadata."""
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    metadata: dict[str, str] = {}
    for e in embeddings:
        i = e.image_index
        # Raw bytes under safetensors' name of the same dtype (BF16 stays BF16).
        tensors[f"embeds.{i}"] = (DATATYPES[e.datatype].safetensors, e.shape, e.data)
        tensors[f"grid_thw.{i}"] = ("I64", (3,), np.asarray(e.grid_thw, dtype="<i8").tobytes())
        metadata[f"digest.{i}"] = e.digest
        if sources is not None:
            metadata[f"source.{i}"] = sources[i]
    write_safetensors(path, tensors, metadata)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write name -> (safetensors dtype, shape, raw little-endian bytes) in the safetensors format."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _dtype, _shape, data in tensors.values():
            f.write(data)
    os.replace(tmp, path)
