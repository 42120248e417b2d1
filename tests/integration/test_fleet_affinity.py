"""One encoder pool, several LLM nodes: an image is encoded once per fleet, and a hot one still spreads.

Two real caching encoder nodes (EncoderNode in-process, tests/encoder_inproc.py) on the tiny
checkpoint; coordinators run in-process as LLM nodes would, each with its own view of the pool.
encdis_encoder_images_total counts the images an encoder's tower forwarded,
encdis_encoder_cache_hits_total the ones it served from its cache.
"""

from __future__ import annotations

import asyncio

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


async def test_a_hot_image_spreads_to_a_second_encoder_once_the_first_is_behind_but_is_not_encoded_50_times(
        pool, tiny_ckpt) -> None:
    hot = png(224, 224, seed=43)
    addresses = list(pool)
    # B has no cache of its own: every one of its 50 sends reaches the pool.
    async with coordinator(tiny_ckpt, addresses, cache_bytes=0) as b:
        await wait_for(lambda: len(b.pool.serving()) == 2, what="both encoders serving B")
        # Fit B's cost models of both encoders with distinct images (never hits).
        await b.encode([png(200 + 14 * i, 200, seed=4300 + i) for i in range(4)])
        (probe,) = (await b.encode([hot])).images
        top, second = (addresses[i] for i in rank(probe.digest, addresses))
        forwards, hits = counts(pool, FORWARDS), counts(pool, HITS)
        async with coordinator(tiny_ckpt, [top]) as a:  # A, another LLM node, keeps the top encoder busy
            stop = asyncio.Event()
            streams = [asyncio.ensure_future(keep_busy(a, stop, 50_000 + 1000 * s)) for s in range(3)]
            try:
                h = next(h for h in b.pool.encoders() if h.address == top)
                await wait_for(lambda: h.reports.latest is not None and h.reports.latest.queued_patches > 0,
                               what="the top encoder's report of A's work reaching B")
                for _ in range(50):
                    (emb,) = (await b.encode([hot])).images
                    assert emb.digest == probe.digest
            finally:
                stop.set()
                await asyncio.gather(*streams)
            busy_forwards = metric(a.registry, "encdis_coordinator_assignments_total", encoder=top)
    served = delta(counts(pool, HITS), hits)
    forwarded = delta(counts(pool, FORWARDS), forwards)
    # A's images are all distinct: every hit is one of the hot image's 50 sends.
    hot_forwards = 50 - sum(served.values())
    assert hot_forwards <= 1, f"the hot image ran the tower {hot_forwards} times"
    # It spread: the second-ranked encoder served it (one forward, then hits) while the top one
    # was behind A's work by more than the image's cost.
    assert served[second] + (forwarded[second] > 0) >= 40, served
    assert forwarded[top] >= busy_forwards > 0  # the top encoder was doing A's work meanwhile
