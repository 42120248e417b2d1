"""Both users of the image probe read headers only: the encoder node's inspect (before it spends
memory decoding) and the coordinator's grids (before any encoder sees the request) decode no
pixel, whatever size the image declares."""

from __future__ import annotations

import dataclasses
import io

import pytest
from PIL import Image, ImageFile

from encdis.client.errors import InvalidArgument
from encdis.encoder_node.preprocess import ImagePreprocessor
from encdis.llm_node.coordinator import Coordinator
from encdis.llm_node.coordinator.settings import CoordinatorSettings


def _png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = ImageFile.ImageFile.load

    def counting(self):
        seen.append(str(self.format))
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting)
    return seen


def test_the_encoders_inspect_decodes_nothing(tiny_ckpt, loads: list[str]) -> None:
    pre = ImagePreprocessor(tiny_ckpt, weights_fingerprint="fp", max_image_bytes=1 << 25,
                            max_image_pixels=5000 * 5000)
    header = pre.inspect(0, _png(4000))
    assert (header.width, header.height) == (4000, 4000)
    with pytest.raises(InvalidArgument, match="64000000 pixels exceeds the limit"):
        pre.inspect(1, _png(8000))
    assert loads == []


def test_the_coordinators_grids_decode_nothing(tiny_ckpt, loads: list[str]) -> None:
    settings = dataclasses.replace(CoordinatorSettings(), encoder_datatype="FP32")
    coordinator = Coordinator.from_checkpoint(settings, None, tiny_ckpt)
    images = [_png(8000)] * 16
    grids = coordinator.image_grids(images)
    assert len(grids) == 16 and len(set(grids)) == 1
    assert coordinator.grid_tokens(grids[0]) == 256  # the tiny processor's max_pixels, 28*28*256
    assert loads == []
