"""One encoder pool, several LLM nodes: an image is encoded once per fleet, even under load, and a hot one spreads.

Two real caching encoder nodes (EncoderNode in-process, tests/encoder_inproc.py) on the tiny
checkpoint; coordinators run in-process as LLM nodes would, each with its own view of the pool.
encdis_encoder_images_total counts the images an encoder's tower forwarded,
encdis_encoder_cache_hits_total the ones it served from its cache.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from encdis.encoder_node.settings import EncoderSettings
from encdis.llm_node.coordinator.affinity import rank
from tests.encoder_inproc import InProcessEncoder
from tests.integration.test_coordinator import coordinator, metric, png, wait_for
from tests.needs import require_module

torch = require_module("torch")

MiB = 1024 * 1024
FORWARDS = "encdis_encoder_images_total"
HITS = "encdis_encoder_cache_hits_total"


@pytest.fixture(scope="module")
def pool(tiny_ckpt):
    with InProcessEncoder(EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, cache_bytes=64 * MiB)) as a, \
            InProcessEncoder(EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, cache_bytes=64 * MiB)) as b:
        yield {a.address: a, b.address: b}


def counts(pool, name: str) -> dict[str, float]:
    return {addr: node.node.metrics.registry.get_sample_value(name) or 0.0 for addr, node in pool.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


async def test_an_image_sent_through_two_llm_nodes_runs_the_tower_once(pool, tiny_ckpt) -> None:
    img = png(320, 256, seed=41)
    addresses = list(pool)
    forwards, hits = counts(pool, FORWARDS), counts(pool, HITS)
    async with coordinator(tiny_ckpt, addresses) as a, coordinator(tiny_ckpt, addresses) as b:
        await wait_for(lambda: len(a.pool.serving()) == 2 and len(b.pool.serving()) == 2, what="both serving")
        first = await a.encode([img])
        second = await b.encode([img])
    (ea,), (eb,) = first.images, second.images
    assert ea.digest == eb.digest
    # Both coordinators rank the same encoder first for the digest: the one that ran the forward
    # serves the second LLM node from its cache.
    top = addresses[rank(ea.digest, addresses)[0]]
    assert delta(counts(pool, FORWARDS), forwards) == {addr: (1 if addr == top else 0) for addr in addresses}
    assert delta(counts(pool, HITS), hits) == {addr: (1 if addr == top else 0) for addr in addresses}
    # What B received is the very embedding A did, so its prompt (and answer) is the same.
    assert eb.grid_thw == ea.grid_thw and eb.embeds.dtype == ea.embeds.dtype
    assert torch.equal(eb.embeds, ea.embeds)


async def keep_busy(coord, stop: asyncio.Event, seed: int) -> None:
    k = 0
    while not stop.is_set():
        await coord.encode([png(448, 448, seed=seed + 10 * k + i) for i in range(3)])
        k += 1


@contextlib.asynccontextmanager
async def top_kept_busy(tiny_ckpt, top: str, b, image_patches: int, seed: int):
    """Another LLM node keeps `top` busy with distinct images (new ones per `seed`: the pool's
    caches outlive a test) until B's view of `top` (its load report and B's own work) is behind
    by more than twice the image's cost. Yields that node."""
    async with coordinator(tiny_ckpt, [top]) as a:
        stop = asyncio.Event()
        streams = [asyncio.ensure_future(keep_busy(a, stop, seed + 1000 * s)) for s in range(3)]
        try:
            h = next(h for h in b.pool.encoders() if h.address == top)
            await wait_for(lambda: b.pool.backlog_seconds(h, seen_only=True) > 2 * h.cost_model.predict(image_patches),
                           what="the top encoder's report of A's work reaching B")
            yield a
        finally:
            stop.set()
            await asyncio.gather(*streams)


async def fitted(b, seed: int) -> None:
    """B's cost models of both encoders fitted with images new to the pool (never hits)."""
    await wait_for(lambda: len(b.pool.serving()) == 2, what="both encoders serving B")
    await b.encode([png(200 + 14 * i, 200, seed=seed + i) for i in range(4)])


async def test_a_hot_image_spreads_to_a_second_encoder_once_the_first_is_behind_but_is_not_encoded_50_times(
        pool, tiny_ckpt) -> None:
    hot = png(224, 224, seed=43)
    addresses = list(pool)
    # B has no cache of its own: every one of its 50 sends reaches the pool.
    async with coordinator(tiny_ckpt, addresses, cache_bytes=0) as b:
        await fitted(b, 4300)
        (digest,) = b.digests([hot])
        top, second = (addresses[i] for i in rank(digest, addresses))
        forwards, hits = counts(pool, FORWARDS), counts(pool, HITS)
        async with top_kept_busy(tiny_ckpt, top, b, 256, seed=50_000) as a:  # 224x224: 16 x 16 patches
            for _ in range(50):
                (emb,) = (await b.encode([hot])).images
                assert emb.digest == digest
            busy_forwards = metric(a.registry, "encdis_coordinator_assignments_total", encoder=top)
    served = delta(counts(pool, HITS), hits)
    forwarded = delta(counts(pool, FORWARDS), forwards)
    # Held nowhere and its top encoder behind A's work by more than its cost, the hot image went
    # to the second-ranked encoder, which ran it once and then answered the other 49 sends from
    # its cache (a known holder is preferred to a new forward).
    assert forwarded[second] == 1 and served == {top: 0, second: 49}, (forwarded, served)
    assert forwarded[top] >= busy_forwards > 0  # the top encoder was doing A's work meanwhile


async def test_a_node_that_never_sent_an_image_finds_it_at_a_busy_encoder_without_a_forward(
        pool, tiny_ckpt) -> None:
    img = png(240, 224, seed=47)
    addresses = list(pool)
    async with coordinator(tiny_ckpt, addresses) as first, coordinator(tiny_ckpt, addresses, cache_bytes=0) as b:
        await fitted(b, 4400)
        await wait_for(lambda: len(first.pool.serving()) == 2, what="both encoders serving the first node")
        before = counts(pool, FORWARDS)
        (done,) = (await first.encode([img])).images
        (holder,) = (a for a, n in delta(counts(pool, FORWARDS), before).items() if n == 1)
        assert not b._dispatcher.affinity.shared  # nothing yet tells B that another node uses the pool
        forwards, hits = counts(pool, FORWARDS), counts(pool, HITS)
        async with top_kept_busy(tiny_ckpt, holder, b, 17 * 16, seed=90_000):
            # The holder's load reports show B work that is not B's: another node shares the pool
            # (read as B reads them before planning a request, until one is read while it works).
            h = next(h for h in b.pool.encoders() if h.address == holder)
            affinity = b._dispatcher.affinity
            await wait_for(lambda: affinity.see_report(holder, h.reports.latest, b.pool.backlog_patches(h))
                           or affinity.shared, what="B seeing another node's work on the holder")
            # B does not know the holder has the image and, that far behind, would forward it at
            # the other encoder: it asks first (EncoderService.Has) and is answered from the cache.
            (emb,) = (await b.encode([img])).images
    assert emb.digest == done.digest and torch.equal(emb.embeds, done.embeds)
    assert delta(counts(pool, HITS), hits)[holder] == 1
    other = next(a for a in addresses if a != holder)
    assert delta(counts(pool, FORWARDS), forwards)[other] == 0
