"""vLLM's own vision tower on the encoder node (--tower-impl), and the pool refusing a mix.

In float32 vLLM's tower, fed the raw pixels it normalises itself, must give what
transformers' tower gives on the processor's normalised pixels (the same weights loaded
into vLLM's fused layers, and pixels normalised once, not twice). In bfloat16 the two
round differently; that is why the implementation is part of an encoder's identity: real
encoder nodes report it in Describe and in every digest, and a coordinator refuses the
encoder whose implementation differs from the pool's, naming both.
"""

from __future__ import annotations

import pytest
import torch

from encdis.checkpoint import weights_fingerprint
from encdis.client.wire import content_digest
from encdis.encoder_node.preprocess import ImagePreprocessor
from encdis.encoder_node.settings import EncoderSettings
from encdis.encoder_node.tower import load_tower
from encdis.launcher import NodeProcess
from tests.integration.test_coordinator import (
    MAX_PIXELS,
    MIN_PIXELS,
    NODE_TIMEOUT,
    coordinator,
    encoder_args,
    png,
    states,
    wait_for,
)

pytest.importorskip("vllm")


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def prepared(ckpt, images: list[bytes], *, raw_pixels: bool):
    pre = ImagePreprocessor(ckpt, weights_fingerprint="fp", max_image_bytes=1 << 25, max_image_pixels=1 << 26,
                            raw_pixels=raw_pixels)
    out = [pre.prepare(i, data, pre.default_min_pixels, pre.default_max_pixels) for i, data in enumerate(images)]
    return [p.pixel_values for p in out], [p.grid_thw for p in out]


IMAGES = [png(112, 84, seed=1), png(224, 224, seed=2), png(336, 168, seed=3)]


def test_vllm_tower_in_float32_equals_transformers_tower_on_a_batch(tiny_ckpt) -> None:
    raw, grid = prepared(tiny_ckpt, IMAGES, raw_pixels=True)
    normalised, grid_n = prepared(tiny_ckpt, IMAGES, raw_pixels=False)
    assert grid == grid_n
    assert all(p.dtype == torch.uint8 for p in raw)  # vLLM's tower normalises on the device
    vllm_tower = load_tower(tiny_ckpt, "vllm", device="cpu", dtype="float32")
    hf_tower = load_tower(tiny_ckpt, "transformers", device="cpu", dtype="float32")
    assert vllm_tower.expects_raw_pixels and not hf_tower.expects_raw_pixels
    got = vllm_tower.forward(raw, grid)
    want = hf_tower.forward(normalised, grid)
    assert [t.shape for t in got] == [t.shape for t in want]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        # float32 rounding only: a wrong weight mapping or a double normalisation is O(1).
        assert rel_error(g, w) < 1e-4
    # Each image's rows are its own: the batch split is the same as one image at a time.
    alone = vllm_tower.forward(raw[1:2], grid[1:2])[0]
    assert rel_error(alone, got[1]) < 1e-5


def test_vllm_tower_in_bfloat16_is_bf16_close_to_float32(tiny_ckpt) -> None:
    raw, grid = prepared(tiny_ckpt, IMAGES, raw_pixels=True)
    bf16 = load_tower(tiny_ckpt, "vllm", device="cpu", dtype="bfloat16").forward(raw, grid)
    fp32 = load_tower(tiny_ckpt, "vllm", device="cpu", dtype="float32").forward(raw, grid)
    for b, f in zip(bf16, fp32, strict=True):
        assert b.dtype == torch.bfloat16
        err = rel_error(b, f)
        assert 0 < err < 5e-2  # rounded (not float32 in disguise), but only by bf16 noise


def test_auto_picks_vllm_below_float32_and_transformers_in_float32(tiny_ckpt) -> None:
    assert EncoderSettings(model=tiny_ckpt).resolved_tower_impl == "transformers"
    assert EncoderSettings(model=tiny_ckpt, dtype="bfloat16").resolved_tower_impl == "vllm"
    assert EncoderSettings(model=tiny_ckpt, dtype="bfloat16", tower_impl="transformers").resolved_tower_impl \
        == "transformers"
    with pytest.raises(ValueError, match="--tower-impl must be one of"):
        EncoderSettings(model=tiny_ckpt, tower_impl="onnx")


@pytest.fixture(scope="module")
def bf16_encoders(tiny_ckpt):
    """Two real bf16 encoder nodes: one on vLLM's tower (auto), one on transformers'."""
    nodes = {impl: NodeProcess([*encoder_args(tiny_ckpt, "127.0.0.1"), "--dtype", "bfloat16", "--tower-impl", impl],
                               host="127.0.0.1") for impl in ("auto", "transformers")}
    try:
        for node in nodes.values():
            node.wait_ready(NODE_TIMEOUT)
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()


async def test_a_bf16_pool_refuses_the_encoder_of_the_other_implementation(bf16_encoders, tiny_ckpt) -> None:
    vllm_node, hf_node = bf16_encoders["auto"], bf16_encoders["transformers"]
    image = png(112, 84, seed=4242)
    async with coordinator(tiny_ckpt, [vllm_node.address, hf_node.address], encoder_datatype="BF16") as coord:
        await wait_for(lambda: states(coord) == {vllm_node.address: "serving", hf_node.address: "refused"},
                       what="the transformers-tower encoder refused, the vLLM-tower one serving")
        reason = next(e.reason for e in coord.encoders() if e.address == hf_node.address)
        assert "tower_impl 'transformers' differs from the pool's 'vllm'" in reason, reason
        (embedded,) = (await coord.encode([image])).images
    assert embedded.embeds.dtype == torch.bfloat16
    fp = weights_fingerprint(tiny_ckpt)
    assert embedded.digest == content_digest(image, MIN_PIXELS, MAX_PIXELS, fp, datatype="BF16", tower_impl="vllm")
    assert embedded.digest != content_digest(image, MIN_PIXELS, MAX_PIXELS, fp, datatype="BF16",
                                             tower_impl="transformers")
    assert hf_node.metric("encdis_encoder_patches_total") == 0


async def test_a_pool_asking_for_transformers_takes_that_encoder_and_refuses_vllms(bf16_encoders, tiny_ckpt) -> None:
    vllm_node, hf_node = bf16_encoders["auto"], bf16_encoders["transformers"]
    async with coordinator(tiny_ckpt, [vllm_node.address, hf_node.address], encoder_datatype="BF16",
                           encoder_tower_impl="transformers") as coord:
        await wait_for(lambda: states(coord) == {vllm_node.address: "refused", hf_node.address: "serving"},
                       what="the vLLM-tower encoder refused, the transformers-tower one serving")
        reason = next(e.reason for e in coord.encoders() if e.address == vllm_node.address)
        assert "tower_impl 'vllm' differs from the pool's 'transformers'" in reason, reason
