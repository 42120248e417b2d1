"""Fidelity: how often encdis generates exactly what monolithic vLLM generates, against vLLM's own floor.

For one set of prompts (one to four images of mixed sizes and modes, and text only; greedy
tokens), in float32 and in bfloat16, side by side in one run:

- vLLM's noise floor: monolithic vLLM (tower loaded, raw images) against itself with another
  batch shape: every prompt alone vs all prompts at once (prefix cache reset in between);
- encdis (two encoder nodes, one LLM node: real processes on loopback) against monolithic
  vLLM run one prompt at a time; in bf16 both with the encoders' default tower (auto: vLLM's)
  and with transformers' tower (`--tower-impl transformers`), the gap the default closes;
- the embeddings: each tower's bf16 output against the float32 output of the same images
  (relative error, cosine), for transformers' tower, for vLLM's tower on the encoder node, and
  for vLLM's tower as vLLM runs it (recorded inside the engine through the worker extension,
  llm_node/engine.py); and the encoder's vLLM tower against the engine's, same dtype.

Per comparison: the share of prompts whose tokens are all equal, and the mean index of the
first differing token over the prompts that differ. Exits 1 when encdis (default tower) agrees
with monolithic vLLM on a smaller share of prompts than vLLM agrees with itself, less
--margin, in any dtype.

    flock /tmp/encdis-vllm.lock python -m bench.fidelity.fidelity [--quick] [--prompts N] [--json out.json]

Run it under the vLLM lock: it starts one engine at a time, five in all.

The measured table (and what it decided) is in encoder_node/vllm_tower.py's docstring. On CPU
vLLM agrees with itself across batch shapes on every prompt, so --margin defaults to 0.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = ["Describe the picture.", "What differs between these pictures?", "What colours do you see?",
           "Is there a circle?", "Count the shapes.", "Write a caption."]
TEXT_PROMPTS = ["Count from one to ten.", "Name three rivers.", "What is two plus two?", "Say hello in French."]
# How each image is stored: modes and formats a user sends (vLLM's loader composites alpha onto white).
STORAGE = [("PNG", "RGB"), ("JPEG", "RGB"), ("PNG", "L"), ("PNG", "RGBA"), ("PNG", "P"), ("WEBP", "RGB")]


def make_image(rng, index: int) -> bytes:
    from PIL import Image

    from encdis.llm_node.demo import synthetic_photo

    w, h = int(rng.integers(3, 21)) * 28, int(rng.integers(3, 21)) * 28
    w, h = w - int(rng.integers(0, 20)), h - int(rng.integers(0, 20))  # not on the patch grid
    img = Image.open(io.BytesIO(synthetic_photo(w, h, seed=1000 + index)))
    fmt, mode = STORAGE[index % len(STORAGE)]
    img = img.convert(mode)
    if mode == "RGBA":
        alpha = Image.linear_gradient("L").resize(img.size)
        img.putalpha(alpha)
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return buf.getvalue()


def make_cases(n: int, max_tokens: int):
    """n prompts: every eighth text only, the others one to four images (each its own)."""
    import numpy as np

    from encdis.llm_node.reference import Case

    rng = np.random.default_rng(0)
    cases, image_index = [], 0
    for i in range(n):
        if i % 8 == 7:
            cases.append(Case(f"p{i:03d}", TEXT_PROMPTS[i % len(TEXT_PROMPTS)], (), max_tokens))
            continue
        k = 1 + i % 4
        images = tuple(make_image(rng, image_index + j) for j in range(k))
        image_index += k
        cases.append(Case(f"p{i:03d}", PROMPTS[i % len(PROMPTS)], images, max_tokens))
    return cases


def agreement(got: dict[str, list[int]], want: dict[str, list[int]]) -> dict:
    """Share of prompts whose tokens are all equal; mean first differing index over the others."""
    firsts = []
    for name, w in want.items():
        g = got[name]
        if g != w:
            pairs = enumerate(zip(g, w, strict=False))
            firsts.append(next((i for i, (a, b) in pairs if a != b), min(len(g), len(w))))
    n = len(want)
    return {"prompts": n, "equal": n - len(firsts), "equal_share": (n - len(firsts)) / n,
            "first_diff_mean": (sum(firsts) / len(firsts)) if firsts else None, "first_diffs": firsts}


# ---- monolithic vLLM ---------------------------------------------------------------------


def run_monolithic(model: Path, cases, dtype: str, work: Path) -> dict:
    """Tokens one prompt at a time (recording the engine's tower outputs) and all at once."""
    import torch
    from safetensors.torch import load_file

    from encdis.llm_node.reference import MonolithicRunner, reference_settings

    runner = MonolithicRunner(reference_settings(model, dtype=dtype), max_images=4)
    t0 = time.monotonic()
    runner.start()

    async def go():
        llm = runner.host.llm
        assert all(await llm.collective_rpc("encdis_capture_embeddings", args=(True,)))
        serial, captured = {}, {}
        for i, c in enumerate(cases):
            serial[c.name] = await runner.token_ids(c)
            path = work / f"capture-{dtype}-{i}.safetensors"
            await llm.collective_rpc("encdis_dump_embeddings", args=(str(path),))
            captured[c.name] = load_file(str(path))["embeds"] if c.images else torch.empty(0)
        await llm.collective_rpc("encdis_capture_embeddings", args=(False,))
        await llm.reset_prefix_cache()
        await llm.reset_mm_cache()
        together = await asyncio.gather(*(runner.token_ids(c) for c in cases))
        return serial, {c.name: t for c, t in zip(cases, together, strict=True)}, captured

    try:
        serial, together, captured = asyncio.run(go())
    finally:
        runner.shutdown()
    return {"serial": serial, "together": together, "captured": captured, "seconds": time.monotonic() - t0}


# ---- encdis ------------------------------------------------------------------------------


def run_encdis(model: Path, cases, dtype: str, tower_impl: str, encoders: int) -> dict[str, list[int]]:
    """Tokens from a real LLM node and its encoder nodes, one prompt at a time."""
    from encdis.client import GenerateClient
    from encdis.launcher import start_node
    from encdis.llm_node.engine import cpu_worker_threads

    nodes = []
    try:
        for _ in range(encoders):
            nodes.append(start_node(["encoder", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                                     "--dtype", dtype, "--tower-impl", tower_impl,
                                     # bf16 rounds by thread split: the engine worker's count
                                     "--torch-threads", str(cpu_worker_threads())], timeout=300))
        llm_args = ["llm", "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--dtype", dtype,
                    "--encoders", ",".join(n.address for n in nodes), "--cache-bytes", "0"]
        if tower_impl != "auto":
            llm_args += ["--encoder-tower-impl", tower_impl]
        llm = start_node(llm_args, timeout=900)
        nodes.append(llm)
        out = {}
        with GenerateClient(llm.address, timeout=600) as client:
            for c in cases:
                r = client.generate(c.prompt, list(c.images), max_tokens=c.max_tokens, ignore_eos=True)
                out[c.name] = list(r.token_ids)
        return out
    finally:
        for n in reversed(nodes):
            n.stop()


# ---- embeddings --------------------------------------------------------------------------


def error(a, b) -> tuple[float, float]:
    """(relative error, cosine) of a against b, in float32."""
    import torch

    a, b = a.float().flatten(), b.float().flatten()
    return float((a - b).norm() / b.norm()), float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def tower_outputs(model: Path, cases, impl: str, dtype: str) -> dict:
    """Per prompt with images: the encoder node's tower output (its images concatenated, in order)."""
    import torch

    from encdis.encoder_node.preprocess import ImagePreprocessor
    from encdis.encoder_node.tower import load_tower

    tower = load_tower(model, impl, device="cpu", dtype=dtype)
    pre = ImagePreprocessor(model, weights_fingerprint="-", max_image_bytes=1 << 26, max_image_pixels=1 << 28,
                            raw_pixels=tower.expects_raw_pixels)
    out = {}
    for c in cases:
        if not c.images:
            continue
        prepared = [pre.prepare(i, data, pre.default_min_pixels, pre.default_max_pixels)
                    for i, data in enumerate(c.images)]
        out[c.name] = torch.cat(tower.forward([p.pixel_values for p in prepared], [p.grid_thw for p in prepared]))
    return out


def summarise(pairs) -> dict:
    errs = [error(a, b) for a, b in pairs]
    return {"rel_error_mean": sum(e for e, _ in errs) / len(errs), "rel_error_max": max(e for e, _ in errs),
            "cosine_min": min(c for _, c in errs), "cosine_mean": sum(c for _, c in errs) / len(errs)}


def embedding_table(model: Path, cases, captured: dict[str, dict]) -> dict:
    names = [c.name for c in cases if c.images]
    ours = {(impl, dt): tower_outputs(model, cases, impl, dt)
            for impl in ("transformers", "vllm") for dt in ("float32", "bfloat16")}
    rows = {}
    for impl in ("transformers", "vllm"):
        rows[f"encoder, {impl} tower: bf16 vs its fp32"] = summarise(
            (ours[impl, "bfloat16"][n], ours[impl, "float32"][n]) for n in names)
    if "bfloat16" in captured and "float32" in captured:
        rows["vLLM engine's tower: bf16 vs its fp32"] = summarise(
            (captured["bfloat16"][n], captured["float32"][n]) for n in names)
    for dt, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        if dt in captured:
            for impl in ("vllm", "transformers"):
                rows[f"encoder, {impl} tower vs vLLM engine's, {short}"] = summarise(
                    (ours[impl, dt][n], captured[dt][n]) for n in names)
    return rows


# ---- report ------------------------------------------------------------------------------


def fmt_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                                    strict=True)))
                     for r in rows)


