"""Balance simulator: the real encdis assignment policy against round-robin, count split and vLLM's greedy.

Role: evidence for issue 4. A discrete-event simulation of a pool of encoder nodes, driving the
REAL policy code (encdis.llm_node.assignment / cost_model / patches, imported, not copied) and
vLLM's own `get_load_balance_assignment`.

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
max(sum cost / sum speed, max item / max speed) (the issue's max(sum cost / k, max item) for
identical encoders). encdis uses models warmed on 60 observed batches per encoder.

    python bench/balance.py [--quick] [--json FILE] [--makespan-json FILE] [--requests N]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

from encdis.llm_node.assignment import Backlog, EncoderLoad, assign, vllm_greedy_assignment
from encdis.llm_node.cost_model import CostModel
from encdis.llm_node.patches import patches_for_image

MIN_PIXELS = 3136  # Qwen2.5-VL's image processor bounds
MAX_PIXELS = 12845056

WORKLOADS = ("uniform", "heavy_tailed", "bimodal", "multi_image")
POOLS: dict[str, tuple[float, ...]] = {
    "4x": (1.0, 1.0, 1.0, 1.0),
    "4x_one_half": (1.0, 1.0, 1.0, 0.5),
    "8x": (1.0,) * 8,
}
LOADS = (0.5, 0.8, 0.95)
POLICIES = ("round_robin", "count_split", "vllm_greedy", "encdis")

# The "true" encoder (speed 1.0): not the prior's numbers. c2/c1 = 2e-5 (prior 1.6e-5),
# c0 = 0.5 ms (prior 0.2 ms), c1 = 2.6e-6 s/patch (prior 3.25e-6).
TRUE_COEFFICIENTS = (5.0e-4, 2.6e-6, 5.2e-11)
NOISE_SIGMA = 0.05
STALL_PROBABILITY = 0.01
STALL_RANGE = (2.0, 4.0)
BATCH_PATCH_BUDGET = 16384
WARMUP_FRACTION = 0.05
ONE_SHOT_IMAGES = 64
ONE_SHOT_TRIALS = 30


# ---- workloads ---------------------------------------------------------------------------------


@cache
def patches(width: int, height: int) -> int:
    return patches_for_image(width, height, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def _uniform_image(rng: random.Random) -> tuple[int, int]:
    return rng.randint(448, 1344), rng.randint(448, 1344)


_ASPECTS = (1.0, 4 / 3, 16 / 10, 16 / 9)


def _heavy_tailed_image(rng: random.Random) -> tuple[int, int]:
    # Long side lognormal (median 700 px), capped at 4K: ~1% of images are 4K screenshots.
    long_side = min(3840, max(224, int(rng.lognormvariate(math.log(700), 0.75))))
    short_side = max(28, int(long_side / rng.choice(_ASPECTS)))
    if long_side == 3840:
        short_side = 2160
    return (long_side, short_side) if rng.random() < 0.7 else (short_side, long_side)


def _bimodal_image(rng: random.Random) -> tuple[int, int]:
    if rng.random() < 0.7:  # icons and thumbnails
        side = rng.randint(32, 160)
        return side, side
    return 1920, 1080  # 1080p screenshots


def request_sizes(workload: str, rng: random.Random) -> list[tuple[int, int]]:
    """Pixel sizes (width, height) of one request's images."""
    if workload == "uniform":
        return [_uniform_image(rng)]
    if workload == "heavy_tailed":
        return [_heavy_tailed_image(rng)]
    if workload == "bimodal":
        return [_bimodal_image(rng)]
    if workload == "multi_image":
        return [_uniform_image(rng) for _ in range(rng.randint(1, 8))]
    raise ValueError(f"unknown workload {workload!r}")


def true_cost(n: int, speed: float = 1.0) -> float:
    c0, c1, c2 = TRUE_COEFFICIENTS
    return (c0 + c1 * n + c2 * n * n) / speed


def mean_noise() -> float:
    stall = STALL_PROBABILITY * (sum(STALL_RANGE) / 2 - 1)
    return math.exp(NOISE_SIGMA**2 / 2) * (1 + stall)


