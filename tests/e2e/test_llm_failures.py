"""The LLM node under encoder failures: retries, refusal, cache, and no usable encoder.

Real processes on loopback. The LLM node here is this module's own (its pool is
manipulated): `--encoders good.failures.test:P,VICTIM,OTHER` where
- good.failures.test is answered by the test's DNS server (so the test can take the one
  good encoder away and give it back) and points at one of the session's encoder nodes;
- VICTIM is an encoder of the right checkpoint that the test kills with SIGKILL;
- OTHER serves another checkpoint (seed 1) and must be refused.
Outputs are compared with the session's monolithic reference (vLLM, tower loaded).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis.client import AsyncGenerateClient, GenerateClient
from encdis.client.errors import Unavailable
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.demo import synthetic_photo
from tests.dns_server import LoopbackDNS
from tests.e2e.conftest import concurrent_cases, encoders_by_address, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

GOOD_NAME = "good.failures.test"


@dataclass
class Rig:
    llm: NodeProcess
    good: NodeProcess
    victim: NodeProcess
    other: NodeProcess
    dns: LoopbackDNS


@pytest.fixture(scope="module")
def rig(tiny_ckpt: Path, other_ckpt: Path, encoder_nodes: list[NodeProcess]) -> Iterator[Rig]:
    dns = LoopbackDNS()
    good = encoder_nodes[0]
    dns.set_addresses(GOOD_NAME, [good.host])
    started: list[NodeProcess] = []
    try:
        victim = NodeProcess(["encoder", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                              "--metrics-port", "0"])
        other = NodeProcess(["encoder", "--model", str(other_ckpt), "--host", "127.0.0.1", "--port", "0",
                             "--metrics-port", "0"])
        started += [victim, other]
        victim.wait_ready(300)
        other.wait_ready(300)
        llm = start_node(
            ["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
             "--encoders", f"{GOOD_NAME}:{good.grpc_port},{victim.address},{other.address}",
             "--dns-server", dns.address, "--dns-refresh-seconds", "0.5", "--max-retries", "3"],
            timeout=900,
        )
        started.append(llm)
        rig = Rig(llm=llm, good=good, victim=victim, other=other, dns=dns)
        wait_until(lambda: {a: e.state for a, e in encoders_by_address(llm).items()}
                   == {good.address: "serving", victim.address: "serving", other.address: "refused"},
                   60, "good and victim serving, other refused")
        yield rig
    finally:
        for node in reversed(started):
            node.stop()
        dns.close()


async def test_kill_9_of_one_of_two_encoders_with_eight_requests_in_flight(rig: Rig, monolithic, equality_cases):
    cases = concurrent_cases(equality_cases)
    assert len(cases) == 8
    retries_before = rig.llm.metric("encdis_coordinator_retries_total")
    # Frozen, the victim surely still holds its share when it dies (a kill at a random moment
    # could come after it finished).
    os.kill(rig.victim.pid, signal.SIGSTOP)
    async with AsyncGenerateClient(rig.llm.address, timeout=600) as client:
        requests = [asyncio.ensure_future(client.generate(c.prompt, c.images, max_tokens=c.max_tokens,
                                                          ignore_eos=True)) for c in cases]
        deadline = time.monotonic() + 120
        while True:
            victim = {e.address: e for e in await client.list_encoders()}[rig.victim.address]
            if victim.backlog_patches > 0:
                break
            assert time.monotonic() < deadline, "no work was ever assigned to the victim"
            await asyncio.sleep(0.05)
        assert not [r for r in requests if r.done() and r.exception() is not None]
        rig.victim.kill()
        results = await asyncio.gather(*requests)
    got = {c.name: r.token_ids for c, r in zip(cases, results, strict=True)}
    assert got == {c.name: monolithic[c.name] for c in cases}
    assert rig.llm.metric("encdis_coordinator_retries_total") > retries_before
    encoders = encoders_by_address(rig.llm)
    assert encoders[rig.victim.address].state == "unhealthy"
    assert encoders[rig.good.address].state == "serving"


def test_encoder_of_another_checkpoint_is_refused_and_gets_no_work(rig: Rig, equality_cases):
    with GenerateClient(rig.llm.address, timeout=300) as client:
        case = equality_cases["three_images"]
        client.generate(case.prompt, case.images, max_tokens=2)
    other = encoders_by_address(rig.llm)[rig.other.address]
    assert other.state == "refused"
    assert "weights_fingerprint" in other.reason
    assert other.assigned_images == 0 and other.assigned_patches == 0
    assert rig.other.metric("encdis_encoder_patches_total") == 0


def test_repeated_image_hits_the_cache_with_the_same_output(rig: Rig):
    image = synthetic_photo(260, 180, seed=4242)  # in no other test: not cached yet
    prompt = "Describe the picture."
    live = [n for n in (rig.good, rig.victim) if n.proc.poll() is None]

    def encoded_patches() -> float:
        return sum(n.metric("encdis_encoder_patches_total") for n in live)

    hits = rig.llm.metric("encdis_coordinator_cache_hits_total")
    with GenerateClient(rig.llm.address, timeout=300) as client:
        p0 = encoded_patches()
        first = client.generate(prompt, [image], max_tokens=12, ignore_eos=True)
        p1 = encoded_patches()
        second = client.generate(prompt, [image], max_tokens=12, ignore_eos=True)
        p2 = encoded_patches()
    assert p1 > p0 and first.usage.cached_images == 0
    assert p2 == p1, "the repeated image was encoded again"
    assert second.usage.cached_images == 1
    assert second.token_ids == first.token_ids and len(first.token_ids) == 12
    assert rig.llm.metric("encdis_coordinator_cache_hits_total") == hits + 1


def test_no_usable_encoder_fails_with_unavailable_and_the_node_keeps_serving(rig: Rig, monolithic,
                                                                             equality_cases):
    if rig.victim.proc.poll() is None:
        rig.victim.kill()
    # Dead is not enough: until the LLM node has seen it, the victim may still get this request.
    wait_until(lambda: getattr(encoders_by_address(rig.llm).get(rig.victim.address), "state", "gone") != "serving",
               30, "the LLM node seeing the victim gone")
    rig.dns.remove(GOOD_NAME)  # the good encoder leaves the pool: only the refused one is left
    wait_until(lambda: rig.good.address not in encoders_by_address(rig.llm), 30, "the good encoder leaving")
    image = synthetic_photo(150, 150, seed=777)
    with GenerateClient(rig.llm.address, timeout=120) as client:
        with pytest.raises(Unavailable) as info:
            client.generate("Describe the picture.", [image], max_tokens=4)
        message = info.value.message
        assert message.startswith("no encoder can serve this request (2 encoder(s): "), message
        assert "1 refused" in message, message
        assert rig.other.address not in message  # the reason is in ListEncoders, not in callers' errors
        assert "weights" in encoders_by_address(rig.llm)[rig.other.address].reason
        # Still serving: health, text-only requests.
        with grpc.insecure_channel(rig.llm.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert len(client.generate("Count from one to ten.", [], max_tokens=4, ignore_eos=True).token_ids) == 4
    # The encoder comes back (DNS lists it again): image requests work again, outputs unchanged.
    rig.dns.set_addresses(GOOD_NAME, [rig.good.host])
    wait_until(lambda: getattr(encoders_by_address(rig.llm).get(rig.good.address), "state", "") == "serving",
               30, "the good encoder rejoining")
    case = equality_cases["one_image"]
    with GenerateClient(rig.llm.address, timeout=300) as client:
        result = client.generate(case.prompt, case.images, max_tokens=case.max_tokens, ignore_eos=True)
    assert result.token_ids == monolithic["one_image"]
