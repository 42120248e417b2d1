"""Model identity: what an encoder must match to serve the LLM checkpoint.

An encoder whose tower weights, embedding hidden size, image-processor geometry, image
loader, embedding datatype or tower implementation differs from what the LLM node expects
gives other answers silently, so the pool refuses it (`refusal_reason`) rather than routing
to it.

The tower implementation too is one per pool: in bf16 vLLM's tower and transformers' round
differently (encoder_node/vllm_tower.py), enough to flip greedy tokens, so a pool mixing them
would answer the same request differently depending on where its images went. By default
(`expected_tower_impl`) the pool runs vLLM's tower below FP32, as `vllm serve` does, and
transformers' in FP32, where the two agree and an encoder needs no vLLM.

The datatype is refused, not converted: a BF16 tower's embedding cast to FP32 is still not
the FP32 tower's (nor the other way round), so a mixed pool would answer the same request
differently depending on where its images went, and the digest (which names the datatype)
would promise otherwise. The LLM node expects its engine's own dtype (FP32 on CPU, the
checkpoint's on GPU), as monolithic vLLM at that dtype runs its tower; `--encoder-datatype`
sets another on purpose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from encdis.client.encoder_client import EncoderDescription


@dataclass(frozen=True)
class ModelIdentity:
    """The LLM checkpoint's tower and processor, as encoders are checked against them."""

    weights_fingerprint: str
    hidden_size: int
    min_pixels: int
    max_pixels: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_loader: str = "vllm"
    datatype: str = "FP32"  # of the embeddings (wire name: FP32, BF16, FP16)
    tower_impl: str = "transformers"  # "vllm" or "transformers"

    @classmethod
    def from_processor(cls, fingerprint: str, hidden_size: int, processor: Mapping[str, Any],
                       image_loader: str = "vllm", datatype: str = "FP32",
                       tower_impl: str = "transformers") -> ModelIdentity:
        """From the checkpoint's preprocessor config (old- and new-style resize bounds)."""
        cfg = dict(processor)
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels") or size.get("shortest_edge")
        max_pixels = cfg.get("max_pixels") or size.get("longest_edge")
        if not min_pixels or not max_pixels:
            raise ValueError("the image processor config has neither min_pixels/max_pixels nor size bounds")
        return cls(
            weights_fingerprint=fingerprint,
            hidden_size=int(hidden_size),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            patch_size=int(cfg.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size", 2)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            image_loader=image_loader,
            datatype=datatype,
            tower_impl=tower_impl,
        )


def expected_tower_impl(setting: str, datatype: str) -> str:
    """--encoder-tower-impl resolved: auto is vLLM's tower below FP32, transformers' in FP32."""
    if setting != "auto":
        return setting
    return "transformers" if datatype == "FP32" else "vllm"


def refusal_reason(desc: EncoderDescription, want: ModelIdentity) -> str | None:
    """Why this encoder must not serve the LLM checkpoint, or None if it matches."""
    if desc.weights_fingerprint != want.weights_fingerprint:
        return (f"weights_fingerprint {desc.weights_fingerprint[:16]}... differs from the LLM checkpoint's "
                f"{want.weights_fingerprint[:16]}... (another checkpoint)")
    if desc.out_hidden_size != want.hidden_size:
        return f"out_hidden_size {desc.out_hidden_size} differs from the LLM's hidden size {want.hidden_size}"
    for name in ("patch_size", "merge_size", "temporal_patch_size"):
        got, expected = getattr(desc, name), getattr(want, name)
        if got and got != expected:
            return f"{name} {got} differs from the LLM checkpoint's {expected}"
    if desc.image_loader != want.image_loader:
        return (f"image_loader {desc.image_loader or 'unreported'!r} differs from the LLM node's "
                f"{want.image_loader!r} (the same image would give other embeddings)")
    if desc.datatype != want.datatype:
        return (f"embedding datatype {desc.datatype or 'unreported'} differs from the LLM node's {want.datatype} "
                f"(set the encoder's --dtype, or the LLM node's --encoder-datatype)")
    if desc.tower_impl != want.tower_impl:
        why = ("the implementations round differently, so answers would depend on which encoder got the image"
               if want.datatype != "FP32" else "one implementation per pool: digests and cached embeddings name it")
        return (f"tower_impl {desc.tower_impl or 'unreported'!r} differs from the pool's {want.tower_impl!r} "
                f"(in {want.datatype} {why}; set the encoder's --tower-impl, or the LLM node's --encoder-tower-impl)")
    # The coordinator sends the checkpoint's resize bounds with every request.
    if desc.min_pixels and desc.min_pixels > want.min_pixels:
        return f"its min_pixels {desc.min_pixels} is above the LLM checkpoint's {want.min_pixels}"
    if desc.max_pixels and desc.max_pixels < want.max_pixels:
        return f"its max_pixels {desc.max_pixels} is below the LLM checkpoint's {want.max_pixels}"
    return None
