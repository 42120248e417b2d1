"""End-to-end fixtures: real encoder nodes, a real LLM node, and the monolithic reference.

Session-scoped and shared by every e2e test (vLLM engines are the expensive part):
- `encoder_nodes`: two `encdis encoder` processes on the session's tiny checkpoint;
- `llm_node`: one `encdis llm` process pointed at them;
- `monolithic`: greedy token ids of every case in `equality_cases` from vLLM's own
  monolithic run (tower loaded, raw images), computed once in a subprocess (one engine)
  and kept in pytest's cache, keyed (`encdis.llm_node.reference.cache_key`) by the torch,
  transformers and vLLM versions, every checkpoint file, the cases (prompts, image bytes,
  sampling) and the code that renders and runs them.
Images are generated deterministically, as the demo's (no package here ships photographs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from encdis.client import AsyncGenerateClient, GenerateClient
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.demo import synthetic_photo
from encdis.llm_node.reference import Case

MAX_TOKENS = 16
PROMPT_ONE = "Describe the picture."
PROMPT_MANY = "What differs between these pictures?"

# (width, height): different sizes and aspect ratios, so images have different token counts
# (a wrong split or order of the concatenated embeddings cannot go unnoticed).
IMAGE_SIZES = {
    "square": (224, 224),  # 8x8 merged tokens
    "wide": (336, 168),
    "small": (84, 112),
    "large": (448, 336),
}


@pytest.fixture(scope="session")
def e2e_images() -> dict[str, bytes]:
    return {name: synthetic_photo(w, h, seed=i) for i, (name, (w, h)) in enumerate(IMAGE_SIZES.items())}


@pytest.fixture(scope="session")
def equality_cases(e2e_images: dict[str, bytes]) -> dict[str, Case]:
    """The requests compared with the monolithic model, by name."""
    im = e2e_images
    cases = [
        Case("one_image", PROMPT_ONE, (im["square"],), MAX_TOKENS),
        Case("three_images", PROMPT_MANY, (im["wide"], im["small"], im["large"]), MAX_TOKENS),
        # The same images in another order: outputs must follow the order (vLLM's own EPD
        # had a multi-image mismatch bug; a mix-up of embeddings shows here).
        Case("three_images_reordered", PROMPT_MANY, (im["large"], im["wide"], im["small"]), MAX_TOKENS),
        # Eight concurrent requests: from no image to four, one image repeated in a request.
        Case("c0_text_only", "Count from one to ten.", (), MAX_TOKENS),
        Case("c1_square", "What is in this image?", (im["square"],), MAX_TOKENS),
        Case("c2_wide", PROMPT_ONE, (im["wide"],), MAX_TOKENS),
        Case("c3_small_large", PROMPT_MANY, (im["small"], im["large"]), MAX_TOKENS),
        Case("c4_large_small", PROMPT_MANY, (im["large"], im["small"]), MAX_TOKENS),
        Case("c5_repeat", "Are the first and last pictures the same?", (im["square"], im["wide"], im["square"]),
             MAX_TOKENS),
        Case("c6_four", PROMPT_MANY, (im["square"], im["wide"], im["small"], im["large"]), MAX_TOKENS),
        Case("c7_large", "Describe the colours.", (im["large"],), MAX_TOKENS),
    ]
    return {c.name: c for c in cases}


CONCURRENT = [f"c{i}" for i in range(8)]


def concurrent_cases(cases: dict[str, Case]) -> list[Case]:
    return [c for name, c in cases.items() if name.split("_")[0] in CONCURRENT]


async def concurrent_token_ids(address: str, cases: dict[str, Case]) -> dict[str, list[int]]:
    """Greedy token ids per case of the eight concurrent requests, all sent to `address` at once."""
    chosen = concurrent_cases(cases)
    assert len(chosen) == 8
    async with AsyncGenerateClient(address, timeout=600) as client:
        results = await asyncio.gather(*(
            client.generate(c.prompt, c.images, max_tokens=c.max_tokens, ignore_eos=True) for c in chosen))
    return {c.name: r.token_ids for c, r in zip(chosen, results, strict=True)}


def reference_tokens(config: pytest.Config, model: Path, cases: Iterable[Case], work: Path,
                     **settings_overrides) -> dict[str, list[int]]:
    """Greedy token ids per case from monolithic vLLM (tower loaded) with these engine settings,
    run in a subprocess (one engine) and kept in pytest's cache under a key of everything that
    decides them."""
    from encdis.llm_node.reference import cache_key

    cases = list(cases)
    cache = getattr(config, "cache", None)  # absent with -p no:cacheprovider
    key = f"encdis/monolithic/{cache_key(model, cases, settings_overrides=settings_overrides)}"
    cached = cache.get(key, None) if cache is not None else None
    if cached is not None:
        return cached
    spec = []
    for c in cases:
        files = []
        for i, data in enumerate(c.images):
            (work / f"{c.name}-{i}.png").write_bytes(data)
            files.append(f"{c.name}-{i}.png")
        spec.append({"name": c.name, "prompt": c.prompt, "images": files, "max_tokens": c.max_tokens})
    (work / "cases.json").write_text(json.dumps(spec))
    out = work / "tokens.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings_overrides.items()]
    proc = subprocess.run(
        [sys.executable, "-m", "encdis.llm_node.reference", "--model", str(model),
         "--cases", str(work / "cases.json"), "--out", str(out), *flags],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if proc.returncode != 0:
        pytest.fail(f"monolithic reference failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    tokens = json.loads(out.read_text())
    if cache is not None:
        cache.set(key, tokens)
    return tokens


@pytest.fixture(scope="session")
def monolithic(request: pytest.FixtureRequest, tiny_ckpt: Path, equality_cases: dict[str, Case],
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy token ids per case from monolithic vLLM on the same checkpoint (tower loaded)."""
    return reference_tokens(request.config, tiny_ckpt, equality_cases.values(), tmp_path_factory.mktemp("monolithic"))


