"""End-to-end benchmark: the same requests through encdis and through monolithic vLLM.

encdis: two encoder nodes + one LLM node (vision tower not loaded), real processes on
loopback, driven through the gRPC client. Monolithic: vLLM with its own tower, in this
process (no gRPC in front, so the comparison charges encdis for its front door too). Each
system is warmed up, then serves the same requests at the same concurrency; every request
has its own images (no cache hits on either side). Prints a table of requests/s and
mean/p99 time to first token, with encdis/monolithic ratios, and writes it as JSON.

    python -m bench.serving.e2e [--model DIR] [--requests 32] [--concurrency 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Image sizes cycled through (width, height): 8x8 to 16x12 merged tokens per image.
SIZES = [(224, 224), (336, 168), (84, 112), (448, 336), (280, 280)]


def make_requests(n: int, max_images: int) -> list[tuple[str, list[bytes]]]:
    from encdis.llm_node.demo import synthetic_photo

    out = []
    for i in range(n):
        k = 1 + i % max_images
        images = [synthetic_photo(*SIZES[(i + j) % len(SIZES)], seed=1000 + i * 8 + j) for j in range(k)]
        out.append((f"Request {i}: describe the pictures.", images))
    return out


def p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


async def drive(one, requests, concurrency: int) -> dict:
    """Run `one(prompt, images) -> ttft` over all requests, `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def task(prompt, images):
        async with sem:
            ttfts.append(await one(prompt, images))

    t0 = time.perf_counter()
    await asyncio.gather(*(task(p, ims) for p, ims in requests))
    wall = time.perf_counter() - t0
    return {"requests": len(requests), "wall_seconds": wall, "requests_per_second": len(requests) / wall,
            "ttft_mean_seconds": statistics.fmean(ttfts), "ttft_p99_seconds": p99(ttfts)}


def bench_encdis(model: Path, requests, warmup, args) -> dict:
    from encdis.client.generate_client import AsyncGenerateClient
    from encdis.launcher import NodeProcess

    log_dir = Path(tempfile.mkdtemp(prefix="encdis-bench-"))
    children: list[NodeProcess] = []
    try:
        for i in range(args.encoders):
            children.append(NodeProcess(["encoder", "--model", str(model), "--host", "127.0.0.1", "--port", "0"],
                                        name=f"encoder-{i}", log_dir=log_dir))
        for c in children:
            c.wait_ready(900)
        llm = NodeProcess(["llm", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                           "--encoders", ",".join(c.address for c in children),
                           "--max-num-seqs", str(args.concurrency)], name="llm", log_dir=log_dir)
        children.append(llm)
        address = llm.wait_ready(900).address

        async def main() -> dict:
            async with AsyncGenerateClient(address, timeout=600) as client:
                async def one(prompt, images) -> float:
                    t0 = time.perf_counter()
                    ttft = None
                    async for c in client.generate_stream(prompt, images, max_tokens=args.max_tokens,
                                                          ignore_eos=True):
                        if ttft is None and c.token_ids:
                            ttft = time.perf_counter() - t0
                    return ttft

                await drive(one, warmup, args.concurrency)
                res = await drive(one, requests, args.concurrency)
                res["encoders"] = [
                    {"address": e.address, "assigned_images": e.assigned_images,
                     "assigned_patches": e.assigned_patches} for e in await client.list_encoders()]
                return res

        return asyncio.run(main())
    finally:
        for c in reversed(children):
            c.terminate()
        for c in reversed(children):
            c.stop(timeout=30)


def bench_monolithic(model: Path, requests, warmup, args) -> dict:
    from encdis.llm_node.engine import SamplingSpec
    from encdis.llm_node.reference import MonolithicRunner, reference_settings

    runner = MonolithicRunner(reference_settings(model, max_num_seqs=args.concurrency), max_images=args.max_images)
    runner.start()
    sampling = SamplingSpec(max_tokens=args.max_tokens, ignore_eos=True)
    try:
        async def main() -> dict:
            async def one(prompt, images) -> float:
                t0 = time.perf_counter()
                ttft = None
                async for d in runner.generate(prompt, images, sampling):
                    if ttft is None and d.token_ids:
                        ttft = time.perf_counter() - t0
                return ttft

            await drive(one, warmup, args.concurrency)
            return await drive(one, requests, args.concurrency)

        return asyncio.run(main())
    finally:
        runner.shutdown()


def table(enc: dict, mono: dict) -> str:
    rows = [("", "requests/s", "mean TTFT (s)", "p99 TTFT (s)")]
    for name, r in (("encdis (2 encoders)", enc), ("monolithic vLLM", mono)):
        rows.append((name, f"{r['requests_per_second']:.3f}", f"{r['ttft_mean_seconds']:.3f}",
                     f"{r['ttft_p99_seconds']:.3f}"))
    rows.append(("encdis / monolithic", f"{enc['requests_per_second'] / mono['requests_per_second']:.2f}x",
                 f"{enc['ttft_mean_seconds'] / mono['ttft_mean_seconds']:.2f}x",
                 f"{enc['ttft_p99_seconds'] / mono['ttft_p99_seconds']:.2f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                                    strict=True)))
                     for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: a tiny one built in a temp dir)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-images", type=int, default=3, help="requests have 1..N images")
    p.add_argument("--encoders", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)

    model = args.model
    if model is None:
        from encdis.tiny_checkpoint import make_tiny_checkpoint

        model = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="encdis-bench-ckpt-")) / "tiny", seed=0, shards=3)
    requests = make_requests(args.requests, args.max_images)
    warmup = [(f"warm-up {p}", ims) for p, ims in make_requests(args.warmup + args.requests, args.max_images)
              [args.requests:]]
    mono = bench_monolithic(model, requests, warmup, args)
    enc = bench_encdis(model, requests, warmup, args)
    print(table(enc, mono))
    total = sum(e["assigned_patches"] for e in enc["encoders"]) or 1
    for e in enc["encoders"]:
        print(f"encoder {e['address']}: {e['assigned_images']} images, "
              f"{100 * e['assigned_patches'] / total:.0f}% of patches (warm-up included)")
    result = {
        "encdis": enc, "monolithic": mono,
        "ratios": {"requests_per_second": enc["requests_per_second"] / mono["requests_per_second"],
                   "ttft_mean": enc["ttft_mean_seconds"] / mono["ttft_mean_seconds"],
                   "ttft_p99": enc["ttft_p99_seconds"] / mono["ttft_p99_seconds"]},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()} | {"model": str(model)},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":  # vLLM starts its engine with spawn: the guard is required
    sys.exit(main())
