"""encdis_coordinator_embedding_bytes_received_total: the bytes of the embeddings the coordinator
received from encoders, each counted once (cache hits and shared in-flight images add nothing)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image
from prometheus_client import CollectorRegistry

from encdis.llm_node.coordinator.coordinator import Coordinator
from encdis.llm_node.coordinator.settings import CoordinatorSettings
from tests.fake_encoder import FakeEncoder

METRIC = "encdis_coordinator_embedding_bytes_received_total"


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


async def test_received_bytes_equal_the_embeddings_sizes_each_counted_once(tiny_ckpt) -> None:
    fake = await FakeEncoder(tiny_ckpt).start()
    registry = CollectorRegistry()
    coord = Coordinator.from_checkpoint(CoordinatorSettings(encoders=(fake.address,), encoder_wait_seconds=30.0),
                                        registry, tiny_ckpt)
    await coord.start()
    try:
        small, large = png(64, 48, 1), png(200, 120, 2)
        first = await coord.encode([small, large, small])  # the repeat is encoded once
        sizes = [e.embeds.numel() * e.embeds.element_size() for e in first.images]
        assert sizes[0] != sizes[1] and registry.get_sample_value(METRIC) == sizes[0] + sizes[1]
        await coord.encode([large])  # a cache hit receives nothing
        assert registry.get_sample_value(METRIC) == sizes[0] + sizes[1]
    finally:
        await coord.stop()
        await fake.stop()
