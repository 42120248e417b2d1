"""Admission control on a real LLM node: load beyond its limits is refused at once, and a
request that cannot fit is refused before any encoder works on it."""

from __future__ import annotations

import asyncio
import time

import pytest

from encdis.client import AsyncGenerateClient, GenerateClient, GenerateResult, InvalidArgument, ResourceExhausted
from tests.e2e.conftest import LLM_NODE_MAX_CONCURRENT

pytestmark = pytest.mark.vllm

# Long enough that the admitted requests are still generating, seconds after their first token,
# while the excess arrives and is refused.
LONG_TOKENS = 3000


def test_three_times_the_limit_excess_refused_promptly_the_rest_equal_monolithic(llm_node, monolithic,
                                                                                 equality_cases) -> None:
    case = equality_cases["c0_text_only"]
    limit = LLM_NODE_MAX_CONCURRENT

    # Earlier tests on this shared node have ended every request they sent: the gauge comes back to
    # 0 (a stream its client abandoned ends when the node notices; a leak never does).
    deadline = time.monotonic() + 60
    while (in_flight := llm_node.metric("encdis_requests_in_flight")) != 0:
        assert time.monotonic() < deadline, f"{in_flight} requests still in flight a minute after earlier tests"
        time.sleep(0.1)

    async def run() -> tuple[list, list[bool]]:
        async with AsyncGenerateClient(llm_node.address, timeout=600) as client:
            started = [asyncio.Event() for _ in range(limit)]

            async def held_request(first_token: asyncio.Event) -> GenerateResult:
                out = GenerateResult()
                async for chunk in client.generate_stream(case.prompt, max_tokens=LONG_TOKENS, ignore_eos=True):
                    first_token.set()
                    out.add(chunk)
                return out

            held = [asyncio.ensure_future(held_request(e)) for e in started]
            # A first token means admitted and generating: the node holds its slot until the last one.
            deadline = time.monotonic() + 120
            while not all(e.is_set() for e in started):
                ended = [t for t in held if t.done()]
                assert not ended, f"a held request ended before all had started: {ended[0].exception()}"
                assert time.monotonic() < deadline, f"{sum(e.is_set() for e in started)} of {limit} requests started"
                await asyncio.sleep(0.01)
            assert not any(t.done() for t in held), "a held request finished before the excess arrived"
            # Read as soon as all have started: each of them then has most of its tokens to generate.
            assert llm_node.metric("encdis_requests_in_flight") == limit

            async def refused() -> bool:
                with pytest.raises(ResourceExhausted, match="requests in flight"):
                    await client.generate(case.prompt, max_tokens=4)
                # At once: the refusal did not wait for a slot, so every held request still runs.
                return not any(t.done() for t in held)

            while_held = await asyncio.gather(*(refused() for _ in range(2 * limit)))
            return await asyncio.gather(*held), list(while_held)

    results, while_held = asyncio.run(run())
    assert all(while_held), f"{while_held.count(False)} refusals came after a held request had ended"
    for r in results:
        assert len(r.token_ids) == LONG_TOKENS
        # Greedy decoding: the first tokens of a long answer are the short answer.
        assert r.token_ids[:case.max_tokens] == monolithic["c0_text_only"]


def test_a_prompt_that_cannot_fit_with_its_images_is_refused_before_any_encoding(llm_node, encoder_nodes,
                                                                                  equality_cases) -> None:
    images = equality_cases["c6_four"].images
    before = [n.metric("encdis_encoder_patches_total") for n in encoder_nodes]
    with GenerateClient(llm_node.address, timeout=60) as client:
        with pytest.raises(InvalidArgument, match="more than the context length"):
            client.generate("Describe them.", images, max_tokens=4000)
        assert client.generate("Count.", max_tokens=2).token_ids  # the node still serves
    assert [n.metric("encdis_encoder_patches_total") for n in encoder_nodes] == before


def test_two_requests_with_the_same_id_in_flight_do_not_collide(llm_node, monolithic, equality_cases) -> None:
    case = equality_cases["c1_square"]

    async def run() -> list:
        async with AsyncGenerateClient(llm_node.address, timeout=300) as client:
            return await asyncio.gather(*(client.generate(case.prompt, case.images, max_tokens=case.max_tokens,
                                                          ignore_eos=True, request_id="same-id") for _ in range(2)))

    for r in asyncio.run(run()):
        assert r.token_ids == monolithic["c1_square"]


def test_request_ids_are_bounded(llm_node) -> None:
    with GenerateClient(llm_node.address, timeout=60) as client:
        with pytest.raises(InvalidArgument, match="request_id"):
            client.generate("hi", max_tokens=2, request_id="x" * 129)
        with pytest.raises(InvalidArgument, match="request_id"):
            client.generate("hi", max_tokens=2, request_id="bad id\n")
