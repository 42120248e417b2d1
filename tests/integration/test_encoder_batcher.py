"""The batcher on the real tower: patch budget, one forward per batch, queue accounting."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from encdis.client.errors import ResourceExhausted
from encdis.encoder_node.batcher import Batcher
from encdis.encoder_node.metrics import EncoderMetrics
from tests import encoder_images as images
from tests.needs import require_module

require_module("torch")


@pytest.fixture(scope="module")
def tower_and_images(tiny_ckpt):
    from encdis.encoder_node.preprocess import ImagePreprocessor
    from encdis.encoder_node.tower import VisionTower

    tower = VisionTower(tiny_ckpt)
    pre = ImagePreprocessor(tiny_ckpt, weights_fingerprint="fp", max_image_bytes=1 << 25, max_image_pixels=1 << 26)
    datas = [images.near_max_pixels(), images.rgb_jpeg(seed=1), images.near_max_pixels(), images.smallest()]
    prepared = [pre.prepare(i, d, 56 * 56, 28 * 28 * 256) for i, d in enumerate(datas)]
    assert [p.num_patches for p in prepared] == [1024, 396, 1024, 16]
    return tower, prepared


def _run(tower, prepared, max_batch_patches: int, cancel: tuple[int, ...] = ()):
    """Queue all images (as separate calls would) before the loop starts; return results + batches."""
    forwards: list[list[int]] = []

    def forward(pixels, grids):
        forwards.append([t * h * w for t, h, w in grids])
        return tower.forward(pixels, grids)

    async def main():
        metrics = EncoderMetrics()
        b = Batcher(forward, max_batch_patches=max_batch_patches, max_queued_patches=1 << 20, metrics=metrics)
        futs = []
        for p in prepared:
            b.admit(p.num_patches)
            futs.append(b.submit(p, accepted_at=0.0))
        assert b.queued_patches == sum(p.num_patches for p in prepared)
        for i in cancel:
            futs[i].cancel()
        b.start()
        done = await asyncio.gather(*futs, return_exceptions=True)
        await b.close()
        assert b.queued_patches == 0 and metrics.registry.get_sample_value("encdis_encoder_queued_patches") == 0
        return done

    return asyncio.run(main()), forwards


def test_one_forward_per_batch_under_the_patch_budget(tower_and_images):
    tower, prepared = tower_and_images
    results, forwards = _run(tower, prepared, max_batch_patches=1500)
    # In arrival order while the budget holds: 1024+396, then 1024+16.
    assert forwards == [[1024, 396], [1024, 16]]
    assert list(results[0].batch.image_patches) == [1024, 396] and results[0].batch.seconds > 0
    for p, r in zip(prepared, results, strict=True):
        (alone,) = tower.forward([p.pixel_values], [p.grid_thw])
        np.testing.assert_allclose(r.embedding.numpy(), alone.numpy(), rtol=1e-5, atol=1e-6)


def test_an_image_larger_than_the_budget_runs_alone(tower_and_images):
    tower, prepared = tower_and_images
    _results, forwards = _run(tower, prepared, max_batch_patches=500)
    assert forwards == [[1024], [396], [1024], [16]]


def test_cancelled_images_are_skipped_and_released(tower_and_images):
    tower, prepared = tower_and_images
    results, forwards = _run(tower, prepared, max_batch_patches=1 << 16, cancel=(1, 2))
    assert forwards == [[1024, 16]]
    assert isinstance(results[1], asyncio.CancelledError) and isinstance(results[2], asyncio.CancelledError)


def test_queue_limit_refuses_calls_only_while_work_is_queued():
    async def main():
        b = Batcher(lambda p, g: [], max_batch_patches=100, max_queued_patches=1000, metrics=EncoderMetrics())
        b.admit(5000)  # an idle node takes even a call above the limit
        with pytest.raises(ResourceExhausted, match="queue is full"):
            b.admit(1)
        b.release(5000)
        b.admit(600)
        with pytest.raises(ResourceExhausted):
            b.admit(401)
        b.admit(400)
        assert b.queued_patches == 1000

    asyncio.run(main())
