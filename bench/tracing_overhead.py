"""What tracing costs an encoder node: Encode calls with --otlp-traces-endpoint vs without, side by side.

    python bench/tracing_overhead.py [--model DIR] [--rounds 7] [--calls 20] [--images 4] [--json out.json]

Two encoder node processes on one checkpoint (default: a tiny one made for the run), one
exporting its spans over OTLP gRPC to a real TraceService receiver on 127.0.0.1
(tests/otlp_receiver.py), one with tracing off. Each call carries a W3C traceparent, as the
coordinator's do, so the traced node records the full tree (Encode, preprocess, and queue /
forward / send per image). Modes alternate within each round (a shared machine's load drifts);
the table gives each mode's median seconds per call and the median per-round ratio to off.
One warm-up round is not counted.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint directory (default: a tiny one made for the run)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="Encode calls per mode per round")
    p.add_argument("--images", type=int, default=4, help="images per call (448x448 PNG)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from encdis.launcher import NodeProcess
    from tests.otlp_receiver import OtlpReceiver

    with tempfile.TemporaryDirectory() as tmp, OtlpReceiver() as rx:
        model = args.model
        if model is None:
            from encdis.tiny_checkpoint import make_tiny_checkpoint

            model = Path(tmp) / "tiny"
            make_tiny_checkpoint(model)
        base = ["encoder", "--model", str(model), "--host", "127.0.0.1", "--port", "0"]
        nodes = {"off": NodeProcess(base), "on": NodeProcess([*base, "--otlp-traces-endpoint", rx.address])}
        try:
            for n in nodes.values():
                n.wait_ready(300)
            images = [png(448, 448, i) for i in range(args.images)]
            per_mode: dict[str, list[float]] = {m: [] for m in MODES}
            for r in range(args.rounds + 1):
                for m in (MODES if r % 2 else MODES[::-1]):
                    s = asyncio.run(round_seconds(nodes[m].address, images, args.calls))
                    if r:  # round 0 warms up
                        per_mode[m].append(s)
        finally:
            for n in nodes.values():
                n.stop()
        spans = len(rx.spans)
    ratios = [on / off for on, off in zip(per_mode["on"], per_mode["off"], strict=True)]
    result = {
        "machine": platform.platform(), "model": str(args.model or "tiny"), "rounds": args.rounds,
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
