"""Decoded image -> the RGB image the processor gets: vLLM's serving rules, or transformers' own.

`vllm` (the default) follows vLLM's media loader (`vllm/multimodal/media/image.py`,
`vllm/multimodal/image.py`), so an answer equals `vllm serve`'s fed the same bytes:
  - EXIF orientation applied (ImageOps.exif_transpose; a broken EXIF block is ignored);
  - transparency (RGBA, LA, PA, or a tRNS chunk on P/L/RGB) composited onto white;
  - any other mode converted to RGB.
`transformers` hands the image over as decoded: the processor converts it to RGB itself,
dropping alpha and ignoring EXIF.

The encoder node does not install vLLM, so the rules are written here; tests compare them
with vLLM's own functions where vLLM is installed. The loader is part of each embedding's
content digest: the same bytes loaded differently are different embeddings.
"""

from __future__ import annotations

import contextlib

from PIL import Image, ImageOps

from encdis.encoder_node.settings import LOADERS

WHITE = (255, 255, 255)


def has_transparency(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA") or "transparency" in getattr(image, "info", {})


def vllm_rgb(image: Image.Image) -> Image.Image:
    """vLLM's `normalize_image` then `convert_image_mode(image, "RGB")` with a white background."""
    with contextlib.suppress(Exception):
        image = ImageOps.exif_transpose(image)
    if image.mode == "RGB":
        return image
    if has_transparency(image):
        if image.mode != "RGBA":
            image = image.convert("RGBA")
        out = Image.new("RGB", image.size, WHITE)
        out.paste(image, mask=image.split()[3])
        return out
    return image.convert("RGB")


def load(image: Image.Image, loader: str) -> Image.Image:
    """`image` (decoded) as the chosen loader hands it to the processor."""
    if loader == "vllm":
        return vllm_rgb(image)
    if loader == "transformers":
        return image
    raise ValueError(f"unknown image loader {loader!r}; one of {', '.join(LOADERS)}")
