"""Handoff benchmark: what the LLM node holds and spends after the coordinator has an embedding.

Real processes on loopback: one encoder node and one LLM node on a random checkpoint whose
language model is as wide as a real one (--hidden, 2048 by default: a 448x448 image is 256
rows, 2 MiB of float32 embedding; 3584 is Qwen2.5-VL-7B's width, 8192 72B's). N distinct
images go through one at a time (one image per request, one generated token), with the
node's own embedding cache small (--cache-bytes 16 MiB). Side by side, the same run with the
embeddings in vLLM's requests (--handoff embeds) and vLLM's multimodal processor cache at its
default (4 GiB, what the node passed before) and at 0 (the coordinator's cache is the node's one
embedding cache), and through the shared region (--handoff region, the node's default; vLLM's
processor cache then holds grids only):

- growth of the node's RSS with all its children (vLLM's EngineCore and workers) from after
  the warm-up to the end, against the embedding bytes sent (what a per-image copy would hold);
- mean and p99 request latency (the handoff's cost shows here if dropping the cache costs).

    python -m bench.handoff.memory [--images 100] [--hidden 2048] [--json out.json]

Exits 1 when the node with its defaults grows (PSS of its tree: pages its processes
share count once) by more than its --cache-bytes plus a fixed margin (--margin-mib).

The time from the coordinator's last byte to the first token, the copies on the way and the
event loop's lag are measured by bench/handoff/latency.py.

Measured (`python -m bench.handoff.memory --images 100 --hidden 3584`, 350 MiB of embeddings sent):
the node's tree grew by PSS 423 MiB with vLLM's processor cache at 4 GiB (the node's flags
before) and 47 MiB at 0; the three routes side by side another day are in bench/README.md
(Handoff).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.reliability.soak_report import rss  # noqa: E402
from encdis.client import GenerateClient  # noqa: E402
from encdis.launcher import NodeProcess, start_node  # noqa: E402
from encdis.llm_node.demo import synthetic_photo  # noqa: E402
from encdis.tiny_checkpoint import make_wide_checkpoint  # noqa: E402

CACHE_BYTES = 16 * 1024 * 1024
# The node's flags per variant: the first is the baseline, the last the node's defaults.
VARIANTS = {"embeds, vllm cache 4 GiB": ["--handoff", "embeds", "--mm-processor-cache-gb", "4"],
            "embeds, vllm cache 0": ["--handoff", "embeds", "--mm-processor-cache-gb", "0"],
            "region (default)": ["--handoff", "region"]}
WARMUP = 4


def wide_checkpoint(root: Path, hidden: int, *, intermediate: int | None = None, max_tokens: int = 256) -> Path:
    """The random checkpoint of this width under `root` (encdis.tiny_checkpoint.make_wide_checkpoint)."""
    return make_wide_checkpoint(root / f"wide-{hidden}", hidden, intermediate=intermediate, max_tokens=max_tokens)


def tree_mib(node: NodeProcess) -> float:
    return sum(rss(node.pid).values())


def tree_pss_mib(node: NodeProcess) -> float:
    """The tree's proportional set size: pages shared between its processes (shared-memory
    tensors on their way to the engine core) count once, where RSS counts them per process."""
    import psutil

    root = psutil.Process(node.pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except psutil.NoSuchProcess:
            continue
    return total / 2**20


def run_variant(ckpt: Path, encoder: NodeProcess, flags: list[str], images: list[bytes]) -> dict:
    llm = start_node(["llm", "--model", str(ckpt), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                      "--encoders", encoder.address, "--cache-bytes", str(CACHE_BYTES), *flags], timeout=900)
    try:
        latencies = []
        rows = 0
        with GenerateClient(llm.address, timeout=300) as client:
            for i, image in enumerate(images):
                if i == WARMUP:
                    start_mib, start_pss = tree_mib(llm), tree_pss_mib(llm)
                t0 = time.perf_counter()
                result = client.generate("Describe the picture.", [image], max_tokens=1, ignore_eos=True)
                if i >= WARMUP:
                    latencies.append(time.perf_counter() - t0)
                    rows += result.usage.image_tokens
        end_mib, end_pss = tree_mib(llm), tree_pss_mib(llm)
        return {"flags": flags, "rss_start_mib": start_mib, "rss_end_mib": end_mib,
                "growth_mib": end_mib - start_mib, "pss_growth_mib": end_pss - start_pss, "rows": rows,
                "mean_s": statistics.fmean(latencies), "p99_s": sorted(latencies)[int(0.99 * (len(latencies) - 1))],
                "parts_mib": rss(llm.pid)}
    finally:
        llm.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=100, help="distinct images sent (after the warm-up)")
    p.add_argument("--hidden", type=int, default=2048, help="embedding width (3584: 7B, 8192: 72B)")
    p.add_argument("--margin-mib", type=float, default=64.0, help="growth allowed beyond --cache-bytes")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="encdis-handoff-") as tmp:
        ckpt = wide_checkpoint(Path(tmp), args.hidden)
        images = [synthetic_photo(448, 448, seed=1000 + i) for i in range(args.images + WARMUP)]
        encoder = start_node(["encoder", "--model", str(ckpt), "--host", "127.0.0.1", "--port", "0"], timeout=300)
        try:
            results = {name: run_variant(ckpt, encoder, flags, images) for name, flags in VARIANTS.items()}
        finally:
            encoder.stop()
    before, now = results[next(iter(VARIANTS))], results[list(VARIANTS)[-1]]
    sent_mib = now["rows"] * args.hidden * 4 / 2**20
    print(f"handoff: {args.images} distinct 448x448 images, embeddings {args.hidden} wide "
          f"({sent_mib:.0f} MiB sent), node --cache-bytes {CACHE_BYTES >> 20} MiB")
    print(f"  {'variant':<28}{'RSS growth MiB':>16}{'PSS growth MiB':>16}{'mean s':>10}{'p99 s':>10}")
    for name, r in results.items():
        print(f"  {name:<28}{r['growth_mib']:>16.0f}{r['pss_growth_mib']:>16.0f}{r['mean_s']:>10.3f}"
              f"{r['p99_s']:>10.3f}")
    ratio = now["growth_mib"] / before["growth_mib"] if before["growth_mib"] > 0 else float("nan")
    print(f"  growth now / before: {ratio:.2f}x; mean latency now / before: {now['mean_s'] / before['mean_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)}, "sent_mib": sent_mib,
                                         "results": results}, indent=2))
    bound = CACHE_BYTES / 2**20 + args.margin_mib
    if now["pss_growth_mib"] > bound:
        print(f"FAIL: the node grew by {now['pss_growth_mib']:.0f} MiB (PSS), more than {bound:.0f} MiB",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