@contextlib.contextmanager
def encoder_processes(model: Path, *flags: str, count: int = 2) -> Iterator[list[NodeProcess]]:
    """`count` real encoder nodes on `model` with extra `flags` (loopback, ephemeral ports).

    Started side by side and stopped side by side: each node's start (imports, weights) and drain
    overlaps the others', where one after another they added up in every module's set-up."""
    nodes: list[NodeProcess] = []
    try:
        for _ in range(count):
            nodes.append(NodeProcess(["encoder", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                                      "--metrics-port", "0", *flags]))
        for n in nodes:
            n.wait_ready(300)
        yield nodes
    finally:
        for n in nodes:
            n.terminate()  # all drain at once; stop() then waits for each
        for n in nodes:
            n.stop()


@pytest.fixture(scope="session")
def encoder_nodes(tiny_ckpt: Path) -> Iterator[list[NodeProcess]]:
    """Two real encoder nodes on the session checkpoint."""
    with encoder_processes(tiny_ckpt) as nodes:
        yield nodes


# The equality tests send 8 requests at once; the admission test sends 3x this many.
LLM_NODE_MAX_CONCURRENT = 8


@pytest.fixture(scope="session")
def llm_node(tiny_ckpt: Path, encoder_nodes: list[NodeProcess]) -> Iterator[NodeProcess]:
    """A real LLM node (vLLM, tower not loaded) whose encoder pool is `encoder_nodes`; both front doors."""
    node = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0", "--http-port", "0",
                       "--max-concurrent-requests", str(LLM_NODE_MAX_CONCURRENT),
                       "--encoders", ",".join(n.address for n in encoder_nodes)],
                      timeout=900)
    try:
        yield node
    finally:
        node.stop()


def encoders_by_address(llm: NodeProcess) -> dict:
    """The LLM node's view of its encoders (ListEncoders), by address."""
    with GenerateClient(llm.address, timeout=30) as client:
        return {e.address: e for e in client.list_encoders()}


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll `predicate` every 0.1 s; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)
