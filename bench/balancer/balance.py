"""Balance simulator: the real encdis assignment policy against round-robin, count split and vLLM's greedy.

Role: the entry point and the report. It runs every (workload, pool, load, policy) cell and the
one-shot batches, prints the tables and the target bars, and writes the rows as JSON. A
discrete-event simulation of a pool of encoder nodes, driving the REAL policy code
(encdis.llm_node.coordinator.assignment / cost_model / patches, imported, not copied) and vLLM's
own `get_load_balance_assignment`. The parts:
    bench/balancer/workloads.py  the world: image workloads, the true cost model, noise
    bench/balancer/sim.py        the policies, the discrete-event simulation, one-shot batches
    bench/balancer/balance.py            this file: the grid of cells, tables, bars, JSON, the command line

Model of the world (seeded, so every run prints the same table):
- Requests arrive as a Poisson process at `load` x the pool's capacity (capacity measured in the
  true cost model's seconds, so load 0.8 means the encoders are busy 80% of the time).
- Each image's patch count comes from its pixel size through the real `patches_for_image` with
  Qwen2.5-VL's processor bounds (min_pixels 3136, max_pixels 12845056).
- An encoder is a FIFO queue feeding batches: when idle it takes queued images in order while
  their patches fit the batch budget (always at least one) and runs them as one varlen forward
  costing the sum of its images' true costs `(c0 + c1*N + c2*N^2) / speed`, times lognormal noise
  (5%), and 1% of batches stall 2-4x (GC pauses, noisy neighbours). Every image of a batch is
  ready when the batch ends. The true coefficients differ from encdis's prior (other device
  speed, larger N^2 share, larger c0), so encdis must learn them.
- A request's encode latency is the time from its arrival until its last image is ready.
  The first 5% of requests of each run are warm-up and not counted (the same for all policies;
  encdis is still learning from its prior during them and after).
Policies (each sees the same arrivals and sizes: common random numbers):
- round_robin: image i of the whole stream to encoder i mod k (vLLM's EPD proxy, Dynamo).
- count_split: each request's images split into k contiguous, even-count chunks (SGLang), chunk j
  to encoder (j + r) mod k for request r.
- vllm_greedy: vLLM's own function on the request's patch counts, its GPU g mapped to encoder
  (g + r) mod k for request r. The rotation is ours: called literally (GPU g = encoder g) it sends
  every single-image request to encoder 0, which no one would deploy; rotating makes it a fair,
  backlog-blind baseline (for single-image requests it equals round_robin).
- encdis: `assign` on `Backlog.loads` with one online `CostModel` per encoder, starting from
  `CostModel.prior()` and learning from each batch's measured seconds, as the coordinator does.

One-shot batches: B images at once on an idle pool; makespan (true cost) over the lower bound
max(sum cost / sum speed, max item / max speed) (max(sum cost / k, max item) for identical
encoders). encdis uses models warmed on 60 observed batches per encoder.

    python -m bench.balancer.balance [--quick] [--json FILE] [--makespan-json FILE] [--requests N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from bench.balancer.sim import POLICIES, RunResult, one_shot, simulate
from bench.balancer.workloads import WORKLOADS

POOLS: dict[str, tuple[float, ...]] = {
    "4x": (1.0, 1.0, 1.0, 1.0),
    "4x_one_half": (1.0, 1.0, 1.0, 0.5),
    "8x": (1.0,) * 8,
}
LOADS = (0.5, 0.8, 0.95)
ONE_SHOT_IMAGES = 64
ONE_SHOT_TRIALS = 30


def run_all(requests: int, seed: int, workloads: Sequence[str], loads: Sequence[float], log=sys.stderr) -> list[dict]:
    rows: list[dict] = []
    for workload in workloads:
        for pool, speeds in POOLS.items():
            for load in loads:
                cell: dict[str, RunResult] = {}
                for policy in POLICIES:
                    started = time.perf_counter()
                    cell[policy] = simulate(workload, speeds, load, policy, requests, seed)
                    print(
                        f"  {workload:12s} {pool:11s} {load:.2f} {policy:11s} {time.perf_counter() - started:5.1f}s",
                        file=log,
                    )
                base = {p: (cell[p].quantile(0.5), cell[p].quantile(0.99)) for p in POLICIES}
                for policy in POLICIES:
                    p50, p99 = base[policy]
                    rows.append(
                        {
                            "workload": workload,
                            "pool": pool,
                            "load": load,
                            "policy": policy,
                            "p50_s": p50,
                            "p99_s": p99,
                            "mean_s": sum(cell[policy].latencies) / len(cell[policy].latencies),
                            "requests": len(cell[policy].latencies),
                            "busiest_utilisation": cell[policy].busiest_utilisation,
                            "drain_s": cell[policy].drain_s,
                            "p50_vs_round_robin": p50 / base["round_robin"][0],
                            "p99_vs_round_robin": p99 / base["round_robin"][1],
                            "p50_vs_vllm_greedy": p50 / base["vllm_greedy"][0],
                            "p99_vs_vllm_greedy": p99 / base["vllm_greedy"][1],
                        }
                    )
    return rows


def run_one_shot(seed: int, workloads: Sequence[str], trials: int, images: int) -> list[dict]:
    rows = []
    for workload in workloads:
        for pool, speeds in POOLS.items():
            ratios, tight = one_shot(workload, speeds, seed, trials, images)
            for policy in POLICIES:
                values = ratios[policy]
                tight_values = tight[policy]
                rows.append(
                    {
                        "workload": workload,
                        "pool": pool,
                        "policy": policy,
                        "images": images,
                        "makespan_over_bound_mean": sum(values) / len(values),
                        "makespan_over_bound_max": max(values),
                        "makespan_over_tight_bound_mean": sum(tight_values) / len(tight_values),
                        "makespan_over_tight_bound_max": max(tight_values),
                    }
                )
    return rows


def format_latency_table(rows: list[dict]) -> str:
    lines = [
        f"{'workload':12s} {'pool':11s} {'load':>4s} {'policy':11s} {'p50_s':>8s} {'p99_s':>8s}"
        f" {'p50/rr':>7s} {'p99/rr':>7s} {'p50/vllm':>8s} {'p99/vllm':>8s} {'busiest':>7s} {'drain_s':>7s}"
    ]
    for row in rows:
        lines.append(
            f"{row['workload']:12s} {row['pool']:11s} {row['load']:4.2f} {row['policy']:11s}"
            f" {row['p50_s']:8.4f} {row['p99_s']:8.4f} {row['p50_vs_round_robin']:7.3f}"
            f" {row['p99_vs_round_robin']:7.3f} {row['p50_vs_vllm_greedy']:8.3f} {row['p99_vs_vllm_greedy']:8.3f}"
            f" {row['busiest_utilisation']:7.3f} {row['drain_s']:7.2f}"
        )
    return "\n".join(lines)


def format_makespan_table(rows: list[dict]) -> str:
    lines = [
        f"{'workload':12s} {'pool':11s} {'policy':11s} {'mean':>6s} {'max':>6s}   {'mean':>6s} {'max':>6s}",
        f"{'':36s}(over the issue's bound) (over the integrality bound)",
    ]
    for row in rows:
        lines.append(
            f"{row['workload']:12s} {row['pool']:11s} {row['policy']:11s}"
            f" {row['makespan_over_bound_mean']:6.3f} {row['makespan_over_bound_max']:6.3f}"
            f"   {row['makespan_over_tight_bound_mean']:6.3f} {row['makespan_over_tight_bound_max']:6.3f}"
        )
    return "\n".join(lines)


def check_bars(rows: list[dict], one_shot_rows: list[dict]) -> list[tuple[str, bool, str]]:
    """The target bars, each as (name, met, detail)."""
    bars = []
    target = [r for r in rows if r["workload"] == "heavy_tailed" and r["pool"] == "4x_one_half" and r["load"] == 0.8]
    for row in target:
        if row["policy"] == "encdis":
            bars.append(
                (
                    "heavy_tailed/4x_one_half/0.8: encdis p99 <= 0.75x round_robin",
                    row["p99_vs_round_robin"] <= 0.75,
                    f"{row['p99_vs_round_robin']:.3f}",
                )
            )
            bars.append(
                (
                    "heavy_tailed/4x_one_half/0.8: encdis p99 <= 0.90x vllm_greedy",
                    row["p99_vs_vllm_greedy"] <= 0.90,
                    f"{row['p99_vs_vllm_greedy']:.3f}",
                )
            )
    worst = max(
        (max(r["p50_vs_vllm_greedy"], r["p99_vs_vllm_greedy"]), f"{r['workload']}/{r['pool']}/{r['load']}")
        for r in rows
        if r["policy"] == "encdis"
    )
    bars.append(
        ("every cell: encdis p50 and p99 <= 1.02x vllm_greedy", worst[0] <= 1.02, f"worst {worst[0]:.3f} ({worst[1]})")
    )
    # Where vLLM's greedy saturates an encoder (busiest >= 0.98: its queue grows for as long as
    # requests arrive), its p50 comes from the other encoders running below the pool's load, a
    # state no stable policy can match; the same bar restricted to cells where it is stable:
    greedy = {(r["workload"], r["pool"], r["load"]): r for r in rows if r["policy"] == "vllm_greedy"}
    stable = [
        (max(r["p50_vs_vllm_greedy"], r["p99_vs_vllm_greedy"]), f"{r['workload']}/{r['pool']}/{r['load']}")
        for r in rows
        if r["policy"] == "encdis" and greedy[(r["workload"], r["pool"], r["load"])]["busiest_utilisation"] < 0.98
    ]
    if stable:
        worst_stable = max(stable)
        bars.append(
            (
                "cells where vllm_greedy is stable: encdis p50 and p99 <= 1.02x vllm_greedy",
                worst_stable[0] <= 1.02,
                f"worst {worst_stable[0]:.3f} ({worst_stable[1]}; {len(stable)} cells)",
            )
        )
    encdis_one_shot = [r for r in one_shot_rows if r["policy"] == "encdis"]
    for column, what in (
        ("makespan_over_bound_max", "makespan <= 1.05x lower bound (every batch)"),
        ("makespan_over_bound_mean", "mean makespan <= 1.05x lower bound"),
        ("makespan_over_tight_bound_max", "makespan <= 1.05x integrality bound (every batch)"),
    ):
        worst, cell = max((r[column], f"{r['workload']}/{r['pool']}") for r in encdis_one_shot)
        bars.append((f"one-shot: encdis {what}", worst <= 1.05, f"worst {worst:.3f} ({cell})"))
    return bars


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (for the test suite)")
    parser.add_argument("--requests", type=int, default=None, help="requests per run (default 6000; quick 1500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=str, default=None, help="write the latency rows here (JSON list)")
    parser.add_argument("--makespan-json", type=str, default=None, help="write the one-shot rows here")
    parser.add_argument("--workloads", type=str, default=",".join(WORKLOADS))
    parser.add_argument("--loads", type=str, default=",".join(str(x) for x in LOADS))
    args = parser.parse_args(argv)
    requests = args.requests or (1500 if args.quick else 6000)
    workloads = [w for w in args.workloads.split(",") if w]
    loads = [float(x) for x in args.loads.split(",") if x]
    started = time.perf_counter()
    rows = run_all(requests, args.seed, workloads, loads)
    trials = 10 if args.quick else ONE_SHOT_TRIALS
    one_shot_rows = run_one_shot(args.seed, workloads, trials, ONE_SHOT_IMAGES)
    print(
        f"request encode latency ({requests} requests per run, seed {args.seed}; ratios to round_robin / vllm_greedy)"
    )
    print(format_latency_table(rows))
    print()
    print(f"one-shot batches of {ONE_SHOT_IMAGES} images on an idle pool ({trials} trials)")
    print(format_makespan_table(one_shot_rows))
    print()
    for name, met, detail in check_bars(rows, one_shot_rows):
        print(f"{'MET ' if met else 'MISS'} {name}: {detail}")
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.makespan_json:
        with open(args.makespan_json, "w") as fh:
            json.dump(one_shot_rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
