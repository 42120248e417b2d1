"""encoder_node/embedding_cache.py: LRU by bytes, its default budget, one forward per digest."""

from __future__ import annotations

import asyncio

import pytest

from tests.needs import require_module

torch = require_module("torch")

from encdis.encoder_node.embedding_cache import (  # noqa: E402
    CachedEmbedding,
    EmbeddingCache,
    default_budget,
    memory_limit_bytes,
)

GiB = 1024**3


def entry(nbytes: int, fill: int = 0) -> CachedEmbedding:
    return CachedEmbedding(bytes([fill]) * nbytes, (1, 2, 2), (1, nbytes // 4), "FP32")


def test_lru_by_bytes_evicts_the_least_recently_used_and_respects_the_budget():
    c = EmbeddingCache(100)
    for d in "abc":
        assert c.put(d, entry(40))  # c evicts a
    assert [c.has(d) for d in "abc"] == [False, True, True] and c.nbytes == 80
    c.get("b")  # b is now the most recent: d evicts c
    c.put("d", entry(40))
    assert [c.has(d) for d in "bcd"] == [True, False, True] and c.nbytes <= 100


def test_an_entry_larger_than_the_budget_is_not_stored_and_0_is_off():
    c = EmbeddingCache(100)
    c.put("a", entry(40))
    assert not c.put("big", entry(104)) and c.has("a") and not c.has("big")
    off = EmbeddingCache(0)
    assert not off.enabled and not off.put("a", entry(4)) and len(off) == 0


def test_a_cached_entry_is_immutable_bytes_independent_of_the_tensor():
    t = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    e = CachedEmbedding.of(t, (1, 4, 2), "FP32")
    t.fill_(-1)  # the tower's buffer reused afterwards
    assert isinstance(e.data, bytes) and torch.equal(e.tensor(), torch.arange(8, dtype=torch.float32).reshape(2, 4))
    with pytest.raises(TypeError):
        memoryview(e.data)[0] = 1


def test_default_budget_is_the_smaller_of_2_gib_and_5_percent_of_the_limit(tmp_path):
    assert default_budget(16 * GiB) == int(16 * GiB * 0.05)
    assert default_budget(512 * GiB) == 2 * GiB
    ram = lambda: 64 * GiB  # noqa: E731
    (tmp_path / "memory.max").write_text(f"{8 * GiB}\n")
    assert memory_limit_bytes(tmp_path, ram) == 8 * GiB  # cgroup v2 limit
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_limit_bytes(tmp_path, ram) == 64 * GiB  # v2 without a limit: the RAM
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    assert memory_limit_bytes(v1, ram) == 4 * GiB
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory_limit_bytes(v1, ram) == 64 * GiB
    assert memory_limit_bytes(tmp_path / "none", ram) == 64 * GiB


def test_a_second_caller_awaits_the_first_and_computes_itself_if_the_first_fails():
    async def run():
        c = EmbeddingCache(1000)
        assert c.claim("d") is None  # the first computes
        waiting = c.claim("d")
        # Being computed is present to Has: a call for it now waits for this forward, runs none.
        assert waiting is not None and c.has("d") and len(c) == 0
        c.finish("d", entry(8, 1))
        assert (await waiting).data == entry(8, 1).data and c.has("d")
        assert c.claim("e") is None
        failed = c.claim("e")
        c.abandon("e")
        with pytest.raises(LookupError):
            await failed
        assert not c.has("e")  # abandoned: nobody computes it now
        assert c.claim("e") is None  # the waiter now computes it itself
        c.abandon("e")
        c.abandon("never-claimed")  # harmless

    asyncio.run(run())
