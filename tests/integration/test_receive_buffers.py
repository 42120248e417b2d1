"""Receive buffers in the LLM node's shared region, made while the encoder works: the coordinator
in-process, a FakeEncoder on loopback that holds an image's bytes after its header, and a real
EmbeddingRegion in a temporary directory (no vLLM)."""

from __future__ import annotations

import asyncio
import gc
import os
import threading

import torch
from prometheus_client import CollectorRegistry

from encdis.llm_node.coordinator.coordinator import Coordinator
from encdis.llm_node.coordinator.settings import CoordinatorSettings
from encdis.llm_node.embedding_region import EmbeddingRegion
from tests.fake_encoder import FakeEncoder
from tests.integration.test_coordinator import png, wait_for


async def test_receive_buffers_in_the_region_are_made_while_the_encoder_works(tiny_ckpt, tmp_path) -> None:
    """Received into the node's shared region, each image's buffer is there at its full size
    before the encoder sends its bytes (the fake holds them after the first header), so the
    copies do not wait for it; each embedding lands in its buffer and none is left over."""
    region = EmbeddingRegion(torch.float32, parent=str(tmp_path))
    fake = await FakeEncoder(tiny_ckpt).start()
    fake.hold = threading.Event()
    images = [png(120, 90, seed=13), png(60, 60, seed=14)]
    coord = Coordinator.from_checkpoint(CoordinatorSettings(encoders=(fake.address,), encoder_wait_seconds=30.0,
                                                                            cache_bytes=0),
                                        CollectorRegistry(), tiny_ckpt)
    coord.receive_buffers = region.buffer
    await coord.start()

    def buffer_sizes() -> list[int]:
        return sorted(os.path.getsize(os.path.join(region.path, f)) for f in os.listdir(region.path))

    try:
        want = sorted(coord.grid_tokens(g) * coord.hidden_size * 4 for g in coord.image_grids(images))
        encoding = asyncio.ensure_future(coord.encode(images))
        await wait_for(lambda: fake.images_held == 1, what="the first header sent and its bytes held")
        await wait_for(lambda: buffer_sizes() == want, 10, "both images' buffers in the region")
        assert not encoding.done()
        fake.hold.set()
        result = await encoding
        for i, got in enumerate(result.images):
            assert region.file_of(got.embeds) is not None and bool((got.embeds == float(i)).all())
        assert buffer_sizes() == want
    finally:
        await coord.stop()
        await fake.stop()
    del result, encoding, got
    gc.collect()
    await wait_for(lambda: os.listdir(region.path) == [], 10, "the region's files to go with their tensors")
    region.close()
