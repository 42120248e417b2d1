"""Patch counts of images, as the coordinator needs them before any encoder sees the image.

Role: the coordinator reads an image's size from its header (encdis.image_header, no pixel
decoding) and turns it into the number of ViT patches the encoder will run, with the
processor's own `smart_resize` (reused from transformers, not re-derived), so the cost model
sees exactly the N the encoder will.

API (stable):
    patches_for_image(width, height, *, min_pixels, max_pixels, patch_size=14, merge_size=2,
                      temporal_patch_size=2) -> int             N = grid_t * grid_h * grid_w
    grid_for_image(...) -> (grid_t, grid_h, grid_w)             the same, as vLLM's image_grid_thw
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache


@lru_cache(maxsize=1)
def _smart_resize() -> Callable[..., tuple[int, int]]:
    # Imported on first use: transformers pulls in torch, and this module must stay light for the
    # simulator and for `import encdis.llm_node.coordinator.patches`.
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    return smart_resize


def grid_for_image(
    width: int,
    height: int,
    *,
    min_pixels: int,
    max_pixels: int,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) of one image after the Qwen2-VL/2.5-VL processor resizes it."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    resized_h, resized_w = _smart_resize()(
        height, width, factor=patch_size * merge_size, min_pixels=min_pixels, max_pixels=max_pixels
    )
    # A still image is one frame, repeated up to temporal_patch_size frames: one temporal patch.
    grid_t = math.ceil(1 / temporal_patch_size)
    return grid_t, resized_h // patch_size, resized_w // patch_size


def patches_for_image(
    width: int,
    height: int,
    *,
    min_pixels: int,
    max_pixels: int,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
) -> int:
    """Number of ViT patches N = t*h*w for one image (the LLM sees N / merge_size**2 tokens)."""
    t, h, w = grid_for_image(
        width,
        height,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=temporal_patch_size,
    )
    return t * h * w
