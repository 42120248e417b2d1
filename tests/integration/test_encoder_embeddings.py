"""Embeddings over real gRPC on loopback equal transformers' own Qwen2.5-VL image features.

The reference is the full Qwen2_5_VLForConditionalGeneration of the same checkpoint with its
own processor (`model.model.get_image_features(...).pooler_output`): what the monolithic model
feeds its language model. The node is the real EncoderNode (tests/encoder_inproc.py).
"""

from __future__ import annotations

import io
import shutil

import numpy as np
import pytest

from encdis.checkpoint import visual_shards, weights_fingerprint
from encdis.client import EncoderClient
from encdis.client.wire import content_digest
from encdis.encoder_node.image_loader import load as load_image
from encdis.encoder_node.settings import EncoderSettings
from tests import encoder_images as images
from tests.encoder_inproc import InProcessEncoder
from tests.needs import require_module

torch = require_module("torch")

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 256  # the tiny checkpoint's processor bounds


@pytest.fixture(scope="module")
def node(tiny_ckpt):
    # The tests compare forwards: no cache answers a repeated image.
    with InProcessEncoder(EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, cache_bytes=0)) as n:
        yield n


@pytest.fixture(scope="module")
def client(node):
    with EncoderClient(node.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def transformers_loader_client(tiny_ckpt):
    """A node with `--image-loader transformers`: images go to the processor as decoded."""
    settings = EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, image_loader="transformers")
    with InProcessEncoder(settings) as n, EncoderClient(n.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """transformers' full model: image bytes -> (pooler_output rows of that image, grid_thw)."""
    from PIL import Image
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(str(tiny_ckpt))
    prompt = "<|vision_start|><|image_pad|><|vision_end|>Describe."

    def features(data: bytes, loader: str = "vllm", **kwargs) -> tuple[np.ndarray, tuple[int, ...]]:
        """The features of the image as `loader` decodes it (the encoder's default: vLLM's rules)."""
        image = load_image(Image.open(io.BytesIO(data)), loader)
        inputs = processor(text=[prompt], images=[image], return_tensors="pt", **kwargs)
        with torch.no_grad():
            out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        return out.pooler_output[0].numpy(), tuple(inputs["image_grid_thw"][0].tolist())

    return features


@pytest.mark.parametrize("loader", ["vllm", "transformers"])
@pytest.mark.parametrize("kind", list(images.KINDS))
def test_embedding_equals_transformers_image_features(kind, loader, client, transformers_loader_client, reference,
                                                      tiny_ckpt):
    make, mode = images.KINDS[kind]
    data = make()
    from PIL import Image

    assert Image.open(io.BytesIO(data)).mode == mode  # the test covers the kind it claims
    (emb,) = (client if loader == "vllm" else transformers_loader_client).encode([data])
    ref, grid = reference(data, loader)
    assert emb.grid_thw == grid
    assert emb.datatype == "FP32" and emb.shape == ref.shape
    np.testing.assert_allclose(emb.array(), ref, rtol=1e-5, atol=1e-5)
    assert emb.digest == content_digest(data, MIN_PIXELS, MAX_PIXELS, weights_fingerprint(tiny_ckpt), loader)


def test_several_images_in_one_request_one_forward_equal_one_at_a_time(client, reference):
    datas = [make() for make, _mode in images.KINDS.values()]
    batched = client.encode(datas)
    assert [e.image_index for e in batched] == list(range(len(datas)))
    # All of them ran in ONE varlen forward pass (their patches fit the default budget).
    patches = [e.num_patches for e in batched]
    for e in batched:
        assert e.batch is not None and list(e.batch.image_patches) == patches
    for data, e in zip(datas, batched, strict=True):
        (single,) = client.encode([data])
        assert single.grid_thw == e.grid_thw and single.digest == e.digest
        np.testing.assert_allclose(e.array(), single.array(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(e.array(), reference(data)[0], rtol=1e-5, atol=1e-5)


def test_per_request_resize_bounds_change_the_grid_and_the_digest(client, reference):
    data = images.rgb_jpeg()
    small = 56 * 56 * 4
    (default,) = client.encode([data])
    (emb,) = client.encode([data], max_pixels=small)
    ref, grid = reference(data, size={"shortest_edge": MIN_PIXELS, "longest_edge": small})
    assert emb.grid_thw == grid and emb.num_patches < default.num_patches
    np.testing.assert_allclose(emb.array(), ref, rtol=1e-5, atol=1e-5)
    assert emb.digest != default.digest


def test_small_chunks_reassemble_to_the_same_embedding(client):
    data = images.near_max_pixels()
    (whole,) = client.encode([data])
    (chunked,) = client.encode([data], max_chunk_bytes=1024)
    assert chunked.data == whole.data  # 256 rows x 128 x 4 bytes in 128 chunks


def test_describe_reports_model_identity_limits_and_host(client, tiny_ckpt):
    d = client.describe()
    assert d.weights_fingerprint == weights_fingerprint(tiny_ckpt)
    assert d.out_hidden_size == 128 and d.vision_config["out_hidden_size"] == 128
    assert d.device == "cpu" and d.datatype == "FP32"
    assert (d.min_pixels, d.max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    assert (d.patch_size, d.merge_size, d.temporal_patch_size) == (14, 2, 2)
    assert d.max_batch_patches == 16384 and d.max_images_per_request == 64
    assert d.max_image_bytes == 32 * 1024 * 1024 and d.max_image_pixels > 0 and d.max_chunk_bytes == 4 * 1024 * 1024
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert d.boot_id == f.read().strip()
    assert d.hostname and d.version


def test_node_serves_from_the_visual_shard_alone(tiny_ckpt, tmp_path, client):
    """The encoder never reads language-model tensors: their shards can be missing."""
    ckpt = tmp_path / "visual-only"
    shutil.copytree(tiny_ckpt, ckpt)
    keep = set(visual_shards(ckpt))
    removed = [p for p in ckpt.glob("model-*.safetensors") if p.name not in keep]
    assert len(removed) == 2
    for p in removed:
        p.unlink()
    data = images.rgb_jpeg(seed=7)
    with InProcessEncoder(EncoderSettings(model=ckpt, host="127.0.0.1", port=0)) as lone:
        with EncoderClient(lone.address, timeout=120) as c:
            (emb,) = c.encode([data])
            assert c.describe().weights_fingerprint == weights_fingerprint(tiny_ckpt)
    (full,) = client.encode([data])
    assert emb.data == full.data


def test_bfloat16_node_sends_bf16_close_to_the_fp32_reference(tiny_ckpt, reference):
    """The GPU default dtype, run on CPU: BF16 on the wire, values within bf16 rounding."""
    data = images.rgb_jpeg(seed=3)
    settings = EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, dtype="bfloat16")
    with InProcessEncoder(settings) as n, EncoderClient(n.address, timeout=120) as c:
        assert c.describe().datatype == "BF16"
        (emb,) = c.encode([data])
    ref, grid = reference(data)
    assert emb.datatype == "BF16" and emb.grid_thw == grid and len(emb.data) == ref.size * 2
    np.testing.assert_allclose(emb.array(), ref, rtol=0.05, atol=0.05)


def test_pixels_equal_what_vllms_own_processor_feeds_its_tower(tiny_ckpt):
    """vLLM 0.32 loads the processor with AutoProcessor (torchvision Qwen2VLImageProcessor) and, with
    mm_device_do_normalize (its default), skips rescale/normalize on the host and applies them on
    device. Our pixels must be exactly those, normalized: same class, same grid, same values."""
    require_module("vllm")
    from transformers import Qwen2_5_VLProcessor
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.transformers_utils.processor import get_processor

    from encdis.encoder_node.preprocess import ImagePreprocessor

    vllm_proc = get_processor(str(tiny_ckpt), processor_cls=Qwen2_5_VLProcessor).image_processor
    ours = ImagePreprocessor(tiny_ckpt, weights_fingerprint="fp", max_image_bytes=1 << 25, max_image_pixels=1 << 26)
    assert type(vllm_proc) is type(ours.processor)
    for make, _mode in images.KINDS.values():
        data = make()
        p = ours.prepare(0, data, MIN_PIXELS, MAX_PIXELS)
        # The image as vLLM's serving loader hands it to that processor.
        image = ImageMediaIO(image_mode="RGB").load_bytes(data).media
        raw = vllm_proc(images=[image], do_rescale=False, do_normalize=False, return_tensors="pt")
        assert tuple(raw["image_grid_thw"][0].tolist()) == p.grid_thw
        # Undo the patch layout's channel grouping: each row is (channel, temporal, patch, patch).
        mean = torch.tensor(vllm_proc.image_mean).repeat_interleave(2 * 14 * 14)
        std = torch.tensor(vllm_proc.image_std).repeat_interleave(2 * 14 * 14)
        normalized = (raw["pixel_values"].float() / 255 - mean) / std
        torch.testing.assert_close(normalized, p.pixel_values, rtol=1e-5, atol=1e-5)
