"""Balance simulator, the world it simulates: image workloads and the true encoder cost.

Role: what bench/balancer/balance.py's policies are measured against, identical for every policy.
- Workloads: seeded generators of one request's image sizes (pixels), turned into patch counts
  by the real `patches_for_image` with Qwen2.5-VL's processor bounds.
- The true encoder: `(c0 + c1*N + c2*N^2) / speed` seconds per image, times lognormal noise and
  rare stalls. Its coefficients differ from encdis's prior on purpose (other device speed,
  larger N^2 share, larger c0), so encdis must learn them online.
"""

from __future__ import annotations

import math
import random
from functools import cache

from encdis.llm_node.coordinator.patches import patches_for_image

MIN_PIXELS = 3136  # Qwen2.5-VL's image processor bounds
MAX_PIXELS = 12845056

WORKLOADS = ("uniform", "heavy_tailed", "bimodal", "multi_image")

# The "true" encoder (speed 1.0): not the prior's numbers. c2/c1 = 2e-5 (prior 1.6e-5),
# c0 = 0.5 ms (prior 0.2 ms), c1 = 2.6e-6 s/patch (prior 3.25e-6).
TRUE_COEFFICIENTS = (5.0e-4, 2.6e-6, 5.2e-11)
NOISE_SIGMA = 0.05
STALL_PROBABILITY = 0.01
STALL_RANGE = (2.0, 4.0)


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
    """Mean true seconds of one request's images on a speed-1 encoder, noise included."""
    rng = random.Random(seed ^ 0x5EED)
    total = 0.0
    for _ in range(samples):
        total += sum(true_cost(patches(w, h)) for w, h in request_sizes(workload, rng))
    return total / samples * mean_noise()
