"""GPU check of the encoder node at Qwen2.5-VL-7B's real vision size (random weights), run by gpu_check.sh.

    bench/gpu/check.sh                                     # one H200: cuda:0, bf16, 1080p images
    bench/gpu/check.sh --device cpu --depth 2 --images 4 --size 448 --rounds 1 --transport-rounds 1   # a CPU proof run

    python -m bench.gpu.check [--device cuda:0] [--depth 32] [--images 48] [--size 1920x1080]
                              [--per-request 2] [--callers 4] [--rounds 2] [--max-batch-patches 65536]
                              [--preprocess-workers 2] [--peak-tflops 989] [--transport-rounds 3]
                              [--model DIR] [--json out.json]

It builds a random checkpoint with Qwen2.5-VL-7B's vision config (depth 32, hidden 1280, 16
heads, out_hidden_size 3584, ...) and a two-layer language model of hidden 3584 (never loaded
by an encoder), through encdis.tiny_checkpoint. Then, the modes alternating for --rounds
rounds (median reported), on the same images:

  tower only   the node's VisionTower called in this process on pixel values prepared beforehand,
               in batches under the node's patch budget: the device's own speed, source of the MFU;
  in-process   bench/overhead/encoder_node.py's InProcess: the node's preprocessing + tower, one
               forward per request, no gRPC;
  gRPC node    a real `encdis encoder` subprocess on loopback (encdis.launcher), called by
               --callers concurrent EncoderClients so that batches form.

It prints patches/s, images per forward, the ratios, the model FLOP utilisation (formula printed;
FLOP counted from the vision config), the attention implementation transformers picked, and
then runs `bench/data_plane/transport.py --no-lag` (the gRPC data plane vs raw TCP) on the same machine.
Nothing here needs vLLM or a network.

`python -m bench.gpu.check --source-tree DIR` only writes DIR/encdis: pyproject's package-dir
(client/, encoder_node/, llm_node/ are subpackages of `encdis`) as symbolic links, so that
PYTHONPATH=DIR imports the source tree without installing it (gpu_check.sh does this).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# bench.* from the tree; appended, so an encdis assembled on PYTHONPATH (gpu_check.sh) comes first:
# ROOT's own ./encdis lacks its subpackages.
sys.path.append(str(ROOT))

# Qwen2.5-VL-7B-Instruct's vision_config (its config.json on the hub), weights random.
QWEN25_VL_7B_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=3584,
    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu",
)
# Two layers of a 7B-width language model: hidden 3584 is what out_hidden_size feeds; 28 heads of
# 128 with mrope_section summing to head_dim / 2, as the 7B's. Encoders never load it.
TEXT_7B_WIDTH = dict(
    hidden_size=3584, intermediate_size=3584, num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
H200_BF16_DENSE_TFLOPS = 989.0


# ---- the source tree as the `encdis` package ----------------------------------------------


def write_source_tree(dest: Path) -> Path:
    """dest/encdis laid out as pyproject.toml's package-dir says, out of symbolic links."""
    import tomllib

    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    pkg = dest / "encdis"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / package_dir["encdis"]).iterdir():  # the top package: its files, one link each
        if entry.name != "__pycache__" and not (pkg / entry.name).exists():
            (pkg / entry.name).symlink_to(entry)
    for name, folder in package_dir.items():  # subpackages kept elsewhere in the tree
        if name != "encdis":
            link = dest / name.replace(".", "/")
            if not link.exists():
                link.symlink_to(ROOT / folder, target_is_directory=True)
    return dest


# ---- FLOP count --------------------------------------------------------------------------


