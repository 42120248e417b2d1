"""README's Python client snippet runs as written against a real encoder node, with the light client.

The snippet is taken from README.md (the ```python block that uses EncoderClient), its
address literal is replaced by a real node's, and it runs verbatim in a fresh interpreter
whose working directory holds a `cat.jpg`; torch, transformers, safetensors, PIL and vLLM are
made unimportable there, as README promises the SDK needs only grpcio, protobuf and numpy. What
it prints must be the image's grid, embedding shape and content digest, each derived here from
the checkpoint independently of the node.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from encdis.checkpoint import weights_fingerprint
from encdis.client.wire import content_digest
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.coordinator.patches import grid_for_image

ROOT = Path(__file__).resolve().parents[2]
CAT_SIZE = (320, 240)  # width, height
# Modules the light client must not need (each import in the child raises ImportError).
HEAVY = ("torch", "transformers", "safetensors", "PIL", "vllm")


def readme_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    matching = [b for b in blocks if "from encdis.client import EncoderClient" in b]
    assert len(matching) == 1, f"expected one README python block using EncoderClient, found {len(matching)}"
    return matching[0]


def with_address(snippet: str, address: str) -> str:
    """The snippet with its one `EncoderClient("HOST:PORT")` address replaced, nothing else."""
    out, n = re.subn(r'(EncoderClient\(")[^"]+("\))', rf"\g<1>{address}\g<2>", snippet)
    assert n == 1, f"expected one EncoderClient(\"HOST:PORT\") in the snippet:\n{snippet}"
    return out


def cat_jpeg() -> bytes:
    w, h = CAT_SIZE
    yy, xx = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(7).integers(0, 64, (h, w, 3))
    pixels = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) % 256], -1) // 2 + noise
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), "RGB").save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def encoder(tiny_ckpt: Path) -> Iterator[NodeProcess]:
    node = start_node(["encoder", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0"], timeout=300)
    try:
        yield node
    finally:
        node.stop()


def test_readme_client_snippet_prints_grid_shape_and_digest(encoder: NodeProcess, tiny_ckpt: Path,
                                                            tmp_path: Path) -> None:
    snippet = readme_snippet()
    assert 'open("cat.jpg", "rb")' in snippet  # the file this test provides
    cat = cat_jpeg()
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "cat.jpg").write_bytes(cat)
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(f"import sys\nfor m in {HEAVY!r}:\n    sys.modules[m] = None\n")
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    r = subprocess.run([sys.executable, "-c", with_address(snippet, encoder.address)], cwd=work, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr

    # What the node must have computed, from the checkpoint alone.
    preproc = json.loads((tiny_ckpt / "preprocessor_config.json").read_text())
    lo, hi = preproc["size"]["shortest_edge"], preproc["size"]["longest_edge"]
    merge = preproc["merge_size"]
    grid = grid_for_image(*CAT_SIZE, min_pixels=lo, max_pixels=hi, patch_size=preproc["patch_size"],
                          merge_size=merge, temporal_patch_size=preproc["temporal_patch_size"])
    hidden = json.loads((tiny_ckpt / "config.json").read_text())["vision_config"]["out_hidden_size"]
    shape = (grid[0] * grid[1] * grid[2] // merge**2, hidden)
    digest = content_digest(cat, lo, hi, weights_fingerprint(tiny_ckpt))
    assert r.stdout.splitlines() == [f"{grid} {shape} {digest}"], r.stdout
