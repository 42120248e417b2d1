"""Patch counts from image headers: the same N the encoder's image processor will produce."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from encdis.image_header import read_header
from encdis.llm_node.coordinator.patches import grid_for_image, patches_for_image

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 256  # the tiny checkpoint's processor bounds


def _encoded(width: int, height: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("size", [(56, 56), (640, 480), (33, 900), (1920, 1080), (17, 17), (448, 1344)])
def test_patch_count_matches_the_real_image_processor(size: tuple[int, int]) -> None:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    width, height = size
    processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    image = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
    grid = tuple(int(x) for x in processor(images=[image], return_tensors="pt")["image_grid_thw"][0])
    assert grid_for_image(width, height, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS) == grid
    assert patches_for_image(width, height, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS) == grid[0] * grid[1] * grid[2]


def test_qwen25_vl_bounds_give_the_design_md_sizes() -> None:
    bounds = {"min_pixels": 3136, "max_pixels": 12845056}
    assert patches_for_image(1920, 1080, **bounds) == 10764  # 1080p: 78 x 138 patches
    assert patches_for_image(3840, 2160, **bounds) == 42196  # 4K: 154 x 274 patches
    assert patches_for_image(64, 64, **bounds) == 16  # icons are scaled up to min_pixels


def image_size_from_header(data: bytes) -> tuple[int, int]:
    header = read_header(data)
    return header.width, header.height


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_size_from_header(fmt: str) -> None:
    assert image_size_from_header(_encoded(321, 123, fmt)) == (321, 123)


def test_size_from_header_reads_only_the_header() -> None:
    # A PNG cut right after its header chunk: the size is known, the pixels are not there.
    data = _encoded(4000, 3000, "PNG")
    assert image_size_from_header(data[:64]) == (4000, 3000)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b"not an image at all", "not a recognised image"),
        (b"\x89PNG\r\n\x1a\n\x00", "not a recognised image"),  # PNG signature, no header
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", "corrupt image header"),  # JPEG cut inside its header
    ],
)
def test_garbage_raises_value_error_naming_the_problem(data: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        image_size_from_header(data)


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        patches_for_image(0, 10, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
