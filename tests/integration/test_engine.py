"""The engine host: vLLM started with the vision tower not loaded, fed embeddings.

One in-process engine for the module. Its inputs here come from transformers' own vision
tower (not from an encoder node), and its greedy output must equal transformers'
monolithic generate on the same checkpoint: several images of different sizes, in both
orders, so an embedding split or ordering mistake cannot pass.
"""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

import pytest

from encdis.llm_node.coordinator import ImageEmbedding
from encdis.llm_node.demo import synthetic_photo
from encdis.llm_node.engine import EngineHost, SamplingSpec, engine_kwargs
from encdis.llm_node.prompt import PromptRenderer
from encdis.llm_node.settings import LLMSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = "What differs between these pictures?"
NEW_TOKENS = 12


def test_engine_arguments_leave_the_tower_out(tiny_ckpt: Path):
    s = LLMSettings(model=str(tiny_ckpt))
    node = engine_kwargs(s, tower=False)
    assert node["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    assert node["enable_mm_embeds"] is True
    assert node["tensor_parallel_size"] == 1
    assert node["mm_tensor_ipc"] == "torch_shm"  # tp == 1: embeddings cross to the engine without serialising
    assert engine_kwargs(LLMSettings(model=str(tiny_ckpt), tp=2), tower=False)["mm_tensor_ipc"] == "direct_rpc"
    # The weightless tower's heads never constrain the node's TP; vLLM keeps no second copy of
    # the embeddings the coordinator caches unless asked.
    assert node["mm_encoder_tp_mode"] == "data" and node["mm_processor_cache_gb"] == 0
    assert engine_kwargs(LLMSettings(model=str(tiny_ckpt), mm_processor_cache_gb=2), tower=False)[
        "mm_processor_cache_gb"] == 2
    # With the node's shared region, its workers take embeddings from it through encdis's connector.
    assert "ec_transfer_config" not in node
    ec = engine_kwargs(s, tower=False, region="/dev/shm/encdis-region-x")["ec_transfer_config"]
    assert (ec.ec_connector, ec.ec_role, ec.ec_connector_module_path, ec.ec_connector_extra_config) == (
        "EncdisECConnector", "ec_consumer", "encdis.llm_node.ec_connector", {"region": "/dev/shm/encdis-region-x"})
    reference = engine_kwargs(s, tower=True, max_images=3)
    assert reference["limit_mm_per_prompt"] == {"image": 3, "video": 0}
    assert "enable_mm_embeds" not in reference
    # The reference is `vllm serve` with its defaults: 2 heads divide TP 2, so no encoder TP mode.
    assert "mm_encoder_tp_mode" not in engine_kwargs(LLMSettings(model=str(tiny_ckpt), tp=2), tower=True)
    assert "mm_processor_cache_gb" not in reference
    # Everything else is the same engine: the only difference is where the tower runs.
    same = set(node) - {"limit_mm_per_prompt", "enable_mm_embeds", "mm_tensor_ipc", "mm_encoder_tp_mode",
                        "mm_processor_cache_gb"}
    assert {k: node[k] for k in same} == {k: reference[k] for k in same}


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [synthetic_photo(336, 168, seed=1), synthetic_photo(84, 112, seed=2), synthetic_photo(224, 224, seed=0)]


@pytest.fixture(scope="module")
def transformers_reference(tiny_ckpt: Path, images: list[bytes]):
    """Per image order: transformers' tower embeddings and its monolithic greedy tokens."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(tiny_ckpt))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    renderer = PromptRenderer(tiny_ckpt)
    out = {}
    for order in ((0, 1, 2), (2, 0, 1)):
        pil = [Image.open(io.BytesIO(images[i])) for i in order]
        inputs = processor(text=[renderer.render(PROMPT, len(pil))], images=pil, return_tensors="pt")
        with torch.no_grad():
            merged = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
            gen = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        sizes = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
        embeds = [ImageEmbedding(e.float().clone(), tuple(g.tolist()), f"image-{i}")
                  for e, g, i in zip(merged.split(sizes), inputs["image_grid_thw"], order, strict=True)]
        out[order] = (embeds, gen[0, inputs["input_ids"].shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def engine(tiny_ckpt: Path):
    host = EngineHost(LLMSettings(model=str(tiny_ckpt), max_model_len=2048, max_num_seqs=4))
    host.start()
    yield host
    host.shutdown()


async def test_engine_holds_no_vision_tower_parameters(engine: EngineHost):
    workers = await engine.vision_tower()
    assert workers and all(w["visual_parameters"] == 0 for w in workers)
    assert all(w["model_parameters"] > 0 for w in workers)  # the probe does see the language model


async def test_embeddings_in_generate_what_transformers_generates(engine: EngineHost, transformers_reference,
                                                                  tiny_ckpt: Path):
    renderer = PromptRenderer(tiny_ckpt)
    got = {}
    for order, (embeds, _) in transformers_reference.items():
        ids: list[int] = []
        text = ""
        async for d in engine.generate(renderer.render(PROMPT, len(embeds)), SamplingSpec(max_tokens=NEW_TOKENS),
                                       images=embeds):
            ids += d.token_ids
            text += d.text
        assert d.finished and text
        got[order] = ids
    assert got == {order: tokens for order, (_, tokens) in transformers_reference.items()}
    assert got[(0, 1, 2)] != got[(2, 0, 1)]  # the order of images matters, so the check can see a mix-up


async def wait_until(condition, seconds: float) -> bool:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_the_shared_region_is_empty_once_requests_end_however_they_end(engine: EngineHost,
                                                                             transformers_reference,
                                                                             tiny_ckpt: Path):
    embeds, tokens = transformers_reference[(0, 1, 2)]
    prompt = PromptRenderer(tiny_ckpt).render(PROMPT, len(embeds))
    region = engine.region
    async for _ in engine.generate(prompt, SamplingSpec(max_tokens=2), images=embeds):
        assert region.entries == 3  # held while the request is in flight
    assert (region.entries, region.nbytes, os.listdir(region.path)) == (0, 0, [])
    # A client gone after the first token: the node lets go at once; the engine core's pins go
    # when it has aborted the request.
    stream = engine.generate(prompt, SamplingSpec(max_tokens=1000), images=embeds)
    async for _ in stream:
        break
    await stream.aclose()
    assert (region.entries, region.nbytes) == (0, 0)
    assert await wait_until(lambda: os.listdir(region.path) == [], 30), os.listdir(region.path)
    ids = [t async for d in engine.generate(prompt, SamplingSpec(max_tokens=NEW_TOKENS), images=embeds)
           for t in d.token_ids]
    assert ids == tokens and os.listdir(region.path) == []


async def test_a_request_whose_rows_are_not_in_the_region_fails_and_the_engine_serves_on(
        engine: EngineHost, transformers_reference, tiny_ckpt: Path):
    import torch
    from vllm import SamplingParams

    embeds, tokens = transformers_reference[(0, 1, 2)]
    renderer = PromptRenderer(tiny_ckpt)
    inputs = {"prompt": renderer.render(PROMPT, 1),
              "multi_modal_data": {"image": {"image_grid_thw": torch.tensor([list(embeds[0].grid_thw)])}},
              "multi_modal_uuids": {"image": ["never-written"]}}
    outs = [o async for o in engine.llm.generate(inputs, SamplingParams(max_tokens=4), "rows-missing")]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "error" and not outs[-1].outputs[0].token_ids
    assert not engine.dead and os.listdir(engine.region.path) == []
    ids = [t async for d in engine.generate(renderer.render(PROMPT, len(embeds)),
                                            SamplingSpec(max_tokens=NEW_TOKENS), images=embeds) for t in d.token_ids]
    assert ids == tokens
