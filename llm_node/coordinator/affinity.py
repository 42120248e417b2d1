"""Digest affinity: each image to the encoder that (probably) holds it, without hurting the balance.

Role: encoders with a cache (Describe's cache_bytes > 0) keep embeddings by content digest. A
fleet of LLM nodes sharing those encoders encodes each image once only when every node sends a
digest to the same encoder; `Affinity.assign` is assignment.assign with that preference added.

API:
    rank(digest, keys) -> list[int]         indices of `keys`, highest rendezvous weight first
    HeldDigests(per_encoder)                 digests each encoder is known to hold (bounded LRU)
        .learn(key, digest) / .holds(key, digest) / .forget(key)
    Affinity(settings)                       what the dispatcher holds
        .applies(handles) -> bool            on, and every candidate has a cache
        .assign(patches, digests, loads)     encoder index per image (as assignment.assign)
        .to_ask(patches, digests, loads)     {encoder index: digests} worth an EncoderService.Has first
        .answers(key, digests, present)      learn what Has answered
        .see_report(key, report, own_patches)  a load report showing another node's work: shared
    ask_holders(affinity, pool, candidates, jobs, asked)  the dispatcher's Has round, before planning
        .observe(key, patches, digest, receive_seconds)  from each received embedding

Ranking is rendezvous (highest random weight) hashing: weight(encoder, digest) is a hash of the
encoder's target address and the digest, the same number in every LLM node's view, so every node
ranks the live encoders alike with no coordination; an encoder joining or leaving moves only the
digests whose top encoder it is (about 1/N of them), not a reshuffle.

Knowing who holds what: replies say which encoder holds a digest (`observe`), but only to the
node that asked; another node's first send of the same image knows nothing. Before an image is
sent anywhere to be forwarded (not known held where it would go), the dispatcher asks its two
top-ranked encoders, where affinity puts a digest (`to_ask`: EncoderService.Has, one round trip
to each, in parallel; an answer counts a digest being computed there too, whose call would wait
for that forward and run none). Among the encoders within the bound below, a known holder comes
before a new forward. Only once the pool is seen shared (`Affinity.shared`: an encoder answered
from its cache a digest we never sent it, or its load report shows images in flight that cannot
be ours): a node alone knows what it sent where and never pays the round trip. And not after
FRUITLESS_ASKS digests in a row were held by neither encoder (traffic whose images do not repeat
across nodes), until a reply shows another node's image again. So on a loaded pool each image is
still encoded about once per fleet (a digest spilt to the second encoder is found there, not
forwarded again at the top), and images nobody holds keep the bound. The cost, in a shared pool
whose images repeat: that round trip on every image that is forwarded.

Bounded load: images go largest first, as in assignment.assign, and finish(e) is the same
prediction (backlog + this request's images on e + this image), except at an encoder known to
hold the digest: it answers from its cache at once, without a forward or a place in its queue
(encoder_node/servicer.py), so the image finishes after its transfer (and this request's other
transfers from there), whatever that encoder's backlog. The image goes to the highest-ranked
encoder (a holder first) whose finish is within slack * (the image's forward cost at the best
encoder) of the best finish: the top one unless it is that far behind, then consistently the next
ranked (so a hot image spills to one more encoder, which then holds it too, not to whichever is
idlest). The backlogs are the seen ones (EncoderLoad.seen_backlog_seconds: the encoder's report
and our own work since), not the estimates the cost policy adds for balancing (lateness, other
coordinators' work no report shows yet): those differ from one LLM node to the next, and a spill
decided on them sends one digest to different encoders from different nodes, a forward each
(bench/fleet/live.py part 2: the estimates alone spread the encoders' backlogs by more than an
image's forward on a pool that was nearly idle). The best encoder always qualifies, so an image
waits at most `slack` forwards for its encoder; a spill is cheaper than waiting any longer.
`Affinity` caps that forward at the moving mean image's cost: a 4K image pinned behind up to its
own cost would double its latency (the tail of all-distinct traffic: bench/fleet/cache_sim.py,
p99 1.13x the cost policy's uncapped, 1.00x capped), while waiting one mean image is what any
image waits in a balanced pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from .assignment import EncoderLoad, Spread, assign

if TYPE_CHECKING:
    from .expectation import PendingImage
    from .handle import EncoderHandle
    from .load_reports import LoadReport
    from .pool import EncoderPool
    from .settings import CoordinatorSettings

# Digests remembered per encoder: a few hundred KB of strings, far more than an encoder's cache
# usually holds of one node's images (an entry it evicted only costs one forward).
HELD_PER_ENCODER = 4096
# Prior seconds per patch of receiving a held embedding (about 3.5 KB per patch in FP32 at ~2 GB/s),
# until received embeddings measure it.
TRANSFER_PRIOR_SECONDS_PER_PATCH = 2e-6
TRANSFER_RATE = 0.1  # weight of each new measurement in the moving average
MEAN_COST_RATE = 0.01  # weight of each image in the moving mean forward cost (~100 images)
# A Has answer later than this is not worth waiting for: the image is forwarded elsewhere instead.
HAS_TIMEOUT_SECONDS = 0.5
# Where a digest can be: its top encoder, or the next ranked when the top was too far behind.
ASK_RANKS = 2
# Asking stops after this many digests in a row were held by neither (images that do not repeat
# across nodes), until a reply shows another node's image again.
FRUITLESS_ASKS = 32


def weight(key: str, digest: str) -> int:
    """Rendezvous weight of encoder `key` for `digest`: stable across processes and hosts."""
    h = hashlib.blake2b(f"{key}\0{digest}".encode(), digest_size=8, person=b"encdis-hrw")
    return int.from_bytes(h.digest(), "big")


def rank(digest: str, keys: Sequence[Hashable]) -> list[int]:
    """Indices of `keys` in decreasing rendezvous weight for `digest` (ties: lower index first)."""
    weights = [weight(str(k), digest) for k in keys]
    return sorted(range(len(keys)), key=lambda i: (-weights[i], i))


class HeldDigests:
    """The digests each encoder is known to hold, learnt from its replies; bounded LRU per encoder."""

    def __init__(self, per_encoder: int = HELD_PER_ENCODER) -> None:
        if per_encoder <= 0:
            raise ValueError(f"per_encoder must be positive, got {per_encoder}")
        self.per_encoder = per_encoder
        self._held: dict[Hashable, OrderedDict[str, None]] = {}

    def learn(self, key: Hashable, digest: str) -> None:
        held = self._held.setdefault(key, OrderedDict())
        held[digest] = None
        held.move_to_end(digest)
        while len(held) > self.per_encoder:
            held.popitem(last=False)

    def holds(self, key: Hashable, digest: str) -> bool:
        held = self._held.get(key)
        return held is not None and digest in held

    def forget(self, key: Hashable) -> None:
        """The encoder left the pool (or restarted): it holds nothing we know of."""
        self._held.pop(key, None)

    def count(self, key: Hashable) -> int:
        return len(self._held.get(key, ()))


def affinity_assign(image_patches: Sequence[int], digests: Sequence[str], encoders: Sequence[EncoderLoad], *,
                    slack: float, held: HeldDigests | None = None,
                    transfer_seconds_per_patch: float = TRANSFER_PRIOR_SECONDS_PER_PATCH,
                    cap_seconds: float | None = None) -> list[int]:
    """Index into `encoders` for each image: its top-ranked encoder unless that one's predicted
    finish is behind the best by more than slack * the image's forward cost, that cost capped at
    `cap_seconds` (the mean image's, in Affinity) when given (module docstring)."""
    if len(digests) != len(image_patches):
        raise ValueError(f"{len(digests)} digests for {len(image_patches)} images")
    if not image_patches:
        return []
    if not encoders:
        raise ValueError("no encoders to assign images to")
    if any(n <= 0 for n in image_patches):
        raise ValueError(f"patch counts must be positive, got {list(image_patches)}")
    keys = [e.key for e in encoders]
    coefs = [e.model.coefficients for e in encoders]
    backlogs = [max(0.0, e.seen_seconds) for e in encoders]  # seen work only: the same in every node's view
    k = len(encoders)
    count, given, squares = [0] * k, [0] * k, [0] * k  # this request's forwards per encoder, exact
    hits = [0.0] * k  # and its transfers of held embeddings

    def forward(e: int, n: int) -> float:
        c0, c1, c2 = coefs[e]
        return backlogs[e] + hits[e] + c0 * (count[e] + 1) + c1 * (given[e] + n) + c2 * (squares[e] + n * n)

    order = sorted(range(len(image_patches)), key=lambda i: image_patches[i], reverse=True)
    result = [0] * len(image_patches)
    for i in order:
        n, d = image_patches[i], digests[i]
        held_at = [held is not None and held.holds(keys[e], d) for e in range(k)]
        finish = [0.0] * k
        for e in range(k):  # a hit waits for this request's transfers there, not for the queue
            finish[e] = hits[e] + n * transfer_seconds_per_patch if held_at[e] else forward(e, n)
        best = min(range(k), key=lambda e: (finish[e], given[e], e))
        c0, c1, c2 = coefs[best]
        own = c0 + c1 * n + c2 * n * n
        allowed = finish[best] + slack * (min(own, cap_seconds) if cap_seconds is not None else own)
        ranked = [e for e in rank(d, keys) if finish[e] <= allowed]
        chosen = next((e for e in ranked if held_at[e]), ranked[0])  # a holder before a new forward
        result[i] = chosen
        if held_at[chosen]:
            hits[chosen] += n * transfer_seconds_per_patch
        else:
            count[chosen] += 1
            given[chosen] += n
            squares[chosen] += n * n
    return result


class Affinity:
    """The dispatcher's affinity state: the switch, the slack, what each encoder holds, transfer speed."""

    def __init__(self, settings: CoordinatorSettings, held: HeldDigests | None = None) -> None:
        self.on = settings.affinity == "on"
        self.slack = settings.affinity_slack
        self.held = held or HeldDigests()
        self.transfer_seconds_per_patch = TRANSFER_PRIOR_SECONDS_PER_PATCH
        self.mean_cost: float | None = None  # moving mean of images' predicted forward seconds
        # Another LLM node shares the pool (module docstring): until then nothing is asked (`to_ask`).
        self.shared = False
        self._fruitless = 0  # digests asked since an answer or a reply last showed one held elsewhere
        self._last_received: dict[Hashable, float] = {}  # per encoder: when our last embedding from it arrived

    def applies(self, handles: Sequence[EncoderHandle]) -> bool:
        """On, and every candidate caches embeddings (one without a cache would forward every time)."""
        return self.on and bool(handles) and all(
            h.description is not None and h.description.cache_bytes > 0 for h in handles)

    def assign(self, image_patches: Sequence[int], digests: Sequence[str], loads: Sequence[EncoderLoad],
               applies: bool = True, spread: Spread | None = None) -> list[int]:
        """affinity_assign when it applies (its rendezvous ranks already differ per digest), else
        assignment.assign unchanged, with `spread`."""
        if not applies:
            return assign(image_patches, loads, spread)
        for n in image_patches:
            cost = loads[0].model.predict(n)
            self.mean_cost = cost if self.mean_cost is None else self.mean_cost + MEAN_COST_RATE * (
                cost - self.mean_cost)
        return self._picks(image_patches, digests, loads)

    def _picks(self, image_patches: Sequence[int], digests: Sequence[str], loads: Sequence[EncoderLoad]) -> list[int]:
        return affinity_assign(image_patches, digests, loads, slack=self.slack, held=self.held,
                               transfer_seconds_per_patch=self.transfer_seconds_per_patch, cap_seconds=self.mean_cost)

    @property
    def asking(self) -> bool:
        """Whether Has is worth asking now: the pool is shared and answers have not been fruitless."""
        return self.shared and self._fruitless < FRUITLESS_ASKS

    def to_ask(self, image_patches: Sequence[int], digests: Sequence[str],
               loads: Sequence[EncoderLoad]) -> dict[int, list[str]]:
        """Digests to ask about, by encoder index in `loads`: each image `assign` would forward (not
        known held where it goes), of its ASK_RANKS top-ranked encoders; none unless `asking`."""
        keys = [e.key for e in loads]
        ask: dict[int, list[str]] = {}
        if not self.asking:
            return ask
        for d, pick in zip(digests, self._picks(image_patches, digests, loads), strict=True):
            if self.held.holds(keys[pick], d):
                continue
            for e in rank(d, keys)[:ASK_RANKS]:
                ask.setdefault(e, []).append(d)
        return ask

    def see_report(self, key: Hashable, report: LoadReport | None, own_patches: int) -> None:
        """Shared as well when an encoder's load report shows images in flight while none of ours can
        be: we have nothing outstanding there and our last embedding from it arrived before the
        report was made. Those images are another LLM node's."""
        if (report is not None and report.images_in_flight > 0 and own_patches == 0
                and self._last_received.get(key, float("-inf")) < report.made()):
            self.shared = True

    def answers(self, key: Hashable, digests: Sequence[str], present: Sequence[bool]) -> None:
        """What encoder `key` answered to Has(digests). An answer of another length than the
        question is not trusted (nothing learnt)."""
        if len(present) == len(digests):
            for d, p in zip(digests, present, strict=True):
                if p:
                    self.held.learn(key, d)
            self._fruitless = 0 if any(present) else self._fruitless + len(digests)

    def observe(self, key: Hashable, patches: int, digest: str, receive_seconds: float, cached: bool = False) -> None:
        """A received embedding: its encoder now holds the digest; its receive time prices a transfer.
        `cached`: it came from the encoder's cache."""
        if cached and not self.held.holds(key, digest):  # another node's image: worth asking again
            self.shared, self._fruitless = True, 0
        self.held.learn(key, digest)
        self._last_received[key] = time.monotonic()
        if receive_seconds > 0 and patches > 0:
            r = TRANSFER_RATE
            self.transfer_seconds_per_patch += r * (receive_seconds / patches - self.transfer_seconds_per_patch)


async def ask_holders(affinity: Affinity, pool: EncoderPool, candidates: Sequence[EncoderHandle],
                      jobs: Sequence[PendingImage], asked: set[tuple[str, str]]) -> bool:
    """Ask the top-ranked encoders (EncoderService.Has) about the images `affinity.to_ask` names,
    each (encoder, digest) once per request (`asked`); True if it asked (it awaited: plan again).
    An encoder that fails or is slow to answer is taken to hold nothing: the image goes elsewhere."""
    if not affinity.applies(candidates):
        return False
    if not affinity.shared:
        for h in candidates:
            affinity.see_report(h.address, h.reports.latest if h.reports is not None else None,
                                pool.backlog_patches(h))
    if not affinity.asking:
        return False
    questions = []
    for e, ds in affinity.to_ask([j.patches for j in jobs], [j.digest for j in jobs], pool.loads(candidates)).items():
        new = [d for d in dict.fromkeys(ds) if (candidates[e].address, d) not in asked]
        if new:
            asked.update((candidates[e].address, d) for d in new)
            questions.append((candidates[e], new))
    if not questions:
        return False
    answers = await asyncio.gather(*(h.client.has(ds, timeout=HAS_TIMEOUT_SECONDS) for h, ds in questions),
                                   return_exceptions=True)
    for (h, ds), present in zip(questions, answers, strict=True):
        if not isinstance(present, BaseException):
            affinity.answers(h.address, ds, present)
    return True
