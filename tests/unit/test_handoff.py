"""The embedding handoff: what it hands to vLLM, and which copies it makes (and where)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from encdis.llm_node.coordinator.records import ImageEmbedding
from encdis.llm_node.handoff import EmbeddingHandoff


def received(rows: int, hidden: int = 8, value: float = 1.0, name: str = "a") -> ImageEmbedding:
    """An embedding as the coordinator holds it: a tensor over the buffer it received into."""
    buf = np.full(rows * hidden, value, dtype="<f4")
    return ImageEmbedding(torch.frombuffer(memoryview(buf), dtype=torch.float32).view(rows, hidden),
                          (1, 2, 2 * rows), name)


def test_one_image_goes_in_as_the_received_tensor_when_nothing_is_shared() -> None:
    image = received(4)
    mm, uuids = asyncio.run(EmbeddingHandoff(shared_memory=False).mm_data([image]))
    assert mm["image"]["image_embeds"] is image.embeds
    assert mm["image"]["image_grid_thw"].tolist() == [[1, 2, 8]]
    assert uuids == {"image": ["a"]}


def test_several_images_are_concatenated_in_prompt_order() -> None:
    images = [received(2, value=1.0, name="x"), received(3, value=2.0, name="y")]
    mm, uuids = asyncio.run(EmbeddingHandoff(shared_memory=False).mm_data(images))
    embeds = mm["image"]["image_embeds"]
    assert embeds.shape == (5, 8) and embeds[:2].eq(1).all() and embeds[2:].eq(2).all()
    assert mm["image"]["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 6]]
    assert uuids == {"image": ["x", "y"]}


def test_with_shared_memory_the_cached_tensor_moves_there_once_in_place() -> None:
    handoff = EmbeddingHandoff(shared_memory=True)
    image = received(4, value=3.0)

    async def twice_at_once() -> list:
        return await asyncio.gather(handoff.mm_data([image]), handoff.mm_data([image]))

    results = asyncio.run(twice_at_once())
    assert image.embeds.is_shared() and image.embeds.eq(3.0).all()
    for mm, _ in results:
        assert mm["image"]["image_embeds"] is image.embeds
    moved_to = image.embeds.data_ptr()
    mm, _ = asyncio.run(handoff.mm_data([image]))  # a later cache hit: already there, no copy
    assert mm["image"]["image_embeds"].data_ptr() == moved_to


def test_with_shared_memory_a_concatenation_is_shared_and_its_parts_untouched() -> None:
    images = [received(2, value=1.0), received(2, value=2.0)]
    mm, _ = asyncio.run(EmbeddingHandoff(shared_memory=True).mm_data(images))
    assert mm["image"]["image_embeds"].is_shared()
    assert not any(im.embeds.is_shared() for im in images)
