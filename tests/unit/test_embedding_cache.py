"""The coordinator's embedding cache: LRU bounded in bytes, one encode per in-flight digest."""

from __future__ import annotations

import asyncio

import pytest
import torch

from encdis.llm_node.coordinator.embedding_cache import ClaimAbandoned, EmbeddingCache
from encdis.llm_node.coordinator.records import ImageEmbedding


def entry(digest: str, rows: int, hidden: int = 4) -> ImageEmbedding:
    return ImageEmbedding(embeds=torch.zeros(rows, hidden), grid_thw=(1, 2, 2 * rows), digest=digest)


def test_lru_evicts_least_recently_used_within_the_byte_budget() -> None:
    cache = EmbeddingCache(max_bytes=3 * 16)  # three 1x4 fp32 entries
    for d in "abc":
        assert cache.put(entry(d, 1))
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put(entry("d", 1))
    assert [d for d in "abcd" if d in cache] == ["a", "c", "d"]
    assert cache.size_bytes == 48


def test_a_large_entry_evicts_several_and_one_over_the_budget_is_not_stored() -> None:
    cache = EmbeddingCache(max_bytes=64)
    cache.put(entry("a", 1))
    cache.put(entry("b", 1))
    cache.put(entry("big", 3))  # 48 bytes: a must go (16 + 16 + 48 > 64)
    assert "a" not in cache and "b" in cache and "big" in cache
    assert not cache.put(entry("huge", 5))  # 80 bytes > 64
    assert "huge" not in cache and cache.size_bytes == 64


def test_zero_budget_stores_nothing() -> None:
    cache = EmbeddingCache(max_bytes=0)
    assert not cache.put(entry("a", 1))
    assert cache.get("a") is None and len(cache) == 0


async def test_waiters_get_the_claimants_result_and_it_is_cached() -> None:
    cache = EmbeddingCache(max_bytes=1 << 20)
    fut = cache.claim("x")
    assert cache.pending("x") is fut
    waiters = [asyncio.ensure_future(asyncio.shield(cache.pending("x"))) for _ in range(3)]
    await asyncio.sleep(0)
    e = entry("x", 2)
    cache.fulfil(e)
    assert [await w for w in waiters] == [e, e, e]
    assert cache.pending("x") is None and cache.get("x") is e


async def test_a_cancelled_waiter_does_not_cancel_the_encode_for_others() -> None:
    cache = EmbeddingCache(max_bytes=1 << 20)
    cache.claim("x")
    impatient = asyncio.ensure_future(asyncio.shield(cache.pending("x")))
    patient = asyncio.ensure_future(asyncio.shield(cache.pending("x")))
    await asyncio.sleep(0)
    impatient.cancel()
    cache.fulfil(entry("x", 1))
    assert (await patient).digest == "x"


async def test_failed_claim_reaches_waiters_and_nothing_is_stored() -> None:
    cache = EmbeddingCache(max_bytes=1 << 20)
    cache.claim("x")
    waiter = asyncio.ensure_future(asyncio.shield(cache.pending("x")))
    await asyncio.sleep(0)
    cache.fail("x", ClaimAbandoned())
    with pytest.raises(ClaimAbandoned):
        await waiter
    assert "x" not in cache and cache.pending("x") is None
    cache.claim("x")  # the digest can be claimed again
    cache.fail("x", ClaimAbandoned())  # nobody waits: no "exception never retrieved" noise


async def test_double_claim_is_a_bug() -> None:
    cache = EmbeddingCache(max_bytes=1 << 20)
    cache.claim("x")
    with pytest.raises(RuntimeError):
        cache.claim("x")
    cache.fail("x", ClaimAbandoned())
