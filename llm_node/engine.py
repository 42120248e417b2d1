"""Engine host: vLLM's AsyncLLM in the LLM node's process, fed pre-computed image embeddings.

The engine starts with `enable_mm_embeds=True` and `limit_mm_per_prompt={"image": 0,
"video": 0}`, so vLLM replaces the vision tower with a parameter-less placeholder and
gives its memory to the KV cache. Each request carries, for its images in prompt order, an
`image_grid_thw` (n x 3), from which vLLM expands the placeholders, and the content digests as
multimodal uuids, so vLLM's caches key on content. The rows themselves reach the workers
through the node's shared region and encdis's encoder-cache connector (--handoff region,
the default), or in the request as one concatenated `image_embeds` tensor (--handoff embeds).
How the embeddings get there, what that costs and why it is done this way: llm_node/handoff.py.

The same host with `tower=True` is the monolithic reference (raw images, tower loaded):
one set of engine arguments for both, so the only difference is where the tower runs.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encdis.client.errors import InvalidArgument, ResourceExhausted, Unavailable
from encdis.llm_node.coordinator.records import ImageEmbedding
from encdis.llm_node.embedding_region import EmbeddingRegion
from encdis.llm_node.handoff import EmbeddingHandoff, RegionHandoff
from encdis.llm_node.openai_layer import engine_surface_kwargs
from encdis.llm_node.settings import LLMSettings

log = logging.getLogger(__name__)

# A vLLM worker extension: its methods become callable by name through collective_rpc,
# so probing the workers needs no pickled closures (and no insecure serialization).
PROBE_CLS = "encdis.llm_node.engine.VisionTowerProbe"


class VisionTowerProbe:
    """Mixed into every vLLM worker: reports what of the vision tower the worker holds, and (for
    bench/fidelity/fidelity.py) records the embeddings vLLM's own tower computes, as vLLM runs it."""

    def encdis_capture_embeddings(self, enable: bool) -> bool:
        """Start (True) or stop (False) recording every output of the model's vision tower.
        Returns whether the worker has a tower to record (the LLM node's has none)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        visual = getattr(model, "visual", None)
        if visual is None or not any(True for _ in visual.parameters()):
            return False
        if enable and not hasattr(self, "_encdis_captured"):
            original = visual.forward
            captured: list = []

            def recording(*args, **kwargs):
                out = original(*args, **kwargs)
                if self._encdis_capturing:  # type: ignore[attr-defined]
                    captured.append(out.detach().to("cpu", copy=True))
                return out

            visual.forward = recording
            self._encdis_captured = captured  # type: ignore[attr-defined]
        self._encdis_capturing = bool(enable)  # type: ignore[attr-defined]
        return True

    def encdis_dump_embeddings(self, path: str) -> int:
        """Write the outputs recorded so far (concatenated, in order) to `path` as safetensors
        ("embeds"; no pickle), clear them, and return their row count."""
        import torch
        from safetensors.torch import save_file

        captured = getattr(self, "_encdis_captured", [])
        rows = torch.cat(captured) if captured else torch.empty(0)
        captured.clear()
        if self.rank == 0:  # type: ignore[attr-defined]
            save_file({"embeds": rows.contiguous()}, path)
        return int(rows.shape[0]) if rows.ndim else 0

    def encdis_vision_tower(self) -> dict[str, Any]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        visual = getattr(model, "visual", None)
        names = [n for n, _ in model.named_parameters() if "visual" in n.split(".")]
        numel = sum(p.numel() for n, p in model.named_parameters() if "visual" in n.split("."))
        return {
            "visual_type": type(visual).__name__ if visual is not None else None,
            "visual_parameters": int(numel),
            "visual_parameter_names": names[:5],
            "model_parameters": int(sum(p.numel() for p in model.parameters())),
        }


@dataclass(frozen=True)
class SamplingSpec:
    """What the caller asked for; greedy unless temperature > 0."""

    max_tokens: int | None = 64  # None: what the context leaves after the prompt, as `vllm serve` does
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def to_vllm(self):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop=list(self.stop) or None,
            output_kind=RequestOutputKind.DELTA,
        )


@dataclass
class GenerationDelta:
    """Text and token ids produced since the previous delta of one request."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    prompt_tokens: int = 0


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def resolve_dtype(dtype: str, cpu: bool) -> str:
    """float32 on CPU unless told otherwise (bf16 logits differ enough to flip greedy tokens)."""
    if dtype != "auto":
        return dtype
    return "float32" if cpu else "auto"


