"""The monolithic reference: vLLM with its own vision tower, fed the raw images.

It is what encdis must equal token for token: the same checkpoint, the same engine
arguments (llm_node/engine.py, `tower=True`), the same prompt rendering
(llm_node/prompt.py), greedy sampling; the only difference is that the images go to
vLLM as pixels and its tower runs in the engine. Used by the end-to-end tests (in a
subprocess, through the command below) and by bench/e2e.py (in process, for timing).

    python -m encdis.llm_node.reference --model DIR --cases cases.json --out tokens.json

cases.json: [{"name": str, "prompt": str, "images": [file, ...], "max_tokens": int}, ...];
tokens.json: {name: [token ids]}. Cases run one at a time, so the reference is never
influenced by batching.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from encdis.llm_node.engine import EngineHost, GenerationDelta, SamplingSpec
from encdis.llm_node.prompt import PromptRenderer
from encdis.llm_node.settings import LLMSettings


@dataclass(frozen=True)
class Case:
    """One request of a comparison: a text, its images (encoded bytes, in order), a length."""

    name: str
    prompt: str
    images: tuple[bytes, ...] = ()
    max_tokens: int = 16

    def sampling(self) -> SamplingSpec:
        # ignore_eos: both sides generate exactly max_tokens, so whole sequences compare.
        return SamplingSpec(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)


def open_image(data: bytes):
    """Decode encoded image bytes as the encoder node does (PIL), fully loaded."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    return img


class MonolithicRunner:
    """vLLM with the tower loaded; `generate` takes encoded images like the LLM node does."""

    def __init__(self, settings: LLMSettings, *, max_images: int = 16) -> None:
        self.host = EngineHost(settings, tower=True, max_images=max(1, max_images))
        self.renderer = PromptRenderer(settings.model)

    def start(self) -> None:
        self.host.start()

    def shutdown(self) -> None:
        self.host.shutdown()

    async def generate(self, prompt: str, images: Sequence[bytes], sampling: SamplingSpec,
                       request_id: str | None = None) -> AsyncIterator[GenerationDelta]:
        text = self.renderer.render(prompt, len(images))
        pil = [open_image(b) for b in images]
        async for d in self.host.generate(text, sampling, raw_images=pil, request_id=request_id):
            yield d

    async def token_ids(self, case: Case) -> list[int]:
        out: list[int] = []
        async for d in self.generate(case.prompt, case.images, case.sampling()):
            out.extend(d.token_ids)
        return out


def reference_settings(model: str | os.PathLike, **overrides) -> LLMSettings:
    """The engine settings the LLM node uses by default, for the same checkpoint."""
    return replace(LLMSettings(model=str(model)), **overrides)


async def _run_cases(runner: MonolithicRunner, cases: Sequence[Case]) -> dict[str, list[int]]:
    return {c.name: await runner.token_ids(c) for c in cases}


def run_cases(model: str | os.PathLike, cases: Sequence[Case], **settings_overrides) -> dict[str, list[int]]:
    """Greedy token ids of every case, one at a time, in one engine (started and stopped here)."""
    runner = MonolithicRunner(reference_settings(model, **settings_overrides),
                              max_images=max((len(c.images) for c in cases), default=1))
    runner.start()
    try:
        return asyncio.run(_run_cases(runner, cases))
    finally:
        runner.shutdown()


def load_cases(path: str | os.PathLike) -> list[Case]:
    base = Path(path).parent
    return [
        Case(name=c["name"], prompt=c["prompt"], max_tokens=int(c.get("max_tokens", 16)),
             images=tuple((base / f).read_bytes() for f in c.get("images", [])))
        for c in json.loads(Path(path).read_text())
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="greedy token ids from monolithic vLLM (tower loaded)")
    p.add_argument("--model", required=True)
    p.add_argument("--cases", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=LLMSettings(model="").max_model_len)
    args = p.parse_args(argv)
    tokens = run_cases(args.model, load_cases(args.cases), dtype=args.dtype, max_model_len=args.max_model_len)
    args.out.write_text(json.dumps(tokens))
    print(f"reference: {len(tokens)} cases written to {args.out}")
    return 0


if __name__ == "__main__":  # vLLM starts its engine with spawn: the guard is required
    sys.exit(main())
