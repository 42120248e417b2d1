"""`encdis make-tiny-checkpoint`: a tiny, randomly initialised Qwen2.5-VL checkpoint.

It is what the tests, the demo and the benchmarks run on: a few MB, built offline,
deterministic for a seed, loadable by transformers and by vLLM's CPU build. A real
checkpoint directory is used the same way everywhere.

Shapes are constrained by vLLM's CPU build: its attention supports head sizes 32, 64,
80, ... so the text model uses hidden 128 with 4 heads; mrope_section must sum to
head_dim/2; head counts are even so TP=2 can shard them. With the default 0.02 init the
greedy output is one token repeated, so weights are drawn wider (0.2; 0.5 for the
embeddings and LM head), which gives diverse, image-dependent tokens.

With --shards K > 1 the visual tensors go in the first shard and the language model's
in the others, listed in model.safetensors.index.json: an encoder node must start
from the visual shard alone.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2.5-VL's chat template, reduced to what the tiny model needs (no default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' or 'video' in c %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "Describe the picture. What is in this image? The image shows a red square and a blue circle.",
    "A cat sits on the mat. A dog runs in the park. The sky is blue and the grass is green.",
    "user assistant system You are a helpful assistant. Hello, how are you today?",
    "0123456789 one two three four five six seven eight nine ten",
] * 20

# Image processor bounds of the tiny checkpoint: up to 256 output tokens per image.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="output directory (created)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    p.add_argument("--shards", type=int, default=1, help="safetensors shards; >1 writes an index")


def run(args: argparse.Namespace) -> int:
    path = make_tiny_checkpoint(args.dir, seed=args.seed, shards=args.shards)
    print(f"tiny Qwen2.5-VL checkpoint written to {path}")
    return 0


def _build_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIALS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def make_tiny_checkpoint(out_dir: str | os.PathLike, *, seed: int = 0, shards: int = 1,
                         vision_overrides: dict | None = None, text_overrides: dict | None = None,
                         max_pixels: int = MAX_PIXELS) -> Path:
    """Write the checkpoint to `out_dir` and return it. Same seed, same bytes.

    The overrides replace entries of the tiny vision / text configs (a benchmark builds a
    real-size random tower this way); max_pixels is the image processor's upper bound.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    vocab_size = ((len(tok) + 63) // 64) * 64

    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    vision_config = dict(
        depth=4,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        out_hidden_size=128,
        fullatt_block_indexes=[1, 3],
        tokens_per_second=2,
        hidden_act="silu",
    )
    text_config.update(text_overrides or {})
    vision_config.update(vision_overrides or {})
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                big = "embed_tokens" in name or "lm_head" in name
                p.normal_(0.0, 0.5 if big else 0.2)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    _write_weights(model, out, shards, save_file)
    _write_processor_files(out, ids, max_pixels)
    return out


def make_wide_checkpoint(out_dir: str | os.PathLike, hidden: int, *, intermediate: int | None = None,
                         max_tokens: int = 256) -> Path:
    """A tiny checkpoint whose embeddings are as wide as a real model's (3584: Qwen2.5-VL-7B, 8192: 72B).

    One text layer of that width (heads of 128, as real ones), so what the LLM node spends on
    an embedding is not hidden by its compute. `intermediate`: the MLP's width (default
    2 x hidden; it sets compute, not embedding bytes). `max_tokens`: the largest image the
    processor admits, in embedding rows (it also sizes vLLM's encoder cache).
    """
    return make_tiny_checkpoint(out_dir, text_overrides={
        "hidden_size": hidden, "intermediate_size": intermediate or 2 * hidden, "num_hidden_layers": 1,
        "num_attention_heads": hidden // 128, "num_key_value_heads": 2,
        "max_position_embeddings": max(4096, 2 * max_tokens),  # room for the largest image and a prompt
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    }, vision_overrides={"out_hidden_size": hidden}, max_pixels=28 * 28 * max_tokens)


def _write_weights(model, out: Path, shards: int, save_file) -> None:
    """Visual tensors first (shard 1), language model after, so shards never mix the two."""
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if shards == 1:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    visual = sorted(k for k in state if ".visual." in f".{k}")
    text = sorted(k for k in state if k not in set(visual))
    groups = [visual] + [text[i::shards - 1] for i in range(shards - 1)]
    weight_map, total = {}, 0
    for i, names in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in names}, str(out / fname), metadata={"format": "pt"})
        for k in names:
            weight_map[k] = fname
            total += state[k].numel() * state[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_processor_files(out: Path, ids: dict[str, int], max_pixels: int = MAX_PIXELS) -> None:
    preproc = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": MIN_PIXELS,
        "max_pixels": max_pixels,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": max_pixels},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preproc, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2))
    gen = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
           "pad_token_id": ids["<|endoftext|>"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