def engine_kwargs(settings: LLMSettings, *, tower: bool, max_images: int = 16,
                  region: str | None = None) -> dict[str, Any]:
    """AsyncEngineArgs for the node (tower=False) or the monolithic reference (tower=True).

    `region`: the node's shared region (llm_node/embedding_region.py); its workers then take
    embeddings from it through encdis's encoder-cache connector."""
    cpu = is_cpu()
    kw: dict[str, Any] = dict(
        model=settings.model,
        tensor_parallel_size=settings.tp,
        dtype=resolve_dtype(settings.dtype, cpu),
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        seed=0,
        enforce_eager=cpu,  # no CUDA graphs / compile on CPU: faster start, same numerics
        worker_extension_cls=PROBE_CLS,
        # vLLM's own statistics, as `vllm serve` keeps them: its vllm:* metrics beside encdis's, and
        # the per-request stats its request spans are built from.
        disable_log_stats=settings.disable_log_stats and not settings.otlp_traces_endpoint,
        # The engine side of `vllm serve`'s OpenAI-surface flags (sampling defaults, logprobs, ...).
        **engine_surface_kwargs(settings),
    )
    if settings.otlp_traces_endpoint:  # vLLM's own request spans, joined to encdis's by trace_headers
        kw["otlp_traces_endpoint"] = settings.otlp_traces_endpoint
    if not cpu:
        kw["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if tower:
        kw["limit_mm_per_prompt"] = {"image": max_images, "video": 0}
        heads = vision_heads(settings.model)
        if heads is not None and heads % settings.tp:
            # What `vllm serve` needs for such a checkpoint: the tower replicated per rank.
            kw["mm_encoder_tp_mode"] = "data"
    else:
        kw["limit_mm_per_prompt"] = {"image": 0, "video": 0}
        kw["enable_mm_embeds"] = True
        # vLLM still builds the (weightless) tower's modules and, in "weights" mode, asserts
        # that its heads divide by the TP size; the node never runs the tower, so any
        # checkpoint must start at any TP.
        kw["mm_encoder_tp_mode"] = "data"
        kw["mm_processor_cache_gb"] = settings.mm_processor_cache_gb
        ipc = settings.mm_tensor_ipc
        if ipc == "auto":
            # torch_shm hands tensors to the engine core through shared memory instead of
            # serialising them; vLLM supports it with a single rank only.
            ipc = "torch_shm" if settings.tp == 1 else "direct_rpc"
        kw["mm_tensor_ipc"] = ipc
        if region is not None:
            from vllm.config import ECTransferConfig

            from encdis.llm_node.ec_connector import CONNECTOR_NAME

            kw["ec_transfer_config"] = ECTransferConfig(
                ec_connector=CONNECTOR_NAME, ec_role="ec_consumer",
                ec_connector_module_path="encdis.llm_node.ec_connector",
                ec_connector_extra_config={"region": region})
    return kw


def vision_heads(model: str) -> int | None:
    """The checkpoint's vision attention heads (None where config.json does not say)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        return int(config["vision_config"]["num_heads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prepare_environment(settings: LLMSettings, kwargs: dict[str, Any]) -> None:
    """Process environment vLLM reads at engine start (set only where the operator has not)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if kwargs.get("mm_tensor_ipc") == "torch_shm" or settings.tp > 1:
        # torch_shm refuses to start without spawn; spawn is also what CPU workers need.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(settings.kv_cache_gib)))))
        if settings.tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1))
                                                                for i in range(settings.tp))