def token_rows(results: dict) -> list[tuple[str, ...]]:
    rows = [("dtype / comparison", "equal prompts", "equal share", "first diff (mean)")]
    for dt, comps in results.items():
        for name, a in comps.items():
            first = "-" if a["first_diff_mean"] is None else f"{a['first_diff_mean']:.1f}"
            rows.append((f"{dt}: {name}", f"{a['equal']}/{a['prompts']}", f"{a['equal_share']:.3f}", first))
    return rows


def embedding_rows(table: dict) -> list[tuple[str, ...]]:
    rows = [("embeddings (per prompt, images concatenated)", "rel err mean", "rel err max", "cosine min")]
    for name, s in table.items():
        rows.append((name, f"{s['rel_error_mean']:.2e}", f"{s['rel_error_max']:.2e}", f"{s['cosine_min']:.6f}"))
    return rows


FLOOR = "vLLM vs itself (alone vs all at once)"
ENCDIS = "encdis (tower auto) vs vLLM"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: a tiny one built in a temp dir)")
    p.add_argument("--quick", action="store_true", help="40 prompts of 32 tokens (about 10 min on 2 cores)")
    p.add_argument("--prompts", type=int, default=None, help="number of prompts (default 40 with --quick, else 80)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--encoders", type=int, default=2)
    p.add_argument("--margin", type=float, default=0.0,
                   help="encdis may agree on this smaller share of prompts than vLLM's floor before exit 1")
    p.add_argument("--no-transformers-row", action="store_true",
                   help="skip encdis with transformers' tower in bf16 (one engine fewer)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    n = args.prompts or (40 if args.quick else 80)
    if n < 40:
        print(f"note: {n} prompts (the table's figures are meant for at least 40)", file=sys.stderr)

    model = args.model
    if model is None:
        from encdis.tiny_checkpoint import make_tiny_checkpoint

        model = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="encdis-bench-ckpt-")) / "tiny", seed=0, shards=3)
    work = Path(tempfile.mkdtemp(prefix="encdis-fidelity-"))
    cases = make_cases(n, args.max_tokens)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    t0 = time.monotonic()
    results: dict[str, dict] = {}
    captured: dict[str, dict] = {}
    for dt in dtypes:
        mono = run_monolithic(model, cases, dt, work)
        captured[dt] = mono["captured"]
        comps = {FLOOR: agreement(mono["together"], mono["serial"]),
                 ENCDIS: agreement(run_encdis(model, cases, dt, "auto", args.encoders), mono["serial"])}
        if dt != "float32" and not args.no_transformers_row:
            comps["encdis (transformers tower) vs vLLM"] = agreement(
                run_encdis(model, cases, dt, "transformers", args.encoders), mono["serial"])
        results[dt] = comps
        print(f"{dt} done after {time.monotonic() - t0:.0f}s", file=sys.stderr)
    emb = embedding_table(model, cases, captured)

    print(f"{n} prompts ({sum(1 for c in cases if not c.images)} text only, "
          f"{sum(len(c.images) for c in cases)} images), {args.max_tokens} greedy tokens; "
          f"{args.encoders} encoders; {time.monotonic() - t0:.0f}s")
    print(fmt_table(token_rows(results)))
    print()
    print(fmt_table(embedding_rows(emb)))
    failures = [dt for dt, comps in results.items()
                if comps[ENCDIS]["equal_share"] < comps[FLOOR]["equal_share"] - args.margin]
    for dt in failures:
        print(f"FAIL {dt}: encdis agrees on {results[dt][ENCDIS]['equal_share']:.3f} of prompts, below vLLM's own "
              f"floor {results[dt][FLOOR]['equal_share']:.3f} - margin {args.margin}", file=sys.stderr)
    result = {
        "tokens": results, "embeddings": emb, "failed_dtypes": failures,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"model": str(model), "prompts": n},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"written to {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":  # vLLM starts its engine with spawn: the guard is required
    sys.exit(main())
