"""`encdis demo`: encdis end to end on one machine, on the tiny checkpoint.

Builds the tiny Qwen2.5-VL checkpoint if it is absent, starts two encoder nodes and one
LLM node as child processes (ephemeral ports, read from their ready lines), sends a few
requests with one to four images, prints each answer with its time split and each
encoder's share of the patches, then shuts everything down: the children and their own
children (vLLM's engine processes) never outlive the demo, also on Ctrl-C or SIGTERM.

The tiny checkpoint's weights are random: answers are fluent nonsense, but they are
exactly what the monolithic model would say (tests/e2e/test_llm_equality.py).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from encdis.launcher import NodeProcess

DEFAULT_MODEL_DIR = Path("~/.cache/encdis/tiny-qwen2.5-vl").expanduser()
# The demo runs offline on the tiny checkpoint; the caller's own settings win.
NODE_ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                     "TOKENIZERS_PARALLELISM": "false"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help=f"checkpoint directory; built (tiny, random) if absent (default {DEFAULT_MODEL_DIR})")
    p.add_argument("--encoders", type=int, default=2, help="encoder nodes to start (default 2)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer (default 24)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a node may take to start")


def synthetic_photo(width: int, height: int, seed: int) -> bytes:
    """A deterministic photo-like PNG (gradients, shapes, noise): no package here ships photos."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([
        127 + 120 * np.sin(x / (17 + 7 * seed) + rng.uniform(0, 6)),
        127 + 120 * np.cos(y / (23 + 5 * seed) + rng.uniform(0, 6)),
        127 + 120 * np.sin((x + y) / (31 + 3 * seed)),
    ], axis=-1)
    base += rng.normal(0, 12, base.shape)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, width - 8)), int(rng.integers(0, height - 8))
        x1, y1 = x0 + int(rng.integers(8, max(9, width // 2))), y0 + int(rng.integers(8, max(9, height // 2)))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def demo_requests() -> list[tuple[str, list[bytes]]]:
    landscape = synthetic_photo(448, 336, seed=3)
    square = synthetic_photo(224, 224, seed=0)
    wide = synthetic_photo(336, 168, seed=1)
    small = synthetic_photo(84, 112, seed=2)
    return [
        ("Describe the picture.", [landscape]),
        ("What is in this image?", [square]),
        ("Compare the two pictures.", [wide, small]),
        ("What differs between these pictures?", [square, wide, small, landscape]),
    ]


def ensure_checkpoint(model: Path | None) -> Path:
    path = (model or DEFAULT_MODEL_DIR).expanduser()
    if not (path / "config.json").exists():
        from encdis.tiny_checkpoint import make_tiny_checkpoint

        print(f"building the tiny checkpoint in {path} ...", flush=True)
        make_tiny_checkpoint(path, seed=0, shards=3)
    return path


async def send_requests(address: str, max_tokens: int) -> tuple[list, list]:
    from encdis.client.generate_client import AsyncGenerateClient

    async with AsyncGenerateClient(address, timeout=600) as client:
        reqs = demo_requests()
        results = await asyncio.gather(*(client.generate(p, ims, max_tokens=max_tokens) for p, ims in reqs))
        encoders = await client.list_encoders()
    return [(p, ims, r) for (p, ims), r in zip(reqs, results, strict=True)], encoders


RANDOM_WEIGHTS_NOTE = ("note: the tiny checkpoint's weights are random, so its answers are noise by design; "
                       "they are exactly what the monolithic model answers to the same requests")


def print_report(answers: list, encoders: list) -> None:
    print(RANDOM_WEIGHTS_NOTE)
    for i, (prompt, images, r) in enumerate(answers, 1):
        t = r.timing
        print(f"\n[{i}] {len(images)} image(s): {prompt}")
        print(f"    answer: {r.text!r}")
        print(f"    tokens: {len(r.token_ids)} generated, {r.usage.prompt_tokens} prompt "
              f"({r.usage.image_tokens} image tokens, {r.usage.cached_images} cached images)")
        print(f"    time split (ms): queue {t.queue * 1e3:.1f}  preprocess {t.preprocess * 1e3:.1f}  "
              f"encode {t.encode * 1e3:.1f}  "
              f"transfer {t.transfer * 1e3:.1f}  prefill {t.prefill * 1e3:.1f}  decode {t.decode * 1e3:.1f}  "
              f"total {t.total * 1e3:.1f}")
    total = sum(e.assigned_patches for e in encoders) or 1
    print("\nencoders:")
    for e in encoders:
        print(f"    {e.address}  {e.state:<10} {e.assigned_images} images  {e.assigned_patches} patches "
              f"({100 * e.assigned_patches / total:.0f}% of patches)")
        if e.report is not None:
            r = e.report
            print(f"        last load report {e.report_age_seconds:.2f}s ago: {r['queued_patches']:.0f} patches, "
                  f"{r['images_in_flight']:.0f} images in flight, drains in {r['drain_seconds']:.3f}s, "
                  f"{100 * r['utilization']:.0f}% busy")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def start_child(name: str, args: list[str], log_dir: Path) -> NodeProcess:
    env = {k: v for k, v in NODE_ENV_DEFAULTS.items() if k not in os.environ}
    return NodeProcess(args, env=env, name=name, log_dir=log_dir)


def run(args: argparse.Namespace) -> int:
    # SIGTERM takes the Ctrl-C path, so the children are always stopped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    children: list[NodeProcess] = []
    log_dir = Path(tempfile.mkdtemp(prefix="encdis-demo-"))
    rc = 1
    try:
        model = ensure_checkpoint(args.model)
        print(f"checkpoint: {model}", flush=True)
        t0 = time.monotonic()
        for i in range(args.encoders):
            children.append(start_child(f"encoder-{i}", ["encoder", "--model", str(model), "--host", "127.0.0.1",
                                                         "--port", "0"], log_dir))
        for c in children:
            c.wait_ready(args.start_timeout)
        for c in children:
            print(f"{c.name} ready at {c.address} (pid {c.pid})", flush=True)
        print("starting the LLM node (vLLM, vision tower not loaded) ...", flush=True)
        llm = start_child("llm", ["llm", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                                  "--encoders", ",".join(c.address for c in children)], log_dir)
        children.append(llm)
        llm.wait_ready(args.start_timeout)
        print(f"LLM node ready at {llm.address} (pid {llm.pid}, vision-tower parameters in vLLM: "
              f"{llm.info.get('vision_tower_parameters')}) after {time.monotonic() - t0:.0f}s", flush=True)
        answers, encoders = asyncio.run(send_requests(llm.address, args.max_tokens))
        print_report(answers, encoders)
        rc = 0
        return rc
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the nodes", file=sys.stderr, flush=True)
        rc = 130
        return rc
    except Exception as e:  # report, then clean up below
        print(f"encdis demo failed: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for c in reversed(children):  # LLM node first: it stops sending work to the encoders
            c.terminate()
        for c in reversed(children):
            c.stop(timeout=30)
        if children:
            print("all nodes stopped", flush=True)
        if rc == 0:
            shutil.rmtree(log_dir, ignore_errors=True)  # kept when something went wrong
        else:
            print(f"node logs kept in {log_dir}", file=sys.stderr, flush=True)
