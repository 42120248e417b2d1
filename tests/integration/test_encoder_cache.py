"""The encoder's embedding cache over real gRPC: a repeated image is served without a forward.

Nodes are the real EncoderNode in-process (tests/encoder_inproc.py) on the tiny checkpoints;
encdis_encoder_images_total counts the images the tower forwarded.
"""

from __future__ import annotations

import asyncio

import pytest

from encdis.client import AsyncEncoderClient, EncoderClient, InvalidArgument
from encdis.encoder_node.settings import EncoderSettings
from tests import encoder_images as images
from tests.encoder_inproc import InProcessEncoder
from tests.needs import require_module

require_module("torch")

MiB = 1024 * 1024


def _node(ckpt, **kw) -> InProcessEncoder:
    return InProcessEncoder(EncoderSettings(model=ckpt, host="127.0.0.1", port=0, **kw))


@pytest.fixture(scope="module")
def cached(tiny_ckpt):
    with _node(tiny_ckpt, cache_bytes=64 * MiB) as n, EncoderClient(n.address, timeout=120) as c:
        yield n, c


def value(node: InProcessEncoder, name: str) -> float:
    return node.node.metrics.registry.get_sample_value(name) or 0.0


def test_a_repeated_image_is_served_from_the_cache_bit_equal_without_a_forward(cached):
    node, client = cached
    img = images.rgb_jpeg(300, 200, seed=11)
    (first,) = client.encode([img])
    forwards, hits = value(node, "encdis_encoder_images_total"), value(node, "encdis_encoder_cache_hits_total")
    (second,) = client.encode([img])
    assert not first.cached and first.batch is not None
    assert 0 < first.preprocess_seconds <= first.queue_seconds  # the decode and preprocessing the miss took
    assert second.cached and second.batch is None and second.queue_seconds == second.preprocess_seconds == 0.0
    assert bytes(second.data) == bytes(first.data) and second.digest == first.digest
    assert value(node, "encdis_encoder_images_total") == forwards
    assert value(node, "encdis_encoder_cache_hits_total") == hits + 1
    assert client.has([first.digest, "0" * 64]) == [True, False]
    assert client.describe().cache_bytes == 64 * MiB


def test_other_resize_bounds_are_a_miss(cached):
    node, client = cached
    img = images.rgb_jpeg(320, 240, seed=12)
    (a,) = client.encode([img])
    forwards = value(node, "encdis_encoder_images_total")
    (b,) = client.encode([img], max_pixels=28 * 28 * 64)
    assert not b.cached and b.digest != a.digest
    assert value(node, "encdis_encoder_images_total") == forwards + 1


def test_concurrent_identical_images_run_one_forward(cached):
    node, _ = cached
    img = images.rgb_jpeg(448, 448, seed=13)
    forwards = value(node, "encdis_encoder_images_total")

    async def run():
        async with AsyncEncoderClient(node.address, timeout=120) as c:
            return await asyncio.gather(*(c.encode([img]) for _ in range(4)))

    out = asyncio.run(run())
    assert value(node, "encdis_encoder_images_total") == forwards + 1
    assert sum(not e.cached for (e,) in out) == 1
    assert len({bytes(e.data) for (e,) in out}) == 1


def test_has_rejects_oversize_input_and_the_node_keeps_serving(cached):
    _, client = cached
    with pytest.raises(InvalidArgument, match="limit is 1024"):
        client.has(["a"] * 1025)
    with pytest.raises(InvalidArgument, match="128"):
        client.has(["a" * 129])
    assert client.has([]) == []
    assert len(client.encode([images.rgb_jpeg(seed=14)])) == 1


def test_other_weights_or_datatype_never_serve_the_first_nodes_embedding(cached, other_ckpt, tiny_ckpt):
    node, client = cached
    img = images.rgb_jpeg(seed=15)
    (mine,) = client.encode([img])
    for other in (dict(model=other_ckpt), dict(model=tiny_ckpt, dtype="bfloat16")):
        with _node(other.pop("model"), cache_bytes=64 * MiB, **other) as n, EncoderClient(n.address, timeout=120) as c:
            assert c.has([mine.digest]) == [False]
            (theirs,) = c.encode([img])
            assert not theirs.cached and theirs.digest != mine.digest
            assert client.has([theirs.digest]) == [False]


def test_cache_bytes_0_never_caches(tiny_ckpt):
    img = images.rgb_jpeg(seed=16)
    with _node(tiny_ckpt, cache_bytes=0) as n, EncoderClient(n.address, timeout=120) as c:
        a, b = c.encode([img]), c.encode([img])
        assert not a[0].cached and not b[0].cached
        assert value(n, "encdis_encoder_images_total") == 2 and c.has([a[0].digest]) == [False]
        assert c.describe().cache_bytes == 0


def test_the_cache_stays_within_its_budget_under_distinct_large_images(tiny_ckpt):
    with _node(tiny_ckpt, cache_bytes=1) as probe, EncoderClient(probe.address, timeout=120) as c:
        (e,) = c.encode([images.rgb_jpeg(448, 448, seed=100)])
        size = e.data.nbytes
        assert value(probe, "encdis_encoder_cache_bytes") == 0  # larger than the budget: not stored
    budget = 3 * size + size // 2
    with _node(tiny_ckpt, cache_bytes=budget) as n, EncoderClient(n.address, timeout=120) as c:
        for seed in range(30):
            c.encode([images.rgb_jpeg(448, 448, seed=200 + seed)])
            assert value(n, "encdis_encoder_cache_bytes") <= budget
        assert value(n, "encdis_encoder_cache_bytes") == 3 * size
        assert value(n, "encdis_encoder_cache_evictions_total") == 27
        assert value(n, "encdis_encoder_cache_budget_bytes") == budget
