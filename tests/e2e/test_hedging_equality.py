"""Hedging through a real LLM node: a frozen encoder's images come from the other one, and the
answers equal monolithic vLLM token for token.

Real processes on loopback: two encoder nodes of this module's own (one is frozen with SIGSTOP,
which must not touch the session's encoders) and an LLM node with `--hedge on`. The attempt
bound is far above any hedge margin, so images that arrive while the encoder is frozen were
delivered by hedges; load reports are off so that the warm-up's jitter on this shared machine
does not make an encoder look late before the freeze.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from encdis.client import AsyncGenerateClient, GenerateClient
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.coordinator.patches import patches_for_image
from encdis.llm_node.demo import synthetic_photo
from tests.e2e.conftest import IMAGE_SIZES, concurrent_cases, encoder_processes, encoders_by_address, wait_until
from tests.integration.test_hedging import frozen_first

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

BUDGET = 0.5  # a few requests: one hedge is a large share of their patches
FLOOR = 60.0  # attempt bound: far beyond any hedge margin here


@dataclass
class Fleet:
    llm: NodeProcess
    encoders: list[NodeProcess]


@pytest.fixture(scope="module")
def fleet(tiny_ckpt: Path) -> Iterator[Fleet]:
    with encoder_processes(tiny_ckpt, "--cache-bytes", "0") as encoders:
        llm = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                          "--metrics-port", "0", "--encoders", ",".join(n.address for n in encoders),
                          "--hedge", "on", "--hedge-budget", str(BUDGET), "--load-reports", "off",
                          "--attempt-timeout-floor-seconds", str(FLOOR), "--encode-timeout-seconds", str(FLOOR)],
                         timeout=900)
        try:
            yield Fleet(llm=llm, encoders=encoders)
        finally:
            llm.stop()


def largest_patches(model: Path) -> int:
    """Patches of the largest image the equality cases send, as the node's processor resizes it."""
    config = json.loads((model / "preprocessor_config.json").read_text())
    return max(patches_for_image(w, h, min_pixels=config["min_pixels"], max_pixels=config["max_pixels"])
               for w, h in IMAGE_SIZES.values())


def sample(node: NodeProcess, series: str) -> float:
    """A counter's sample; 0 while no event has created its labelled series."""
    with contextlib.suppress(AssertionError):
        return node.metric(series)
    return 0.0


def test_images_on_a_frozen_encoder_are_hedged_and_the_answers_equal_monolithic(fleet: Fleet, tiny_ckpt: Path,
                                                                                 monolithic, equality_cases) -> None:
    llm = fleet.llm
    wait_until(lambda: [e.state for e in encoders_by_address(llm).values()] == ["serving"] * 2, 60,
               "both encoders serving")
    with GenerateClient(llm.address, timeout=300) as client:
        for i in range(6):  # fit both cost models and the prediction errors (images no case sends)
            client.generate("Describe them.", [synthetic_photo(150 + 14 * i, 150, seed=800 + i),
                                               synthetic_photo(150, 160 + 14 * i, seed=900 + i)], max_tokens=1)
    # A warm-up call late on this shared machine may have been hedged, and its encoder marked slow.
    wait_until(lambda: [e.state for e in encoders_by_address(llm).values()] == ["serving"] * 2, 60,
               "both encoders serving after the warm-up")
    victim, _ = frozen_first(fleet.encoders, encoders_by_address(llm).values(), patches=largest_patches(tiny_ckpt))
    cases = concurrent_cases(equality_cases)

    async def run() -> list:
        async with AsyncGenerateClient(llm.address, timeout=600) as client:
            return await asyncio.gather(*(client.generate(c.prompt, c.images, max_tokens=c.max_tokens,
                                                          ignore_eos=True) for c in cases))

    os.kill(victim.pid, signal.SIGSTOP)
    try:
        results = asyncio.run(run())
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    assert {c.name: r.token_ids for c, r in zip(cases, results, strict=True)} == {c.name: monolithic[c.name]
                                                                                   for c in cases}
    assert sample(llm, 'encdis_coordinator_hedges_total{event="sent"}') >= 1
    assert sample(llm, 'encdis_coordinator_hedges_total{event="won"}') >= 1
    # The loser's call is cancelled (a frozen encoder may never see it start: what an encoder does
    # with a cancelled call's queued images is tests/integration/test_hedging.py's).
    assert sample(llm, 'encdis_coordinator_hedges_total{event="cancelled"}') >= 1
    # The hedges that beat it marked it slow, as its attempt bound would have (which never fired).
    faults = f'encdis_coordinator_encoder_faults_total{{encoder="{victim.address}",kind="%s"}}'
    assert sample(llm, faults % "outpaced") >= 1
    assert sample(llm, faults % "timeout") == 0
    hedged = llm.metric("encdis_coordinator_hedge_patches_total")
    sent = sum(e.assigned_patches for e in encoders_by_address(llm).values())
    assert 0 < hedged <= BUDGET * sent
