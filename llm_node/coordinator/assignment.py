"""Assignment policy: which encoder encodes which image of a request.

Role: the coordinator (and bench/balancer/balance.py, which drives this very code) calls `assign` once per
request with each live encoder's load; `Backlog` tracks the outstanding work per encoder that
those loads are read from.

API (stable):
    EncoderLoad(key, backlog_seconds, model)       one encoder as the policy sees it
    assign(image_patches, encoders, spread=None)   encoder index per image, in image order
    Spread(unseen_seconds, rng)                    work no report shows yet, spread over (below)
    Backlog()                                       outstanding images per encoder
        .add(key, patches, now) -> int              a ticket, when an image is sent
        .complete(ticket, now)                      when its embedding arrived (or it failed)
        .seconds(key, model, now) -> float          predicted seconds of work still queued
        .loads(models, now) -> list[EncoderLoad]    the `encoders` argument of assign
        .outstanding_since(key, t) -> list[int]     patches of images sent after t (load_reports.py)
        .forget(key)                                an encoder left the pool
    vllm_greedy_assignment(image_patches, k)       vLLM's own balancer, as an encoder index per
                                                    image (the baseline tests and the simulator compare with)

The policy. Images go in decreasing size (patch count; with non-negative coefficients that is
also decreasing predicted cost on every encoder, ties kept in request order), each to the
encoder with the earliest predicted finish:

    finish(e) = backlog_seconds(e) + cost_e(images of this request already given to e) + cost_e(N)

with cost_e the encoder's own fitted model (c0 + c1*N + c2*N^2 per image, summed over images), so
the N^2 term, c0, the encoder's measured speed and its queue all count. Ties go to the encoder
that got fewer of this request's patches, then to the lower index. Per-encoder sums are kept as
exact integers (image count, sum N, sum N^2) and priced in one expression, so equal integer loads
give bit-identical predicted seconds.

Relation to vLLM (DESIGN.md: "with equal speeds and empty backlogs this must reduce exactly to
vLLM's greedy patch-count assignment"). vLLM's `get_load_balance_assignment` is largest-first
(stable order), least summed patches, lowest index on ties. For a LINEAR cost (c0 = c2 = 0) with
equal coefficients and equal backlogs, finish(e) is a strictly increasing function of the
encoder's patch sum, so this policy is identical to vLLM's; tests/unit/test_assignment.py checks
that against vLLM's own function on thousands of random requests. With the real, non-linear cost
it is deliberately NOT identical: a 4K image costs ~1.7x what the same number of patches in small
images costs (the N^2 term), and balancing patch sums then leaves the encoder holding the 4K image
last to finish; balancing predicted seconds is what the cost model is for (bench/balancer/balance.py:
one-shot makespan 1.00-1.02x the lower bound on heavy-tailed batches where vLLM's is 1.03-1.10x).
Both are greedy heuristics, so per request ours can lose a little (tests: never by more than 5%
in predicted makespan, and it wins more than 3x as often as it loses).

Stale reports (several coordinators, load_reports.py). Every coordinator reads the same
reports, a transit time old, so within that time they all see the same encoder as the earliest
finish and all send to it: one 4K image sent there by one of them makes the images the others
send there in the next milliseconds wait out its whole forward. With a `Spread`, an image goes
where the others' unseen work is predicted NOT to have gone (Dahlin's "interpreting stale load
information"): the unseen seconds are water-filled onto the earliest finishes up to a common
level, as the others' greedy choices would fill them, and the image picks encoder e with
probability (level - finish(e)) / unseen, e's expected share of that work. Coordinators doing
the same then fill the encoders evenly instead of piling onto one. With no unseen work (one
coordinator, fresh reports) it is the plain earliest finish.

Using it (the coordinator): loads = backlog.loads(models, now); chosen = assign(patches, loads);
send image i to loads[chosen[i]].key with ticket = backlog.add(key, patches[i], now); on its
embedding (or failure) backlog.complete(ticket, now) and model.observe(batch patches, seconds)
from the BatchTiming it came with. Idle encoders tie at zero backlog and the lowest index wins;
rotate the order of `models` between requests if work should spread over idle encoders.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from encdis.llm_node.coordinator.cost_model import CostModel


@dataclass(frozen=True)
class EncoderLoad:
    """One encoder as the policy sees it: predicted seconds of queued work and its cost model.

    `seen_backlog_seconds`: the part of the backlog that was seen (its load report and our own
    work since), without the estimates added for balancing (lateness, other coordinators' work
    no report shows yet); None: the backlog is all seen. Digest affinity decides on it."""

    key: Hashable
    backlog_seconds: float
    model: CostModel
    seen_backlog_seconds: float | None = None

    @property
    def seen_seconds(self) -> float:
        return self.backlog_seconds if self.seen_backlog_seconds is None else self.seen_backlog_seconds


@dataclass(frozen=True)
class Spread:
    """Predicted seconds of work other coordinators sent that no report shows yet, and the dice
    that spread this coordinator's images as that work is expected to have spread (module docstring)."""

    unseen_seconds: float
    rng: random.Random


def interpreted_choice(finishes: Sequence[float], unseen: float, rng: random.Random) -> int:
    """Index of the encoder for one image: water-fill `unseen` seconds onto the earliest
    `finishes`, then draw e with probability (level - finishes[e]) / unseen."""
    order = sorted(range(len(finishes)), key=lambda e: finishes[e])
    if unseen <= 0:
        return order[0]
    level, rest, filled = finishes[order[0]], unseen, 1
    while filled < len(order) and (finishes[order[filled]] - level) * filled < rest:
        rest -= (finishes[order[filled]] - level) * filled
        level = finishes[order[filled]]
        filled += 1
    level += rest / filled
    draw = rng.random() * unseen
    for e in order[:filled]:
        draw -= level - finishes[e]
        if draw < 0:
            return e
    return order[filled - 1]  # rounding