@cache
def mean_request_work(workload: str, seed: int, samples: int = 20000) -> float:
    rng = random.Random(seed ^ 0x5EED)
    total = 0.0
    for _ in range(samples):
        total += sum(true_cost(patches(w, h)) for w, h in request_sizes(workload, rng))
    return total / samples * mean_noise()


# ---- policies ----------------------------------------------------------------------------------


def count_split(n_images: int, k: int) -> list[int]:
    """Contiguous chunks of as-even-as-possible item counts (first n % k chunks one longer)."""
    base, extra = divmod(n_images, k)
    result: list[int] = []
    for chunk in range(k):
        result.extend([chunk] * (base + (1 if chunk < extra else 0)))
    return result


# ---- the discrete-event simulation -------------------------------------------------------------


@dataclass
class _Encoder:
    speed: float
    queue: deque = field(default_factory=deque)  # (request id, patches, ticket)
    busy: bool = False


@dataclass
class RunResult:
    latencies: list[float]
    busiest_utilisation: float  # busy fraction of the busiest encoder while requests arrive
    drain_s: float  # from the last arrival until the last image is ready (large = unstable)

    def quantile(self, q: float) -> float:
        data = sorted(self.latencies)
        pos = q * (len(data) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(data) - 1)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def simulate(workload: str, speeds: Sequence[float], load: float, policy: str, requests: int, seed: int) -> RunResult:
    """One run: `requests` Poisson arrivals on a pool with `speeds`, assigned by `policy`."""
    k = len(speeds)
    rate = load * sum(speeds) / mean_request_work(workload, seed)
    arrivals_rng = random.Random(seed)  # arrivals and sizes: identical across policies
    noise_rng = random.Random(seed + 1)  # batch noise: the same stream for every policy
    encoders = [_Encoder(speed) for speed in speeds]
    busy_time = [0.0] * k
    models = {e: CostModel.prior() for e in range(k)}
    backlog = Backlog()
    remaining: dict[int, int] = {}
    arrived: dict[int, float] = {}
    latencies: list[tuple[int, float]] = []  # (request, seconds)
    events: list[tuple[float, int, int, object]] = []  # (time, seq, kind, payload); kind 0 arrival 1 done
    seq = 0
    now = 0.0
    next_image = 0
    for r in range(requests):
        now += arrivals_rng.expovariate(rate)
        sizes = [patches(w, h) for w, h in request_sizes(workload, arrivals_rng)]
        heapq.heappush(events, (now, seq, 0, (r, sizes)))
        seq += 1
    last_arrival = now

    def start_batch(e: int, t: float) -> None:
        nonlocal seq
        enc = encoders[e]
        batch = [enc.queue.popleft()]
        used = batch[0][1]
        while enc.queue and used + enc.queue[0][1] <= BATCH_PATCH_BUDGET:
            used += enc.queue[0][1]
            batch.append(enc.queue.popleft())
        seconds = sum(true_cost(n, enc.speed) for _, n, _ in batch) * math.exp(noise_rng.gauss(0, NOISE_SIGMA))
        if noise_rng.random() < STALL_PROBABILITY:
            seconds *= noise_rng.uniform(*STALL_RANGE)
        enc.busy = True
        busy_time[e] += max(0.0, min(t + seconds, last_arrival) - t)
        heapq.heappush(events, (t + seconds, seq, 1, (e, batch, seconds)))
        seq += 1

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == 0:
            r, sizes = payload
            arrived[r] = now
            remaining[r] = len(sizes)
            if policy == "round_robin":
                chosen = [(next_image + i) % k for i in range(len(sizes))]
            elif policy == "count_split":
                chosen = [(c + r) % k for c in count_split(len(sizes), k)]
            elif policy == "vllm_greedy":
                chosen = [(g + r) % k for g in vllm_greedy_assignment(sizes, k)]
            elif policy == "encdis":
                chosen = assign(sizes, backlog.loads(models, now))
            else:
                raise ValueError(f"unknown policy {policy!r}")
            next_image += len(sizes)
            for n, e in zip(sizes, chosen, strict=True):
                ticket = backlog.add(e, n, now) if policy == "encdis" else -1
                encoders[e].queue.append((r, n, ticket))
            for e in set(chosen):
                if not encoders[e].busy:
                    start_batch(e, now)
        else:
            e, batch, seconds = payload
            encoders[e].busy = False
            if policy == "encdis":
                for _, _, ticket in batch:
                    backlog.complete(ticket, now)
                models[e].observe([n for _, n, _ in batch], seconds)
            for r, _, _ in batch:
                remaining[r] -= 1
                if remaining[r] == 0:
                    latencies.append((r, now - arrived[r]))
            if encoders[e].queue:
                start_batch(e, now)
    skip = int(requests * WARMUP_FRACTION)
    return RunResult(
        [lat for r, lat in latencies if r >= skip],
        busiest_utilisation=max(busy_time) / last_arrival,
        drain_s=now - last_arrival,
    )


