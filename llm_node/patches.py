"""Patch counts of images, as the coordinator needs them before any encoder sees the image.

Role: the coordinator reads an image's size from its header (no pixel decoding) and turns it into
the number of ViT patches the encoder will run, with the processor's own `smart_resize` (reused
from transformers, not re-derived), so the cost model sees exactly the N the encoder will.

API (stable):
    image_size_from_header(data: bytes) -> (width, height)     raises ValueError on garbage
    patches_for_image(width, height, *, min_pixels, max_pixels, patch_size=14, merge_size=2,
                      temporal_patch_size=2) -> int             N = grid_t * grid_h * grid_w
    grid_for_image(...) -> (grid_t, grid_h, grid_w)             the same, as vLLM's image_grid_thw
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable
from functools import lru_cache


@lru_cache(maxsize=1)
def _smart_resize() -> Callable[..., tuple[int, int]]:
    # Imported on first use: transformers pulls in torch, and this module must stay light for the
    # simulator and for `import encdis.llm_node.patches`.
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


def image_size_from_header(data: bytes) -> tuple[int, int]:
    """(width, height) of an encoded image, read from its header without decoding the pixels."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ValueError("empty image data")
    try:
        with warnings.catch_warnings():
            # The size alone is harmless; the encoder enforces its own pixel limits when decoding.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
    except UnidentifiedImageError:
        raise ValueError("not a recognised image format (PIL cannot identify the header)") from None
    except Image.DecompressionBombError as exc:
        raise ValueError(f"image too large: {exc}") from None
    except (OSError, SyntaxError, EOFError) as exc:  # truncated or corrupt headers
        raise ValueError(f"corrupt image header: {exc}") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    return width, height