def assign(image_patches: Sequence[int], encoders: Sequence[EncoderLoad], spread: Spread | None = None) -> list[int]:
    """Index into `encoders` for each image of one request (in the input order of the images).

    `spread`: other coordinators' work no report shows yet; None or 0 s: the earliest finish."""
    if not image_patches:
        return []
    if not encoders:
        raise ValueError("no encoders to assign images to")
    if any(n <= 0 for n in image_patches):
        raise ValueError(f"patch counts must be positive, got {list(image_patches)}")
    coefs = [e.model.coefficients for e in encoders]
    backlogs = [max(0.0, e.backlog_seconds) for e in encoders]
    count = [0] * len(encoders)  # this request's images per encoder,
    given = [0] * len(encoders)  # their patch sum,
    squares = [0] * len(encoders)  # and their sum of squares: exact integers

    def finish(e: int, n: int) -> tuple[float, int, int]:
        c0, c1, c2 = coefs[e]
        seconds = backlogs[e] + c0 * (count[e] + 1) + c1 * (given[e] + n) + c2 * (squares[e] + n * n)
        return seconds, given[e], e

    # Largest first; Python's sort is stable, so equal sizes keep request order (as vLLM's does).
    order = sorted(range(len(image_patches)), key=lambda i: image_patches[i], reverse=True)
    result = [0] * len(image_patches)
    for i in order:
        n = image_patches[i]
        if spread is not None and spread.unseen_seconds > 0:
            best = interpreted_choice([finish(e, n)[0] for e in range(len(encoders))], spread.unseen_seconds,
                                      spread.rng)
        else:
            best = min(range(len(encoders)), key=lambda e: finish(e, n))
        result[i] = best
        count[best] += 1
        given[best] += n
        squares[best] += n * n
    return result


class Backlog:
    """Outstanding images per encoder, for the backlog term of the policy.

    Work is kept as patch counts and priced with the encoder's CURRENT model when read, so a
    model that learns the encoder slowed down re-prices its whole queue at once. The time the
    encoder has already spent on the oldest image (since it became busy or last completed
    something) is credited, up to that image's predicted cost, so the backlog decays while work is
    in flight instead of dropping only in steps.
    """

    def __init__(self) -> None:
        self._tickets = itertools.count()
        self._queues: dict[Hashable, OrderedDict[int, int]] = {}
        self._owner: dict[int, Hashable] = {}
        self._mark: dict[Hashable, float] = {}  # since when the head image has been worked on
        self._sent: dict[int, float] = {}  # ticket -> when it was added

    def add(self, key: Hashable, patches: int, now: float) -> int:
        """Record an image sent to encoder `key`; returns the ticket to complete it with."""
        queue = self._queues.setdefault(key, OrderedDict())
        if not queue:
            self._mark[key] = now
        ticket = next(self._tickets)
        queue[ticket] = patches
        self._owner[ticket] = key
        self._sent[ticket] = now
        return ticket

    def complete(self, ticket: int, now: float) -> None:
        """The image's embedding arrived (or its encode failed): it no longer loads the encoder."""
        key = self._owner.pop(ticket, None)
        self._sent.pop(ticket, None)
        if key is None:
            return  # already completed, or its encoder was forgotten
        queue = self._queues[key]
        was_head = next(iter(queue)) == ticket
        del queue[ticket]
        if was_head:
            self._mark[key] = now

    def forget(self, key: Hashable) -> None:
        """Drop an encoder that left the pool (its outstanding tickets become no-ops)."""
        for ticket in self._queues.pop(key, {}):
            self._owner.pop(ticket, None)
            self._sent.pop(ticket, None)
        self._mark.pop(key, None)

    def outstanding(self, key: Hashable) -> list[int]:
        """Patch counts of the images still outstanding on `key`, oldest first."""
        return list(self._queues.get(key, {}).values())

    def outstanding_since(self, key: Hashable, since: float) -> list[int]:
        """Patch counts of the outstanding images on `key` that were sent after `since`."""
        return [n for t, n in self._queues.get(key, {}).items() if self._sent[t] > since]

    def seconds(self, key: Hashable, model: CostModel, now: float) -> float:
        """Predicted seconds of work still queued on encoder `key`."""
        queue = self._queues.get(key)
        if not queue:
            return 0.0
        total = 0.0
        head = None
        for patches in queue.values():
            cost = model.predict(patches)
            if head is None:
                head = cost
            total += cost
        credit = min(max(0.0, now - self._mark[key]), head or 0.0)
        return total - credit

    def loads(self, models: Mapping[Hashable, CostModel], now: float) -> list[EncoderLoad]:
        """EncoderLoad for each encoder in `models` (in its order): the `encoders` of `assign`."""
        return [EncoderLoad(key, self.seconds(key, model, now), model) for key, model in models.items()]


def vllm_greedy_assignment(image_patches: Sequence[int], k: int) -> list[int]:
    """Encoder index per image from vLLM's own `get_load_balance_assignment` (needs vLLM).

    vLLM returns a shuffle order and per-GPU counts; this turns them into the same shape
    `assign` returns, so the two can be compared image by image.
    """
    from vllm.model_executor.models.vision import get_load_balance_assignment

    shuffle, counts, _ = get_load_balance_assignment(list(image_patches), num_gpus=k)
    result = [0] * len(image_patches)
    pos = 0
    for gpu, count in enumerate(counts):
        for idx in shuffle[pos : pos + count]:
            result[idx] = gpu
        pos += count
    return result