# ---- one-shot batches --------------------------------------------------------------------------


def warmed_models(speeds: Sequence[float], workload: str, seed: int, batches: int = 60) -> list[CostModel]:
    """One CostModel per encoder after observing `batches` noisy batches from the workload."""
    rng = random.Random(seed + 7)
    result = []
    for speed in speeds:
        model = CostModel.prior()
        for _ in range(batches):
            images: list[int] = []
            while sum(images) < BATCH_PATCH_BUDGET // 2:
                images.extend(patches(w, h) for w, h in request_sizes(workload, rng))
            seconds = sum(true_cost(n, speed) for n in images) * math.exp(rng.gauss(0, NOISE_SIGMA))
            model.observe(images, seconds)
        result.append(model)
    return result


def integrality_bound(costs: Sequence[float], speeds: Sequence[float]) -> float:
    """A lower bound on makespan that counts whole images: of the j largest images (cost >= p_j
    each), encoder e can hold at most floor(T * s_e / p_j) within makespan T, so T must let the
    pool hold all j. For identical encoders this is max_j ceil(j / k) * p_j. It is what makes
    e.g. 19 equal 1080p screenshots on 8 encoders take 3 images' time, not 19/8.
    """
    ordered = sorted(costs, reverse=True)
    best = 0.0
    for j, p in enumerate(ordered, start=1):
        if j < len(ordered) and ordered[j] == p:
            continue  # the last of a run of equal costs gives the tightest bound for the run
        candidates = sorted(m * p / s for s in speeds for m in range(1, j + 1))
        lo, hi = 0, len(candidates) - 1
        while lo < hi:  # smallest candidate T at which the pool holds j images of cost p
            mid = (lo + hi) // 2
            if sum(math.floor(candidates[mid] * s / p * (1 + 1e-12)) for s in speeds) >= j:
                hi = mid
            else:
                lo = mid + 1
        best = max(best, candidates[lo])
    return best


def one_shot(
    workload: str, speeds: Sequence[float], seed: int, trials: int, images: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Makespan over the issue's lower bound, and over the integrality bound, per policy, for
    `trials` batches of `images` images on an idle pool."""
    k = len(speeds)
    rng = random.Random(seed + 11)
    models = warmed_models(speeds, workload, seed)
    ratios: dict[str, list[float]] = {p: [] for p in POLICIES}
    tight: dict[str, list[float]] = {p: [] for p in POLICIES}
    for _ in range(trials):
        sizes: list[int] = []
        while len(sizes) < images:
            sizes.extend(patches(w, h) for w, h in request_sizes(workload, rng))
        sizes = sizes[:images]
        costs = [true_cost(n) for n in sizes]
        bound = max(sum(costs) / sum(speeds), max(costs) / max(speeds))
        tight_bound = max(bound, integrality_bound(costs, speeds))
        plans = {
            "round_robin": [i % k for i in range(len(sizes))],
            "count_split": count_split(len(sizes), k),
            "vllm_greedy": vllm_greedy_assignment(sizes, k),
            "encdis": assign(sizes, [EncoderLoad(e, 0.0, m) for e, m in enumerate(models)]),
        }
        for policy, plan in plans.items():
            loads = [0.0] * k
            for cost, e in zip(costs, plan, strict=True):
                loads[e] += cost / speeds[e]
            ratios[policy].append(max(loads) / bound)
            tight[policy].append(max(loads) / tight_bound)
    return ratios, tight


# ---- the table ---------------------------------------------------------------------------------


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
    """The issue's bars, each as (name, met, detail)."""
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
