"""Per-encoder cost model: predicted seconds to encode an image of N patches, fitted online.

Role: the coordinator keeps one CostModel per encoder. It predicts an image's encode time as
``c0 + c1*N + c2*N**2`` seconds (c2 is the full-attention N^2 term) and learns the three
coefficients from the batch timings an encoder reports with its results. A batch costs the sum
over its images, so a batch of patch counts N_i costs ``c0*k + c1*sum(N_i) + c2*sum(N_i**2)``.

API (stable; the coordinator and bench/balancer/balance.py use it):
    CostModel.prior(device_flops=..., ...) -> CostModel     DESIGN.md's prior
    CostModel(c0, c1, c2, settings=FitSettings())            any prior
    model.predict(patches: int) -> float                     seconds for one image
    model.observe(batch_patches: Sequence[int], seconds: float) -> None
        (a batch reported again, e.g. once with each of its images' embeddings, is ignored:
        repeats of the last SEEN_BATCHES (patch counts, seconds) pairs count once)
    model.coefficients -> tuple[float, float, float]         (c0, c1, c2), never negative
    model.patches_per_second -> float                        speed at REFERENCE_PATCHES
    model.observations -> int                                batches seen (after the prior)

How the fit works (all state is a few floats and a ring of the last few batches: bounded memory):
- Coordinates are the prior's: each batch becomes a row u = (c0p*k, c1p*sum N, c2p*sum N^2) /
  prior_batch_seconds (the prior's split of the batch cost, summing to 1) and a target
  t = seconds / prior_batch_seconds. The unknowns theta are multipliers of the prior
  coefficients, theta = (1, 1, 1) being the prior and g*(1, 1, 1) "the prior's shape at speed g".
  Fitting in these units makes errors relative (a 4K batch does not drown out an icon batch) and
  the 3x3 system well conditioned whatever the units.
- Exponentially weighted recursive least squares (forgetting factor `forget`: a slow drift is
  followed within ~1/(1-forget) batches). The prior enters as pseudo-observations: single images
  of PRIOR_SIZES patches (icon to 4K) predicted by the prior's SHAPE at the LEVEL of the recent
  batches (their median ratio to that shape). Their weight starts at `prior_weight` batches and
  fades (`prior_decay`) to a floor. So the first batch already fixes the speed (the part a prior
  most often gets wrong: the device), while the split between c0, c1 and c2, which few batches
  cannot pin down, stays the prior's until the data show otherwise.
- Robust: each new batch is weighted by Huber's rule on its residual against the current model,
  with a robust running scale (so one batch that took 10x longer, e.g. a GC pause or a page
  fault storm, moves the fit by a bounded amount).
- Step changes (an encoder slowing down 2x, sharing its GPU, being moved to a faster one): when
  the last `change_run` batches all miss in the same direction by more than `change_threshold`,
  the history is dropped and the fit restarts from those batches, with the shape learnt so far as
  the anchor's shape. So a step of more than the threshold is followed after `change_run`
  batches (3 by default; tests: within 15% of the new truth at every size after 5 batches);
  isolated outliers (not `change_run` in a row) never trigger it.
- Non-negative: the 3-variable problem is solved exactly under theta >= 0 (active-set
  enumeration over the 7 supports), so no coefficient is ever negative.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# Work per patch of Qwen2.5-VL's ViT (linear layers, 32 blocks) and the extra N^2 work of its
# full-attention blocks, as DESIGN.md gives them.
GFLOP_PER_PATCH = 1.3
N2_OVER_N = 1.6e-5  # c2 / c1
# A nominal sustained speed for the prior. Only the prior's RATIOS matter for balancing across a
# pool of identical encoders (a common factor cancels); the level is learnt from the first batches.
NOMINAL_DEVICE_FLOPS = 4.0e14
# Fixed per-image overhead (preprocessing hand-off, launch, split of the output) in seconds.
NOMINAL_C0 = 2.0e-4
# patches_per_second is quoted at this image size (a 448x448 image is 32x32 = 1024 patches).
REFERENCE_PATCHES = 1024
# How many recent batches are remembered to ignore repeated reports of the same batch.
SEEN_BATCHES = 64
# Image sizes (patches) at which the prior is pinned as pseudo-observations: icon, 448px, 1080p, 4K.
PRIOR_SIZES = (16, 1024, 10764, 42196)


@dataclass(frozen=True)
class FitSettings:
    """Knobs of the online fit; the defaults are what tests and the simulator validate."""

    forget: float = 0.99  # per batch; memory of ~100 batches
    prior_weight: float = 2.0  # the prior counts as this many batches at first,
    prior_decay: float = 0.95  # fading by this factor per batch
    prior_floor: float = 0.05  # down to this fraction of prior_weight (keeps the shape defined)
    scale_rate: float = 0.1  # speed of the robust residual scale's tracking
    huber_k: float = 2.5  # residuals beyond huber_k * scale are down-weighted
    min_scale: float = 0.02  # floor of the robust relative-residual scale
    warmup: int = 3  # batches before Huber weighting starts
    change_run: int = 3  # consecutive same-side misses that mean the encoder changed
    change_threshold: float = 0.25  # relative miss that counts towards a change
    ring: int = 8  # recent batches kept for restarts (bounded memory)


@dataclass(frozen=True)
class _Row:
    u: tuple[float, float, float]
    t: float


class CostModel:
    """Predicted encode seconds of an image of N patches on one encoder, fitted online."""

    def __init__(self, c0: float, c1: float, c2: float, settings: FitSettings | None = None) -> None:
        if min(c0, c1, c2) < 0 or c1 + c2 <= 0:
            raise ValueError(f"prior coefficients must be >= 0 with c1 + c2 > 0, got {(c0, c1, c2)}")
        self._prior = (float(c0), float(c1), float(c2))
        self._settings = settings or FitSettings()
        self._observations = 0
        self._scale = 0.1  # robust scale of relative residuals, until the data say otherwise
        self._recent: deque[_Row] = deque(maxlen=self._settings.ring)
        self._misses: deque[float] = deque(maxlen=self._settings.change_run)
        self._prior_rows = self._prior_matrix()
        self._seen: deque[tuple[tuple[int, ...], float]] = deque(maxlen=SEEN_BATCHES)
        self._reset_stats(shape=(1.0, 1.0, 1.0), rows=())

    @classmethod
    def prior(
        cls,
        *,
        device_flops: float = NOMINAL_DEVICE_FLOPS,
        gflop_per_patch: float = GFLOP_PER_PATCH,
        n2_over_n: float = N2_OVER_N,
        c0: float = NOMINAL_C0,
        speed: float = 1.0,
        settings: FitSettings | None = None,
    ) -> CostModel:
        """DESIGN.md's prior: c1 from the ViT's FLOP per patch at `device_flops`, c2 = c1 * n2_over_n.

        `speed` scales the whole model (2.0 = twice as fast), e.g. for an encoder known to run on a
        faster device; leave it at 1.0 and let the fit find it otherwise.
        """
        c1 = gflop_per_patch * 1e9 / device_flops
        return cls(c0 / speed, c1 / speed, c1 * n2_over_n / speed, settings=settings)

    # ---- predictions ---------------------------------------------------------------------------

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(c0, c1, c2): seconds per image, per patch, per patch^2. Never negative."""
        return self._coef

    @property
    def observations(self) -> int:
        return self._observations

    @property
    def patches_per_second(self) -> float:
        """Speed figure for ListEncoders: patches per second on a REFERENCE_PATCHES-patch image."""
        return REFERENCE_PATCHES / self.predict(REFERENCE_PATCHES)

    def predict(self, patches: int) -> float:
        """Predicted seconds to encode one image of `patches` patches."""
        c0, c1, c2 = self._coef
        n = float(patches)
        return c0 + c1 * n + c2 * n * n

    # ---- learning ------------------------------------------------------------------------------

    def observe(self, batch_patches: Sequence[int], seconds: float) -> None:
        """Learn from one batch an encoder ran: its images' patch counts and its wall seconds."""
        if not batch_patches or not math.isfinite(seconds) or seconds <= 0:
            return  # nothing to learn from (and a bad report must not poison the model)
        if any(n <= 0 for n in batch_patches):
            raise ValueError(f"patch counts must be positive, got {list(batch_patches)}")
        # Every image of a batch carries the batch's timing; a batch that served several
        # requests reaches the coordinator several times. Learn from it once.
        key = (tuple(batch_patches), seconds)
        if key in self._seen:
            return
        self._seen.append(key)
        row = self._row(batch_patches, seconds)
        s = self._settings
        predicted = _dot(row.u, self._theta)
        rel = (row.t - predicted) / predicted if predicted > 0 else math.inf
        self._observations += 1
        self._recent.append(row)

        # A run of same-side misses means the encoder itself changed: restart from the run.
        self._misses.append(rel)
        if len(self._misses) == s.change_run and (
            all(m > s.change_threshold for m in self._misses)
            or all(m < -s.change_threshold / (1 + s.change_threshold) for m in self._misses)
        ):
            self._restart(list(self._recent)[-s.change_run :])
            return

        weight = 1.0
        if self._observations > s.warmup:
            limit = s.huber_k * self._scale
            if abs(rel) > limit:
                weight = limit / abs(rel)
        # Robust running scale: a running estimate of the 68th percentile of |residual| (one
        # normal sigma), moved multiplicatively by whether each residual falls above it. An
        # outlier counts as one "above", whatever its size, so stalls cannot inflate the scale.
        above = 1.0 if abs(rel) > self._scale else 0.0
        self._scale = max(s.min_scale, self._scale * math.exp(s.scale_rate * (above - 0.3173)))

        f = s.forget
        u = row.u
        for i in range(3):
            self._b[i] = f * self._b[i] + weight * u[i] * row.t
            for j in range(3):
                self._a[i][j] = f * self._a[i][j] + weight * u[i] * u[j]
        # Keep the prior's pull from vanishing entirely: the shape stays defined even when every
        # batch looks alike (e.g. all images the same size).
        self._a_prior = max(s.prior_weight * s.prior_floor, self._a_prior * s.prior_decay)
        self._solve()

    # ---- internals -----------------------------------------------------------------------------

    def _row(self, batch_patches: Sequence[int], seconds: float) -> _Row:
        p0, p1, p2 = self._prior
        k = float(len(batch_patches))
        s1 = float(sum(batch_patches))
        s2 = float(sum(n * n for n in batch_patches))
        parts = (p0 * k, p1 * s1, p2 * s2)
        total = parts[0] + parts[1] + parts[2]
        return _Row(u=(parts[0] / total, parts[1] / total, parts[2] / total), t=seconds / total)

    def _reset_stats(self, shape: tuple[float, float, float], rows: Sequence[_Row]) -> None:
        w = self._settings.prior_weight
        self._shape = shape
        self._a_prior = w
        self._a = [[0.0] * 3 for _ in range(3)]
        self._b = [0.0, 0.0, 0.0]
        for row in rows:
            for i in range(3):
                self._b[i] += row.u[i] * row.t
                for j in range(3):
                    self._a[i][j] += row.u[i] * row.u[j]
        self._solve()

    def _prior_matrix(self) -> list[list[float]]:
        # The prior as pseudo-observations: single images spanning icon to 4K sizes, each
        # predicted exactly by the anchor. Pulling predictions (not raw multipliers) towards the
        # prior keeps weakly identified directions (c0 when batches are big) near it without
        # biasing the well identified ones.
        rows = [self._row([n], 1.0).u for n in PRIOR_SIZES]
        scale = 1.0 / len(rows)
        return [[scale * sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]

    def _restart(self, rows: list[_Row]) -> None:
        # Keep the shape learnt so far (c0:c1:c2 of this encoder); the anchor's level comes from
        # the run (see _anchor), and the new rows then refine both.
        self._misses.clear()
        self._recent.clear()
        self._recent.extend(rows)
        self._reset_stats(self._theta, rows)

    def _anchor(self) -> tuple[float, float, float]:
        # The prior's pull is towards the anchor SHAPE at the level of the recent batches (their
        # median ratio to that shape): the level is what a prior most often gets wrong (device
        # speed), the shape is what few batches cannot pin down.
        shape = self._shape
        if not self._recent:
            return shape
        ratios = sorted(r.t / max(_dot(r.u, shape), 1e-300) for r in self._recent)
        level = ratios[len(ratios) // 2]
        return (shape[0] * level, shape[1] * level, shape[2] * level)

    def _solve(self) -> None:
        # Minimise sum_rows w (t - u.theta)^2 + a_prior * sum_refs (u_ref.(theta - anchor))^2, theta >= 0.
        p = self._prior_rows
        w = self._a_prior
        anchor = self._anchor()
        m = [[self._a[i][j] + w * p[i][j] for j in range(3)] for i in range(3)]
        c = [self._b[i] + w * _dot(p[i], anchor) for i in range(3)]
        self._theta = _nonneg_quadratic_min(m, c)
        p0, p1, p2 = self._prior
        th = self._theta
        self._coef = (p0 * th[0], p1 * th[1], p2 * th[2])


def _dot(u: Sequence[float], v: Sequence[float]) -> float:
    return u[0] * v[0] + u[1] * v[1] + u[2] * v[2]


def _solve_sub(m: list[list[float]], c: list[float], idx: tuple[int, ...]) -> list[float] | None:
    """Solve m[idx, idx] x = c[idx] by Gaussian elimination (1 to 3 unknowns); None if singular."""
    n = len(idx)
    a = [[m[i][j] for j in idx] + [c[i]] for i in idx]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= factor * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


_SUPPORTS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,))


def _nonneg_quadratic_min(m: list[list[float]], c: list[float]) -> tuple[float, float, float]:
    """argmin over theta >= 0 of theta.M.theta - 2 c.theta for symmetric positive definite M.

    Exact for three unknowns: the optimum is the best of the feasible stationary points of the
    problem restricted to each support (the zero vector included).
    """
    best: tuple[float, float, float] = (0.0, 0.0, 0.0)
    best_value = 0.0
    for support in _SUPPORTS:
        x = _solve_sub(m, c, support)
        if x is None or min(x) < 0:
            continue
        theta = [0.0, 0.0, 0.0]
        for i, v in zip(support, x, strict=True):
            theta[i] = v
        value = sum(theta[i] * m[i][j] * theta[j] for i in range(3) for j in range(3)) - 2 * _dot(c, theta)
        if value < best_value:
            best, best_value = (theta[0], theta[1], theta[2]), value
        if len(support) == 3:
            break  # the unconstrained optimum is feasible: it is the answer
    return best
