"""Encoder node overhead: the same images through a node over gRPC vs the same tower in-process.

    python -m bench.overhead.encoder_node [--model DIR] [--images 48] [--size 448x448] [--per-request 4]
                                     [--concurrency 4] [--device cpu] [--json out.json]

In-process: the node's own ImagePreprocessor + VisionTower called directly, one forward per
request (no gRPC, no serialisation, no queue). Images are preprocessed by as many threads as
the node uses and the forward runs in one worker thread, as in the node (on an oversubscribed
CPU, OpenMP from the main thread was measured 1.5-4x slower than from a worker thread), so
the two paths differ only by gRPC, the queue and serialisation.

Over gRPC: a real `encdis encoder` process on loopback, called by EncoderClient with 1 and
with --concurrency callers (the node may then batch images of different calls together).
Same images, same request grouping, one run: the modes alternate for --rounds rounds (on a
shared machine load drifts within seconds) and each reports its median, printed side by side
with the throughput ratio (gRPC / in-process). Without --model a tiny random checkpoint is built in a temporary folder.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from encdis.launcher import NodeProcess, start_node

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def make_images(n: int, width: int, height: int) -> list[bytes]:
    """Distinct JPEGs (different seeds): the node never sees the same bytes twice."""
    import numpy as np
    from PIL import Image

    out = []
    for i in range(n):
        rng = np.random.default_rng(i)
        arr = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr, "RGB").save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def requests_of(images: list[bytes], per_request: int) -> list[list[bytes]]:
    return [images[i:i + per_request] for i in range(0, len(images), per_request)]


class InProcess:
    """The node's own preprocessing and tower, called directly in this process."""

    def __init__(self, model: Path, device: str, dtype: str) -> None:
        from encdis.checkpoint import weights_fingerprint
        from encdis.encoder_node.preprocess import ImagePreprocessor
        from encdis.encoder_node.settings import EncoderSettings
        from encdis.encoder_node.tower import VisionTower

        s = EncoderSettings(model=model, device=device, dtype=dtype)
        self.tower = VisionTower(model, device=device, dtype=s.torch_dtype_name)
        self.pre = ImagePreprocessor(model, weights_fingerprint=weights_fingerprint(model),
                                     max_image_bytes=s.max_image_bytes, max_image_pixels=s.max_image_pixels)
        self.bounds = self.pre.resolve_bounds(0, 0)
        self._worker = ThreadPoolExecutor(1)
        # The node's preprocessing threads, so the two paths differ only by gRPC, queue and serialisation.
        self._preprocess = ThreadPoolExecutor(s.preprocess_workers)

    def _one(self, req: list[bytes]) -> int:
        prepared = list(self._preprocess.map(lambda item: self.pre.prepare(item[0], item[1], *self.bounds),
                                             enumerate(req)))
        outs = self.tower.forward([p.pixel_values for p in prepared], [p.grid_thw for p in prepared])
        _ = [o.numpy().tobytes() for o in outs]  # the node too must have the bytes on the host
        return sum(p.num_patches for p in prepared)

    def _all(self, requests: list[list[bytes]]) -> dict:
        t0 = time.perf_counter()
        patches = sum(self._one(r) for r in requests)
        return {"seconds": time.perf_counter() - t0, "patches": patches}

    def run(self, requests: list[list[bytes]]) -> dict:
        self._worker.submit(self._one, requests[0]).result()  # warm-up
        return self._worker.submit(self._all, requests).result()


def start_encoder(model: Path, device: str, dtype: str, max_batch_patches: int) -> NodeProcess:
    """`encdis encoder` on loopback, returned once it printed its ready line."""
    return start_node(["encoder", "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--device", device,
                       "--dtype", dtype, "--max-batch-patches", str(max_batch_patches), "--log-level", "WARNING"],
                      timeout=600)


def run_grpc(address: str, requests: list[list[bytes]], concurrency: int) -> dict:
    from encdis.client import EncoderClient

    with EncoderClient(address, timeout=600) as client:
        client.encode(requests[0])  # warm-up (connection, first forward)
        batches: list[int] = []

        def one(req: list[bytes]) -> int:
            embs = client.encode(req)
            batches.extend(len(e.batch.image_patches) for e in embs if e.batch is not None)
            return sum(e.num_patches for e in embs)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            patches = sum(pool.map(one, requests))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "patches": patches, "mean_images_per_forward": sum(batches) / max(len(batches), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint directory (default: a tiny random one)")
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--size", default="448x448", help="WIDTHxHEIGHT of every image")
    p.add_argument("--per-request", type=int, default=4, help="images per Encode call")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent callers in the second gRPC run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-batch-patches", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of every mode (median reported)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    width, height = (int(v) for v in args.size.lower().split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from encdis.tiny_checkpoint import make_tiny_checkpoint

            model = make_tiny_checkpoint(Path(tmp) / "tiny", seed=0, shards=1)
        images = make_images(args.images, width, height)
        requests = requests_of(images, args.per_request)

        modes = [("in-process (preprocess + tower)", 1), ("gRPC node", 1)]
        if args.concurrency > 1:
            modes.append(("gRPC node", args.concurrency))
        runs: dict[tuple[str, int], list[dict]] = {m: [] for m in modes}
        in_process = InProcess(model, args.device, args.dtype)
        node = start_encoder(model, args.device, args.dtype, args.max_batch_patches)
        try:
            address = node.address
            for _ in range(args.rounds):
                for name, callers in modes:
                    in_proc = name.startswith("in-process")
                    run = in_process.run(requests) if in_proc else run_grpc(address, requests, callers)
                    runs[(name, callers)].append(run)
        finally:
            node.stop(60)

    rows = []
    for (mode, callers), results in runs.items():
        seconds = sorted(r["seconds"] for r in results)
        median = statistics.median(seconds)
        rows.append({"mode": mode, "concurrency": callers, "seconds": median, "seconds_min": seconds[0],
                     "seconds_max": seconds[-1], "patches": results[0]["patches"],
                     **({"mean_images_per_forward": statistics.mean(r["mean_images_per_forward"] for r in results)}
                        if "mean_images_per_forward" in results[0] else {})})
    base = args.images / rows[0]["seconds"]
    for r in rows:
        r["images_per_second"] = args.images / r["seconds"]
        r["patches_per_second"] = r["patches"] / r["seconds"]
        r["ratio_vs_in_process"] = r["images_per_second"] / base

    print(f"\n{args.images} images of {width}x{height}, {args.per_request} per request, "
          f"device {args.device}, model {args.model or 'tiny (random)'}")
    header = (f"{'mode':34} {'callers':>7} {'median s':>8} {'min-max s':>12} {'images/s':>9} {'patches/s':>10} "
              f"{'img/fwd':>7} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        spread = f"{r['seconds_min']:.2f}-{r['seconds_max']:.2f}"
        per_fwd = r.get("mean_images_per_forward", args.per_request)
        print(f"{r['mode']:34} {r['concurrency']:>7} {r['seconds']:>8.2f} {spread:>12} {r['images_per_second']:>9.1f} "
              f"{r['patches_per_second']:>10.0f} {per_fwd:>7.1f} {r['ratio_vs_in_process']:>6.2f}")
    if args.json:
        result = {
            "benchmark": "encoder_overhead",
            "images": args.images, "size": [width, height], "per_request": args.per_request, "rounds": args.rounds,
            "device": args.device, "dtype": args.dtype, "model": str(args.model or "tiny"),
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "rows": rows,
        }
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
