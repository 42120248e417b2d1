"""What a CPU LLM node keeps after concurrent image requests: glibc's heap in vLLM's worker.

One request at a time, a node's tree grows by its flags and a small margin after 100 distinct
images (tests/e2e/test_llm_memory.py). With several in flight, vLLM's CPU worker keeps more: its
steps' tensors (a few requests' embeddings and activations, MiBs each) come from glibc's heap
once glibc's mmap threshold has risen past them (it follows the largest block freed, up to
32 MiB), and the holes they leave stay with the process. A fixed threshold
(MALLOC_MMAP_THRESHOLD_ in the node's environment, which its engine processes inherit) returns
every larger block at its free, and pays a fresh page's fault for each page reused. Side by side,
alternating, each round a fresh node per variant: the tree's PSS growth over --images distinct
images (after a warm-up) and requests/s.

    python -m bench.handoff.worker_heap [--images 96] [--in-flight 8] [--hidden 3584] [--rounds 2]
                                [--threshold-mib 4] [--json out.json]

Measured (`python -m bench.handoff.worker_heap --rounds 2`, 448x448 images, --cache-bytes 16 MiB):
the table is in bench/README.md (Handoff): the fixed threshold's growth is 0.18x the dynamic one's,
at 0.94x the requests/s.

Whether the dynamic threshold's heap grows depends on how a run's steps happen to interleave;
where it does not grow, it is no faster than the fixed one: the speed it has is the pages it keeps.
The node does not set the threshold: on GPU the workers' step tensors are on the device, and on
CPU it costs up to a tenth of the throughput. deploy/README.md says when to set it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.handoff.memory import CACHE_BYTES, tree_pss_mib, wide_checkpoint
from encdis.client import GenerateClient
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.demo import synthetic_photo

WARMUP = 16


def run_variant(ckpt: Path, encoder: NodeProcess, env: dict[str, str], args: argparse.Namespace, seed: int) -> dict:
    llm = start_node(["llm", "--model", str(ckpt), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                      "--encoders", encoder.address, "--cache-bytes", str(CACHE_BYTES)],
                     env={**os.environ, **env}, timeout=900)
    try:
        with GenerateClient(llm.address, timeout=300) as client:

            def one(i: int) -> None:
                image = synthetic_photo(448, 448, seed=seed + i)
                client.generate("Describe the picture.", [image], max_tokens=16, ignore_eos=True)

            with ThreadPoolExecutor(args.in_flight) as pool:
                list(pool.map(one, range(WARMUP)))
                start = tree_pss_mib(llm)
                t0 = time.perf_counter()
                list(pool.map(one, range(WARMUP, WARMUP + args.images)))
                seconds = time.perf_counter() - t0
        return {"pss_growth_mib": tree_pss_mib(llm) - start, "req_per_s": args.images / seconds}
    finally:
        llm.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=96, help="distinct images measured (after the warm-up)")
    p.add_argument("--in-flight", type=int, default=8, help="requests in flight at once")
    p.add_argument("--hidden", type=int, default=3584, help="embedding width (3584: 7B, 8192: 72B)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threshold-mib", type=int, default=4, help="the fixed threshold compared")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    # glibc ignores a threshold above its 32 MiB maximum and keeps its dynamic one.
    variants = {"glibc's dynamic threshold": {"MALLOC_MMAP_THRESHOLD_": str(2**30)},
                f"MALLOC_MMAP_THRESHOLD_ {args.threshold_mib} MiB":
                    {"MALLOC_MMAP_THRESHOLD_": str(args.threshold_mib * 2**20)}}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="encdis-worker-heap-") as tmp:
        ckpt = wide_checkpoint(Path(tmp), args.hidden)
        encoder = start_node(["encoder", "--model", str(ckpt), "--host", "127.0.0.1", "--port", "0"], timeout=300)
        try:
            names = list(variants)
            for r in range(args.rounds):
                for name in names[r % 2:] + names[:r % 2]:
                    # New images every round and variant: the encoder's cache answers none of them.
                    seed = 100_000 * (1 + r) + 10_000 * names.index(name)
                    runs[name].append(run_variant(ckpt, encoder, variants[name], args, seed))
                    print(name, runs[name][-1], flush=True)
        finally:
            encoder.stop()
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("pss_growth_mib", "req_per_s")}
           for name, rs in runs.items()}
    dynamic, fixed = (med[n] for n in variants)
    print(f"\n{args.images} distinct 448x448 images, {args.in_flight} in flight, embeddings {args.hidden} wide, "
          f"medians of {args.rounds} rounds")
    print(f"  {'variant':<30}{'PSS growth MiB':>16}{'req/s':>9}")
    for name, m in med.items():
        print(f"  {name:<30}{m['pss_growth_mib']:>16.0f}{m['req_per_s']:>9.2f}")
    print(f"  {'fixed / dynamic':<30}{fixed['pss_growth_mib'] / dynamic['pss_growth_mib']:>16.2f}"
          f"{fixed['req_per_s'] / dynamic['req_per_s']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)}, "runs": runs,
                                         "medians": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
