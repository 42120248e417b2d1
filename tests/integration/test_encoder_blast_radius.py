"""One bad image harms nothing else on an encoder node: decode cost is bounded, and a forward
that fails fails only the image that fails by itself."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
from PIL import Image

from encdis.client import EncoderClient, Internal, ResourceExhausted
from encdis.encoder_node.fault_hook import TEST_FAULT_ENV
from encdis.encoder_node.settings import EncoderSettings
from encdis.llm_node.coordinator.patches import grid_for_image
from tests import encoder_images as images
from tests.encoder_inproc import InProcessEncoder
from tests.holds import held
from tests.integration.test_encoder_errors import forwards_held

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 256  # the tiny checkpoint's processor bounds


def huge_flat_png(side: int = 8000) -> bytes:
    """A small file (a few hundred KiB) that decodes to side x side pixels."""
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (90, 140, 200)).save(buf, "PNG", optimize=True)
    return buf.getvalue()


def test_a_flood_of_small_files_declaring_huge_sizes_is_refused_not_decoded(tiny_ckpt) -> None:
    bomb = huge_flat_png()
    assert len(bomb) < 1 << 20  # cheap to send ...
    settings = EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, max_decoding_pixels=70_000_000,
                              cache_bytes=0)  # identical bombs: with a cache the later calls would share the first
    with InProcessEncoder(settings) as n, EncoderClient(n.address, timeout=120) as c:
        results: list[object] = []
        with held(n.node.model.preprocessor, "prepare") as decoding:
            first = threading.Thread(target=lambda: results.append(c.encode([bomb])))
            first.start()
            assert decoding.wait(60), "the first call never started decoding"
            refused = 0
            for _ in range(15):  # ... but 64M pixels each to decode: beyond the budget while one decodes
                with pytest.raises(ResourceExhausted, match="decoded pixels in flight"):
                    c.encode([bomb])
                refused += 1
        first.join(120)
        assert refused == 15 and len(results) == 1 and len(results[0]) == 1
        assert n.node.servicer._decoding.in_flight == 0  # given back
        assert len(c.encode([bomb])) == 1  # and the node serves the next one


def test_a_failing_image_in_a_shared_batch_fails_only_its_own_call(tiny_ckpt, monkeypatch) -> None:
    poisoned_size = (230, 170)
    grid = grid_for_image(*poisoned_size, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    monkeypatch.setenv(TEST_FAULT_ENV, ",".join(map(str, grid)))
    poisoned = images.rgb_jpeg(*poisoned_size, seed=3)
    good = {name: images.rgb_jpeg(w, h, seed=i) for i, (name, w, h) in
            enumerate([("a", 320, 240), ("b", 120, 300), ("d", 200, 200)])}
    with InProcessEncoder(EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0)) as n:
        batcher = n.node.model.batcher
        results: dict[str, object] = {}

        def call(name: str, data: bytes) -> None:
            with EncoderClient(n.address, timeout=120) as c:
                try:
                    results[name] = c.encode([data])
                except Exception as e:  # the assertions below say which
                    results[name] = e

        with forwards_held(n) as forwarding:
            threads = [threading.Thread(target=call, args=("a", good["a"]))]
            threads[0].start()
            assert forwarding.wait(60)  # a's forward is held: the next three queue behind it
            for name, data in (("b", good["b"]), ("c", poisoned), ("d", good["d"])):
                threads.append(threading.Thread(target=call, args=(name, data)))
                threads[-1].start()
            deadline = threading.Event()
            for _ in range(600):
                if len(batcher._queue) == 3:
                    break
                deadline.wait(0.05)
            assert len(batcher._queue) == 3, "the three calls never queued together"
        for t in threads:
            t.join(120)
        assert isinstance(results["c"], Internal) and "image 0: the vision tower failed" in results["c"].message
        with EncoderClient(n.address, timeout=120) as c:
            for name in ("a", "b", "d"):
                (emb,) = results[name]
                (alone,) = c.encode([good[name]])
                np.testing.assert_allclose(emb.array(), alone.array(), rtol=1e-5, atol=1e-6)
        # b and d shared the failed forward with c, then ran again alone.
        for name in ("b", "d"):
            assert len(results[name][0].batch.image_patches) == 1
