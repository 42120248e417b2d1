"""Image bytes -> pixel patches, with the checkpoint's own image processor.

The processor is the one vLLM instantiates for Qwen2.5-VL (AutoProcessor's image
processor: transformers' torchvision-backed Qwen2VLImageProcessor), so pixel values and
grid_thw equal vLLM's and transformers' own paths. Images are validated from their
header before any decoding: size in bytes, format, decoded pixels, aspect ratio.
Every rejection is an InvalidArgument naming the image index and the reason.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from encdis.client.errors import InvalidArgument
from encdis.client.wire import content_digest
from encdis.encoder_node import image_loader
from encdis.image_header import ImageHeader, open_image, read_header

# smart_resize refuses aspect ratios above this.
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: its patches, grid and embedding key."""

    index: int
    # (t*h*w, channels*temporal_patch*patch*patch): float32 normalised, or uint8 for a tower normalising itself
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    digest: str
    # When decoding (bytes to RGB pixels) began and ended (time.time_ns()); the image processor's
    # resize and normalisation follow it.
    decode_ns: tuple[int, int] = (0, 0)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


class ImagePreprocessor:
    """Validates, decodes and preprocesses images for one checkpoint."""

    def __init__(self, model_dir: str | os.PathLike, *, weights_fingerprint: str, max_image_bytes: int,
                 max_image_pixels: int, min_pixels: int = 0, max_pixels: int = 0, image_loader: str = "vllm",
                 datatype: str = "FP32", tower_impl: str = "transformers", raw_pixels: bool = False) -> None:
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        size = self.processor.size
        self.default_min_pixels = int(size["shortest_edge"])
        self.default_max_pixels = int(size["longest_edge"])
        # The node's bounds on per-request values: the checkpoint's own unless widened by settings.
        self.min_pixels = int(min_pixels or self.default_min_pixels)
        self.max_pixels = int(max_pixels or self.default_max_pixels)
        # A request without bounds gets the checkpoint's (what the monolithic model does), so the
        # node's range must contain them.
        if not self.min_pixels <= self.default_min_pixels <= self.default_max_pixels <= self.max_pixels:
            raise ValueError(
                f"the node's pixel bounds [{self.min_pixels}, {self.max_pixels}] must contain the checkpoint's "
                f"[{self.default_min_pixels}, {self.default_max_pixels}] (--min-pixels/--max-pixels)"
            )
        self.patch_size = int(self.processor.patch_size)
        self.merge_size = int(self.processor.merge_size)
        self.temporal_patch_size = int(self.processor.temporal_patch_size)
        self.weights_fingerprint = weights_fingerprint
        self.image_loader = image_loader
        self.datatype = datatype  # the tower's output datatype: part of each image's digest
        self.tower_impl = tower_impl  # part of each image's digest too
        # vLLM's tower normalises on the device (from uint8, in float32): the processor must not
        # normalise first, or pixels would be normalised twice.
        self.raw_pixels = raw_pixels
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels

    def resolve_bounds(self, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """The effective (min_pixels, max_pixels) of a request: 0 means the checkpoint's own."""
        lo = int(min_pixels or self.default_min_pixels)
        hi = int(max_pixels or self.default_max_pixels)
        bounds = f"this node's bounds [{self.min_pixels}, {self.max_pixels}]"
        if not self.min_pixels <= lo <= self.max_pixels:
            raise InvalidArgument(f"min_pixels {lo} is outside {bounds}")
        if not self.min_pixels <= hi <= self.max_pixels:
            raise InvalidArgument(f"max_pixels {hi} is outside {bounds}")
        if lo > hi:
            raise InvalidArgument(f"min_pixels {lo} is above max_pixels {hi}")
        return lo, hi

    def inspect(self, index: int, data: bytes) -> ImageHeader:
        """Check an image from its header alone; raises InvalidArgument('image i: why')."""
        if not data:
            raise InvalidArgument.for_image(index, "empty (0 bytes)")
        if len(data) > self.max_image_bytes:
            raise InvalidArgument.for_image(index,
                                            f"{len(data)} bytes exceeds the limit of {self.max_image_bytes} bytes")
        try:
            header = read_header(data)
        except ValueError as e:
            raise InvalidArgument.for_image(index, str(e)) from None
        width, height = header.width, header.height
        if width * height > self.max_image_pixels:
            raise InvalidArgument.for_image(
                index, f"{width}x{height} = {width * height} pixels exceeds the limit of {self.max_image_pixels} "
                "pixels")
        ratio = max(width, height) / min(width, height)
        if ratio > MAX_ASPECT_RATIO:
            raise InvalidArgument.for_image(
                index, f"aspect ratio {ratio:.1f} ({width}x{height}) exceeds {MAX_ASPECT_RATIO}, "
                "the most the image processor allows")
        return header

    def num_patches(self, header: ImageHeader, min_pixels: int, max_pixels: int) -> int:
        """Patches the image will have (smart_resize on the header's size), before decoding."""
        factor = self.patch_size * self.merge_size
        h, w = smart_resize(header.height, header.width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        return (h // self.patch_size) * (w // self.patch_size)

    def prepare(self, index: int, data: bytes, min_pixels: int, max_pixels: int) -> PreparedImage:
        """Decode and preprocess one (already inspected) image. CPU-heavy: call it off the event loop."""
        t_decode = time.time_ns()
        try:
            img = open_image(data)
        except ValueError as e:
            raise InvalidArgument.for_image(index, str(e)) from None
        try:
            img.load()
        except Exception as e:  # PIL raises many types for broken files
            raise InvalidArgument.for_image(index, f"cannot decode {img.format}: {e}") from None
        try:
            rgb = image_loader.load(img, self.image_loader)
            decoded = time.time_ns()
            raw = {"do_rescale": False, "do_normalize": False} if self.raw_pixels else {}
            out = self.processor(images=[rgb], size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                 return_tensors="pt", **raw)
        except (ValueError, OSError, TypeError) as e:
            raise InvalidArgument.for_image(index, f"preprocessing failed: {e}") from None
        t, h, w = (int(v) for v in out["image_grid_thw"][0].tolist())
        return PreparedImage(
            index=index,
            pixel_values=out["pixel_values"],
            grid_thw=(t, h, w),
            digest=self.digest(data, min_pixels, max_pixels),
            decode_ns=(t_decode, decoded),
        )

    def digest(self, data: bytes, min_pixels: int, max_pixels: int) -> str:
        """The image's content digest: known before decoding, so a cached image is never decoded."""
        return content_digest(data, min_pixels, max_pixels, self.weights_fingerprint, self.image_loader,
                              self.datatype, self.tower_impl)
