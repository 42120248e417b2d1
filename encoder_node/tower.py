"""The Qwen2.5-VL vision tower alone: built from config.json's vision_config, visual weights only.

transformers' own vision class runs it, so embeddings are the reference model's: the
`pooler_output` of Qwen2_5_VisionTransformerPretrainedModel, i.e. the merged output
(t*h*w / merge_size² rows of the LLM's hidden size) that the language model consumes.
The language model's tensors are never opened (encdis.checkpoint reads only the shards
that hold `visual.` tensors).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from encdis.checkpoint import load_visual_state_dict, read_vision_config
from encdis.client.wire import datatype_of_torch


def load_tower(model_dir: str | os.PathLike, impl: str, *, device: str, dtype: str):
    """The tower of implementation `impl` ("transformers" or "vllm"); both have VisionTower's interface."""
    if impl == "vllm":
        from encdis.encoder_node.vllm_tower import VllmVisionTower

        return VllmVisionTower(model_dir, device=device, dtype=dtype)
    if impl == "transformers":
        return VisionTower(model_dir, device=device, dtype=dtype)
    raise ValueError(f"unknown tower implementation {impl!r}")


class VisionTower:
    """One loaded vision tower on one device; `forward` runs a varlen batch of images."""

    impl = "transformers"
    expects_raw_pixels = False  # it takes the processor's normalised pixels

    def __init__(self, model_dir: str | os.PathLike, *, device: str = "cpu", dtype: str = "float32") -> None:
        self.device = torch.device(device)
        self.datatype = datatype_of_torch(dtype)  # raises for a dtype the wire cannot carry
        self.dtype = getattr(torch, dtype)
        self.vision_config_dict = read_vision_config(model_dir)
        config = Qwen2_5_VLVisionConfig(**self.vision_config_dict)
        model = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=self.dtype)
        state = load_visual_state_dict(model_dir)
        # strict: a missing or unexpected tensor means the checkpoint is not this architecture.
        model.load_state_dict({k: v.to(self.dtype) for k, v in state.items()}, strict=True)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.merge_size = int(config.spatial_merge_size)
        self.out_hidden_size = int(config.out_hidden_size)

    def forward(self, pixel_values: Sequence[torch.Tensor], grid_thw: Sequence[tuple[int, int, int]]
                ) -> list[torch.Tensor]:
        """Embeddings of several images from ONE forward pass (patches concatenated, varlen attention).

        Returns one CPU tensor per image, (t*h*w / merge_size², out_hidden_size), in the tower's dtype.
        """
        grid = torch.tensor([list(g) for g in grid_thw], dtype=torch.long)
        pixels = torch.cat(list(pixel_values), dim=0).to(self.device, self.dtype)
        with torch.inference_mode():
            merged = self.model(pixels, grid_thw=grid.to(self.device)).pooler_output
        sizes = (grid.prod(-1) // self.merge_size**2).tolist()
        return [t.contiguous() for t in torch.split(merged.to("cpu"), sizes)]