def cpu_worker_threads() -> int:
    """The OpenMP threads vLLM's CPU worker runs at TP 1: the usable cores less the one it reserves
    for the engine's scheduler process (vllm/utils/ompmultiprocessing.py). An encoder on the same
    kind of host runs this many (`--torch-threads`) for bf16 embeddings bit-equal to the engine's."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class EngineHost:
    """Owns one AsyncLLM; `generate` streams deltas for a rendered prompt and its images."""

    def __init__(self, settings: LLMSettings, *, tower: bool = False, max_images: int = 16) -> None:
        self.settings = settings
        self.tower = tower
        self.region = EmbeddingRegion() if not tower and settings.handoff == "region" else None
        self.kwargs = engine_kwargs(settings, tower=tower, max_images=max_images,
                                    region=self.region.path if self.region else None)
        self.handoff: EmbeddingHandoff | RegionHandoff = (
            RegionHandoff(self.region) if self.region else
            EmbeddingHandoff(shared_memory=self.kwargs.get("mm_tensor_ipc") == "torch_shm"))
        self._llm = None

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("engine not started")
        return self._llm

    def embedding_datatype(self) -> str:
        """The wire datatype of the engine's dtype ("FP32" on CPU, the checkpoint's on GPU)."""
        from encdis.client.wire import datatype_of_torch

        return datatype_of_torch(str(self.llm.model_config.dtype).removeprefix("torch."))

    def start(self) -> None:
        """Build the engine (blocking: loads weights, profiles memory, starts the engine core)."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        prepare_environment(self.settings, self.kwargs)
        t0 = time.monotonic()
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.kwargs))
        if self.region is not None:
            self.region.dtype = self._llm.model_config.dtype  # the rows the workers map are the engine's dtype
            room, want = self.region.room_bytes(), self.settings.max_inflight_embedding_bytes
            if room < want:
                log.warning("the shared region %s has %d MiB free, less than --max-inflight-embedding-bytes "
                            "(%d MiB): image requests beyond it get RESOURCE_EXHAUSTED. Give /dev/shm more room "
                            "(docker --shm-size; Kubernetes: an emptyDir of medium Memory) or run --handoff embeds",
                            self.region.path, room >> 20, want >> 20)
        log.info("vLLM engine ready in %.1fs (%s)", time.monotonic() - t0,
                 "tower loaded" if self.tower else "vision tower not loaded, embeddings in")

    async def generate(
        self,
        prompt: str,
        sampling: SamplingSpec,
        *,
        images: Sequence[ImageEmbedding] = (),
        raw_images: Sequence[Any] = (),
        request_id: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """Stream a completion. Node: `images` (embeddings). Reference: `raw_images` (PIL).
        `trace_headers`: W3C trace context (traceparent) vLLM's request span joins."""
        inputs: dict[str, Any] = {"prompt": prompt}
        if raw_images:
            inputs["multi_modal_data"] = {"image": list(raw_images)}
        if not images:
            async for delta in self._generate(inputs, sampling, request_id, trace_headers):
                yield delta
            return
        try:
            inputs["multi_modal_data"], inputs["multi_modal_uuids"] = await self.handoff.mm_data(images)
        except OSError as e:
            raise ResourceExhausted(f"no room for the request's embeddings in the shared region ({e})") from None
        try:
            async for delta in self._generate(inputs, sampling, request_id, trace_headers):
                yield delta
        finally:
            self.handoff.done(images)  # however the request ended

    async def _generate(self, inputs: dict[str, Any], sampling: SamplingSpec, request_id: str | None,
                        trace_headers: Mapping[str, str] | None) -> AsyncIterator[GenerationDelta]:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        rid = request_id or uuid.uuid4().hex
        prompt_tokens = 0
        started = False
        try:
            async for out in self.llm.generate(inputs, sampling.to_vllm(), rid, trace_headers=trace_headers):
                started = True
                if out.prompt_token_ids is not None:
                    prompt_tokens = len(out.prompt_token_ids)
                c = out.outputs[0]
                yield GenerationDelta(
                    text=c.text,
                    token_ids=list(c.token_ids),
                    finished=out.finished,
                    finish_reason=c.finish_reason if out.finished else None,
                    prompt_tokens=prompt_tokens,
                )
        except EngineDeadError:
            raise Unavailable("the LLM engine has died; this node is restarting") from None
        except (VLLMClientError, ValueError) as e:
            # vLLM validates a request (e.g. prompt plus max_tokens longer than max_model_len)
            # before generating anything: such a failure is the request's, not the node's.
            if started:
                raise
            raise InvalidArgument(f"rejected by the engine: {e}") from None

    @property
    def dead(self) -> bool:
        """vLLM's engine core has died (its process exited or its output loop ended)."""
        return self._llm is not None and bool(self._llm.errored)

    async def vision_tower(self) -> list[dict[str, Any]]:
        """Per worker: the vision-tower parameters it holds (0 for the node's engine)."""
        return await self.llm.collective_rpc("encdis_vision_tower")

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self.handoff.close()
