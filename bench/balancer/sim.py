"""Balance simulator, the policies and the simulation: a pool of encoders driven by each policy.

Role: bench/balancer/balance.py's engine. `simulate` is a discrete-event simulation of requests arriving
at a pool of encoder nodes, each a FIFO queue feeding patch-budgeted batches, with images placed
by one of `POLICIES`; `one_shot` places one batch on an idle pool and compares its makespan with
lower bounds. The encdis policy is the REAL code (encdis.llm_node.coordinator.assignment /
cost_model, imported, not copied); vllm_greedy is vLLM's own `get_load_balance_assignment`.
The world (workloads, true costs, noise) is bench/balancer/workloads.py.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.balancer.workloads import (
    NOISE_SIGMA,
    STALL_PROBABILITY,
    STALL_RANGE,
    mean_request_work,
    patches,
    request_sizes,
    true_cost,
)
from encdis.llm_node.coordinator.assignment import Backlog, EncoderLoad, assign, vllm_greedy_assignment
from encdis.llm_node.coordinator.cost_model import CostModel

POLICIES = ("round_robin", "count_split", "vllm_greedy", "encdis")
BATCH_PATCH_BUDGET = 16384
WARMUP_FRACTION = 0.05


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
    """Makespan over the classic lower bound max(sum cost / sum speed, max item / max speed), and
    over the integrality bound, per policy, for `trials` batches of `images` images on an idle pool."""
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
