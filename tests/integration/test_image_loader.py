"""The encoder's `vllm` image loader equals vLLM's own serving loader, pixel for pixel.

vLLM is installed in the test environment (the LLM node needs it); the encoder node does
not install it, which is why the rules are re-written in encoder_node/image_loader.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from encdis.encoder_node.image_loader import load, vllm_rgb
from encdis.image_header import open_image, read_header
from tests import encoder_images as images
from tests.needs import require_module

require_module("vllm")


@pytest.mark.parametrize("kind", list(images.KINDS))
def test_vllm_loader_equals_vllms_media_loader(kind: str) -> None:
    from vllm.multimodal.media.image import ImageMediaIO

    data = images.KINDS[kind][0]()
    theirs = ImageMediaIO(image_mode="RGB").load_bytes(data).media
    image = open_image(data)
    image.load()
    ours = vllm_rgb(image)
    assert ours.mode == "RGB" and ours.size == theirs.size
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


def test_the_cases_exercise_both_rules() -> None:
    """EXIF turns the landscape JPEG upright; transparency is composited, not dropped."""
    rotated = images.exif_rotated_jpeg()
    assert open_image(rotated).size == (240, 160)
    header = read_header(rotated)  # what the coordinator counts patches from, before any decoding
    assert (header.orientation, header.upright_size) == (6, (160, 240))
    assert load(open_image(rotated), "vllm").size == (160, 240)
    assert load(open_image(rotated), "transformers").size == (240, 160)
    for make in (images.rgba_png, images.palette_trns_png, images.la_png):
        data = make()
        vllm_way = np.asarray(load(open_image(data), "vllm"))
        dropped = np.asarray(open_image(data).convert("RGB"))
        assert not np.array_equal(vllm_way, dropped), make.__name__