def flop_coefficients(vc: dict) -> dict[str, float]:
    """FLOP of one image of N patches = linear * N + window * N + full * N^2 (multiply-add = 2 FLOP).

    linear: per patch, each block's qkv + proj (4 d^2) and MLP (3 d I), the patch embedding
    (C T P^2 d) and the merger (two matmuls per merged token, shared by merge^2 patches);
    window:  each windowed block's QK^T and AV within windows of (window_size / patch)^2 patches;
    full:    each full-attention block's QK^T and AV over the whole image: 4 d N^2.
    For Qwen2.5-VL-7B: 1.29e9 * N + 9.2e6 * N + 2.05e4 * N^2 (DESIGN.md: ~1.3 GFLOP, ~2e4).
    """
    d, i, depth = vc["hidden_size"], vc["intermediate_size"], vc["depth"]
    full_blocks = len([b for b in vc["fullatt_block_indexes"] if b < depth])
    m2 = vc["spatial_merge_size"] ** 2
    embed = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2 * d
    merger = ((m2 * d) ** 2 + m2 * d * vc["out_hidden_size"]) / m2
    window_patches = (vc["window_size"] // vc["patch_size"]) ** 2
    return {
        "linear": 2 * (depth * (4 * d * d + 3 * d * i) + embed + merger),
        "window": 4 * d * window_patches * (depth - full_blocks),
        "full": 4 * d * full_blocks,
    }


def image_flop(coef: dict[str, float], n: int) -> float:
    return (coef["linear"] + coef["window"]) * n + coef["full"] * n * n


# ---- the modes ---------------------------------------------------------------------------


def in_process_tower(model: Path, device: str, dtype: str, workers: int):
    """encoder_overhead's InProcess (node's preprocessing + tower), with the node's preprocessing threads."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.overhead.encoder_node import InProcess

    ip = InProcess(model, device, dtype)
    # The node under test runs with --preprocess-workers too: both paths get the same threads.
    ip._preprocess.shutdown()
    ip._preprocess = ThreadPoolExecutor(workers)
    return ip


def budget_batches(prepared: list, max_patches: int) -> list[list]:
    """Arrival order, as many images as fit the patch budget (one larger than it runs alone), as the batcher."""
    batches: list[list] = [[]]
    for p in prepared:
        if batches[-1] and sum(q.num_patches for q in batches[-1]) + p.num_patches > max_patches:
            batches.append([])
        batches[-1].append(p)
    return batches


def run_tower_only(ip, batches: list[list]) -> dict:
    """Forwards only (CPU tensors out, so each ends synchronised), in the worker thread the node uses too."""

    def forward_all() -> dict:
        t0 = time.perf_counter()
        for b in batches:
            ip.tower.forward([p.pixel_values for p in b], [p.grid_thw for p in b])
        return {"seconds": time.perf_counter() - t0, "patches": sum(p.num_patches for b in batches for p in b),
                "mean_images_per_forward": sum(len(b) for b in batches) / len(batches)}

    return ip._worker.submit(forward_all).result()


def attention_report(ip) -> dict:
    import importlib.util

    import torch
    import transformers

    info = {"attn_implementation": ip.tower.model.config._attn_implementation,
            "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.machine()}
    return info


def run_transport(rounds: int, out: Path) -> dict | None:
    """bench/data_plane/transport.py --no-lag in its own process (it starts its own sender process)."""
    transport = ROOT / "bench" / "data_plane" / "transport.py"
    cmd = [sys.executable, str(transport), "--rounds", str(rounds), "--no-lag", "--json", str(out)]
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.run(cmd, timeout=600).returncode
    if rc != 0:
        print(f"transport.py exited with {rc}")
        return None
    return json.loads(out.read_text())


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu (as the node)")
    p.add_argument("--depth", type=int, default=QWEN25_VL_7B_VISION["depth"],
                   help="vision blocks (full-attention blocks beyond it are dropped; at least one stays)")
    p.add_argument("--model", type=Path, help="an existing checkpoint instead of the random 7B-size one")
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--size", default="1920x1080", help="WIDTHxHEIGHT, or one number for a square")
    p.add_argument("--per-request", type=int, default=2, help="images per Encode call / in-process forward")
    p.add_argument("--callers", type=int, default=4, help="concurrent callers of the node, so batches form")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of every mode (median reported)")
    p.add_argument("--max-batch-patches", type=int, default=65536, help="the node's patch budget (6 1080p images)")
    p.add_argument("--preprocess-workers", type=int, default=2, help="preprocessing threads (node default: 2)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"peak for MFU (default {H200_BF16_DENSE_TFLOPS:.0f}, H200 bf16 dense, on cuda; none on cpu)")
    p.add_argument("--transport-rounds", type=int, default=3, help="bench/data_plane/transport.py --rounds; 0 skips it")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--source-tree", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_checkpoint(args: argparse.Namespace, tmp: Path) -> tuple[Path, str]:
    if args.model is not None:
        return args.model, str(args.model)
    from bench.data_plane.transport import MAX_PIXELS  # the released checkpoints' processor bound: 4K stays 4K
    from encdis.tiny_checkpoint import make_tiny_checkpoint

    vision = dict(QWEN25_VL_7B_VISION, depth=args.depth)
    vision["fullatt_block_indexes"] = [b for b in vision["fullatt_block_indexes"] if b < args.depth] or [
        args.depth - 1]
    model = make_tiny_checkpoint(tmp / "qwen25vl-7b-vision-random", seed=0, shards=2, vision_overrides=vision,
                                 text_overrides=TEXT_7B_WIDTH, max_pixels=MAX_PIXELS)
    return model, f"random Qwen2.5-VL-7B vision config, depth {args.depth}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.source_tree is not None:
        print(write_source_tree(args.source_tree))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # The node reads these as defaults of its flags (encoder_node/settings.py): the same
    # preprocessing threads as the in-process path, and a queue that never refuses the callers.
    os.environ["ENCDIS_PREPROCESS_WORKERS"] = str(args.preprocess_workers)
    os.environ["ENCDIS_MAX_QUEUED_PATCHES"] = str(1 << 24)
    from bench.overhead.encoder_node import make_images, requests_of, run_grpc, start_encoder
    from encdis.checkpoint import read_vision_config

    width, height = (int(v) for v in (args.size.lower().split("x") * 2)[:2])
    peak = args.peak_tflops if args.peak_tflops is not None else (
        H200_BF16_DENSE_TFLOPS if args.device.startswith("cuda") else None)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="encdis-gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        model, model_name = build_checkpoint(args, tmp)
        t_ckpt = time.perf_counter() - t_start
        print(f"checkpoint: {model_name} ({t_ckpt:.1f}s)", flush=True)
        images = make_images(args.images, width, height)
        requests = requests_of(images, args.per_request)
        ip = in_process_tower(model, args.device, args.dtype, args.preprocess_workers)
        prepared = list(ip._preprocess.map(lambda item: ip.pre.prepare(item[0], item[1], *ip.bounds),
                                           enumerate(images)))
        batches = budget_batches(prepared, args.max_batch_patches)
        run_tower_only(ip, batches[:1])  # warm-up
        t0 = time.perf_counter()
        node = start_encoder(model, args.device, args.dtype, args.max_batch_patches)
        t_node = time.perf_counter() - t0
        print(f"encoder node {node.address} ready in {t_node:.1f}s (pid {node.pid})", flush=True)
        modes = [("tower only (prepared pixels)", 1), ("in-process (preprocess + tower)", 1),
                 ("gRPC node", args.callers)]
        runs: dict[tuple[str, int], list[dict]] = {m: [] for m in modes}
        try:
            for r in range(args.rounds):
                for mode in modes:
                    if mode[0].startswith("tower"):
                        run = run_tower_only(ip, batches)
                    elif mode[0].startswith("in-process"):
                        run = ip.run(requests)
                        run["mean_images_per_forward"] = statistics.mean(len(q) for q in requests)
                    else:
                        run = run_grpc(node.address, requests, args.callers)
                    runs[mode].append(run)
                    print(f"  round {r + 1}: {mode[0]:32} {run['seconds']:.2f}s", flush=True)
        finally:
            node.stop(60)
        attention = attention_report(ip)
        coef = flop_coefficients(read_vision_config(model))

    n = prepared[0].num_patches  # all images have the same size
    flop = image_flop(coef, n) * args.images
    rows = []
    for (mode, callers), results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        rows.append({"mode": mode, "callers": callers, "seconds": seconds, "patches": results[0]["patches"],
                     "patches_per_second": results[0]["patches"] / seconds,
                     "images_per_second": args.images / seconds,
                     "mean_images_per_forward": statistics.mean(r["mean_images_per_forward"] for r in results),
                     "tflops": flop / seconds / 1e12})
    for r in rows:
        r["vs_tower_only"] = r["patches_per_second"] / rows[0]["patches_per_second"]
        r["vs_in_process"] = r["patches_per_second"] / rows[1]["patches_per_second"]
        r["mfu"] = r["tflops"] / peak if peak else None

    print(f"\n{args.images} images of {width}x{height} ({n} patches, grid {prepared[0].grid_thw}), "
          f"{args.per_request} per request, device {args.device}, dtype {ip.tower.dtype}, {model_name}")
    header = (f"{'mode':32} {'callers':>7} {'median s':>8} {'patches/s':>10} {'img/fwd':>7} {'TFLOP/s':>8} "
              f"{'MFU':>6} {'vs tower':>8} {'vs in-proc':>10}")
    print(header, "-" * len(header), sep="\n")
    for r in rows:
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
        print(f"{r['mode']:32} {r['callers']:>7} {r['seconds']:>8.2f} {r['patches_per_second']:>10.0f} "
              f"{r['mean_images_per_forward']:>7.1f} {r['tflops']:>8.2f} {mfu:>6} {r['vs_tower_only']:>8.2f} "
              f"{r['vs_in_process']:>10.2f}")
    from encdis.llm_node.coordinator.cost_model import GFLOP_PER_PATCH, N2_OVER_N

    print(f"\nMFU = FLOP / seconds / peak; FLOP per image of N patches = "
          f"{coef['linear']:.3g}*N (linear) + {coef['window']:.3g}*N (window attention) + "
          f"{coef['full']:.3g}*N^2 (full attention), counted from the vision config; "
          f"N = {n}: {image_flop(coef, n) / 1e12:.3f} TFLOP per image")
    peak_text = f"{peak:.0f} TFLOP/s" if peak else "none on cpu (give --peak-tflops), MFU not computed"
    if peak and args.peak_tflops is None:
        peak_text += " (H200 bf16 dense)"
    print(f"  the coordinator's prior (cost_model.py) for the 7B tower: {GFLOP_PER_PATCH}e9*N + "
          f"{GFLOP_PER_PATCH * 1e9 * N2_OVER_N:.3g}*N^2; peak: {peak_text}")
    print(f"attention implementation: {attention['attn_implementation']} (config._attn_implementation of the "
          f"tower; flash_attn package {'installed' if attention['flash_attn_installed'] else 'absent'}); "
          f"torch {attention['torch']}, transformers {attention['transformers']}, {attention['device_name']}")
    print(f"setup: checkpoint {t_ckpt:.1f}s, node start {t_node:.1f}s", flush=True)

    transport = None
    if args.transport_rounds > 0:
        with tempfile.TemporaryDirectory(prefix="encdis-gpu-check-") as tmp_name:
            transport = run_transport(args.transport_rounds, Path(tmp_name) / "transport.json")
    total = time.perf_counter() - t_start
    print(f"\ngpu_check done in {total:.0f}s")
    if args.json:
        result = {
            "benchmark": "gpu_check", "device": args.device, "dtype": str(ip.tower.dtype), "model": model_name,
            "images": args.images, "size": [width, height], "patches_per_image": n,
            "grid_thw": list(prepared[0].grid_thw), "per_request": args.per_request, "rounds": args.rounds,
            "max_batch_patches": args.max_batch_patches, "preprocess_workers": args.preprocess_workers,
            "flop_coefficients": coef, "flop_per_image": image_flop(coef, n), "peak_tflops": peak,
            **attention, "rows": rows, "transport": transport,
            "seconds": {"checkpoint": t_ckpt, "node_start": t_node, "total": total},
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
