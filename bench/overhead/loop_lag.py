"""Event-loop lag while the LLM node prepares requests that must be refused, and the image
probe's cost: the previous code against the current one, side by side in one run.

Two measurements, on the tiny checkpoint (its tokenizer and processor bounds; the work
measured is the node's own, not the model's):
- probe: `read_header` on a noise PNG of 1024x1024 and 4000x4000 against the previous probe
  (PIL's `getexif()`, which for a PNG decodes every pixel to look for an eXIf chunk after
  the image data), median of several runs;
- loop lag: while a request is prepared, a task sleeping 1 ms at a time records how late it
  wakes (the longest wait is what every other request's token stream and the health check
  would wait). The requests: a 5 MB prompt, and 16 small PNGs that each declare 8000x8000.
  Previous: probe every image twice (image tokens, then digest and probe) with getexif,
  render and tokenise the whole prompt, all on the loop. Current: GenerationService._prepare
  (the node's code: probe once, cheap length bound first, tokenising only prompts that pass
  it) in a worker thread.

    python -m bench.overhead.loop_lag [--json FILE] [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from encdis.client.errors import InvalidArgument
from encdis.image_header import ImageHeader, open_image, read_header

PROBE_SIZES = (1024, 4000)
PROMPT_BYTES = 5_000_000
IMAGES = 16
DECLARED_SIDE = 8000


def previous_read_header(data: bytes) -> ImageHeader:
    """The probe as it was: orientation from PIL's getexif() (a PNG decodes all its pixels for it)."""
    with open_image(data) as image:
        try:
            orientation = int(image.getexif().get(0x0112, 1))
        except Exception:
            orientation = 1
        return ImageHeader(format=str(image.format), width=image.size[0], height=image.size[1], mode=image.mode,
                           orientation=orientation if 1 <= orientation <= 8 else 1)


def noise_png(side: int) -> bytes:
    pixels = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def one_colour_png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (40, 90, 160)).save(buf, "PNG")
    return buf.getvalue()


def median_seconds(fn, data: bytes, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def max_lag_during(work) -> tuple[float, float]:
    """(longest lateness of a 1 ms sleep while `work()` runs, seconds `work()` took)."""
    lags: list[float] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    watcher = asyncio.ensure_future(watch())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    try:
        await work()
    except InvalidArgument:
        pass  # the refusal is the expected outcome
    took = time.perf_counter() - t0
    done.set()
    await watcher
    return max(lags, default=0.0), took


def build_service(model_dir: Path):
    import dataclasses

    from prometheus_client import CollectorRegistry

    from encdis.llm_node.coordinator import Coordinator
    from encdis.llm_node.generation import GenerationService
    from encdis.llm_node.metrics import LLMNodeMetrics
    from encdis.llm_node.prompt import PromptRenderer
    from encdis.llm_node.settings import LLMSettings

    settings = LLMSettings(model=str(model_dir))
    settings = dataclasses.replace(settings, coordinator=dataclasses.replace(settings.coordinator,
                                                                             encoder_datatype="FP32"))
    registry = CollectorRegistry()
    coordinator = Coordinator.from_checkpoint(settings.coordinator, registry, model_dir)
    return GenerationService(settings, None, coordinator, PromptRenderer(model_dir), LLMNodeMetrics(registry))


def previous_prepare(service, images: list[bytes], messages) -> None:
    """What the node did on the event loop before: two getexif probes per image, a full tokenisation."""
    coordinator = service.coordinator
    tokens = [coordinator.grid_tokens(coordinator._header_grid(previous_read_header(im))) for im in images]
    for im in images:  # the second probe, with the digest
        coordinator._header_grid(previous_read_header(im))
    prompt = service.renderer.render_messages(messages)
    prompt_len = service.renderer.count_tokens(prompt) + sum(tokens) - len(tokens)
    if prompt_len >= service.settings.max_model_len:
        raise InvalidArgument(f"the prompt is {prompt_len} tokens with its images")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default="loop_lag.json")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)

    rows = []
    for side in PROBE_SIZES:
        data = noise_png(side)
        before = median_seconds(previous_read_header, data, args.runs)
        after = median_seconds(read_header, data, args.runs)
        rows.append({"measure": f"probe {side}x{side} PNG (ms)", "previous": before * 1e3, "current": after * 1e3})

    from encdis.llm_node.prompt import user_message
    from encdis.tiny_checkpoint import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        service = build_service(make_tiny_checkpoint(Path(tmp) / "tiny"))
        cases = {
            "5 MB prompt": ([], user_message("lorem ipsum " * (PROMPT_BYTES // 12), 0)),
            f"{IMAGES} PNGs declaring {DECLARED_SIDE}x{DECLARED_SIDE}":
                ([one_colour_png(DECLARED_SIDE)] * IMAGES, user_message("Describe them.", IMAGES)),
        }

        async def measure() -> None:
            for name, (images, messages) in cases.items():
                old_lag, old_took = await max_lag_during(functools.partial(_on_loop, previous_prepare, service,
                                                                           images, messages))
                new_lag, new_took = await max_lag_during(functools.partial(asyncio.to_thread, service._prepare,
                                                                           images, messages, _sampling()))
                rows.append({"measure": f"{name}: longest loop stall (ms)", "previous": old_lag * 1e3,
                             "current": new_lag * 1e3})
                rows.append({"measure": f"{name}: time to refusal (ms)", "previous": old_took * 1e3,
                             "current": new_took * 1e3})

        asyncio.run(measure())

    width = max(len(r["measure"]) for r in rows)
    print(f"{'measure':<{width}}  {'previous':>10}  {'current':>10}  {'ratio':>8}")
    for r in rows:
        r["ratio"] = r["previous"] / r["current"] if r["current"] > 0 else float("inf")
        print(f"{r['measure']:<{width}}  {r['previous']:>10.2f}  {r['current']:>10.2f}  {r['ratio']:>7.0f}x")
    Path(args.json).write_text(json.dumps({"rows": rows, "runs": args.runs}, indent=2))
    print(f"wrote {args.json}")
    return 0


async def _on_loop(fn, *args) -> None:
    fn(*args)


def _sampling():
    from encdis.llm_node.engine import SamplingSpec

    return SamplingSpec(max_tokens=4)


if __name__ == "__main__":
    sys.exit(main())
