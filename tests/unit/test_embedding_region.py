"""The shared region and encdis's encoder-cache connector: rows written once, read by links, nothing left behind."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

from encdis.llm_node.embedding_region import EmbeddingRegion, pin_name

HIDDEN = 8


@pytest.fixture
def region(tmp_path):
    r = EmbeddingRegion(torch.float32, parent=str(tmp_path))
    yield r
    r.close()


def rows(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def files(region: EmbeddingRegion) -> list[str]:
    return sorted(os.listdir(region.path))


def test_rows_are_written_once_and_removed_after_the_last_request(region):
    a = rows(3, 0)
    region.acquire([("aa", a)])
    assert files(region) == ["aa"] and (region.entries, region.nbytes) == (1, a.numel() * 4)
    on_disk = torch.from_file(os.path.join(region.path, "aa"), size=a.numel(), dtype=torch.float32)
    assert torch.equal(on_disk.view(3, HIDDEN), a)
    region.acquire([("aa", rows(3, 99))])  # a second request for the same digest: the bytes are not rewritten
    assert torch.equal(torch.from_file(os.path.join(region.path, "aa"), size=a.numel()).view(3, HIDDEN), a)
    region.release(["aa"])
    assert files(region) == ["aa"]  # the other request still holds it
    region.release(["aa"])
    assert files(region) == [] and (region.entries, region.nbytes) == (0, 0)
    assert region.room_bytes() > 0


def test_rows_are_written_in_the_engines_dtype(region):
    region.dtype = torch.bfloat16
    region.acquire([("bf", rows(2, 1))])
    assert os.path.getsize(os.path.join(region.path, "bf")) == 2 * HIDDEN * 2


def test_concurrent_requests_for_one_digest_all_see_it_written(region):
    barrier = threading.Barrier(8)
    seen: list[bool] = []

    def request():
        barrier.wait()
        region.acquire([("same", rows(64, 2))])
        seen.append(os.path.getsize(os.path.join(region.path, "same")) == 64 * HIDDEN * 4)

    threads = [threading.Thread(target=request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [True] * 8 and region.entries == 1
    region.release(["same"] * 8)
    assert files(region) == []


def test_a_failed_request_holds_nothing(region):
    region.acquire([("kept", rows(1, 3))])
    with pytest.raises(ValueError, match="cannot name a file"):
        region.acquire([("kept", rows(1, 3)), ("new", rows(1, 4)), ("../escape", rows(1, 5))])
    assert files(region) == ["kept"] and region.entries == 1  # the earlier request's hold only


# ---- the connector, both sides, without an engine --------------------------------------------

def connector(region: EmbeddingRegion, role: str, ranks: int = 2):
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from encdis.llm_node.ec_connector import EncdisECConnector

    # A minimal stand-in for VllmConfig: only what the connector reads (vLLM's own is built by an engine).
    config = SimpleNamespace(
        ec_transfer_config=ECTransferConfig(ec_connector="EncdisECConnector", ec_role="ec_consumer",
                                            ec_connector_extra_config={"region": region.path}),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=1, tensor_parallel_size=ranks),
        model_config=SimpleNamespace(dtype=torch.float32, get_inputs_embeds_size=lambda: HIDDEN))
    return EncdisECConnector(config, ECConnectorRole[role])


def request(rid: str, digests: list[str], tokens: int):
    return SimpleNamespace(request_id=rid, mm_features=[SimpleNamespace(identifier=d) for d in digests],
                           get_num_encoder_embeds=lambda index: tokens)


def load_on_rank(worker, metadata, rank: int, monkeypatch) -> dict[str, torch.Tensor]:
    import vllm.distributed.parallel_state as parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: rank)
    cache: dict[str, torch.Tensor] = {}
    worker.bind_connector_metadata(metadata)
    worker.start_load_caches(cache)
    worker.clear_connector_metadata()
    return cache


def test_each_rank_maps_the_rows_and_nothing_is_left_however_the_request_ends(region, monkeypatch):
    a = rows(5, 6)
    region.acquire([("dd", a)])
    scheduler, worker = connector(region, "SCHEDULER"), connector(region, "WORKER")
    req = request("r1", ["dd", "dd"], 5)  # one image twice: pinned once
    assert scheduler.ensure_cache_available(req, 0) and scheduler.has_cache_item("dd")
    scheduler.update_state_after_alloc(req, 0)
    metadata = scheduler.build_connector_meta(None)
    assert [(d, n) for d, _, n in metadata.loads] == [("dd", 5)]
    assert scheduler.build_connector_meta(None).loads == []  # a step's loads go out once
    region.release(["dd"])  # the node gives the request up (an abort on its way): the pin keeps the rows
    caches = [load_on_rank(worker, metadata, rank, monkeypatch) for rank in (0, 1)]
    assert all(torch.equal(c["dd"], a) for c in caches)
    assert files(region) == [pin_name("dd", "r1")]  # each rank removed its link
    scheduler.request_finished(req)
    assert files(region) == [] and not scheduler.has_cache_item("dd")
    assert torch.equal(caches[0]["dd"], a)  # the mapping outlives the files


def test_a_request_whose_rows_are_gone_is_failed_not_run(region):
    scheduler = connector(region, "SCHEDULER")
    region.acquire([("here", rows(1, 7))])
    req = request("r2", ["here", "gone"], 1)
    assert not scheduler.ensure_cache_available(req, 0)
    assert scheduler.take_unavailable_requests() == {"r2"} and scheduler.take_unavailable_requests() == set()
    assert files(region) == ["here"] and not scheduler.has_cache_item("here")  # its partial pins undone
    scheduler.request_finished(req)


def test_rows_of_the_wrong_size_are_refused_by_name(region, monkeypatch):
    region.acquire([("short", rows(2, 8))])
    scheduler, worker = connector(region, "SCHEDULER", ranks=1), connector(region, "WORKER", ranks=1)
    req = request("r3", ["short"], 3)  # the grid says 3 rows
    assert scheduler.ensure_cache_available(req, 0)
    scheduler.update_state_after_alloc(req, 0)
    with pytest.raises(RuntimeError, match="short.* has 64 bytes, expected 3 rows x 8 x 4 = 96"):
        load_on_rank(worker, scheduler.build_connector_meta(None), 0, monkeypatch)
    scheduler.request_finished(req)
    region.release(["short"])
    assert files(region) == []


def test_regions_left_by_dead_nodes_are_removed_at_start(tmp_path):
    import subprocess
    import sys

    from encdis.llm_node.embedding_region import _started

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    me, parent = os.getpid(), os.getppid()
    gone = tmp_path / f"encdis-region-{int(dead.stdout)}-1-abc"
    reused = tmp_path / f"encdis-region-{me}-{_started(me) - 1}-old"  # this pid, an earlier process (a restart)
    live = tmp_path / f"encdis-region-{parent}-{_started(parent)}-xyz"
    sibling = tmp_path / f"encdis-region-{me}-{_started(me)}-abc"  # another region of this very process
    other = tmp_path / "not-a-region"
    for d in (gone, reused, live, sibling, other):
        d.mkdir()
        (d / "aa").write_bytes(b"x")
    region = EmbeddingRegion(torch.float32, parent=str(tmp_path))
    try:
        assert sorted(os.listdir(tmp_path)) == sorted([live.name, sibling.name, other.name,
                                                       os.path.basename(region.path)])
    finally:
        region.close()


def test_rows_received_into_the_region_are_linked_not_copied(region):
    import gc

    buf = region.buffer(4 * HIDDEN * 4)
    received = torch.frombuffer(memoryview(buf), dtype=torch.float32).view(4, HIDDEN)  # as the coordinator does
    received.copy_(rows(4, 9))
    (buffer_file,) = files(region)
    # Only links to make: the node takes them on its loop, without a thread hop.
    assert region.links_only([("rx", received)])
    assert not region.links_only([("rx", received), ("heap", rows(4, 9))])  # heap rows are copied
    assert not region.links_only([("rx", received.to(torch.bfloat16))])  # a dtype conversion is a copy
    region.acquire([("rx", received)])
    assert region.links_only([("rx", rows(4, 1))])  # held and written: a count, whatever rows come
    assert os.stat(os.path.join(region.path, "rx")).st_ino == os.stat(os.path.join(region.path, buffer_file)).st_ino
    region.release(["rx"])
    assert files(region) == [buffer_file]  # the coordinator's tensor still holds its buffer
    del received, buf
    gc.collect()
    assert files(region) == []  # its file goes with the last tensor over it


def test_a_full_region_receives_into_the_heap_and_still_serves(region, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    buf = region.buffer(2 * HIDDEN * 4)
    assert files(region) == [] and buf.nbytes == 2 * HIDDEN * 4
    monkeypatch.undo()
    received = torch.frombuffer(memoryview(buf), dtype=torch.float32).view(2, HIDDEN)
    region.acquire([("heap", received)])  # written, a copy
    assert os.path.getsize(os.path.join(region.path, "heap")) == 2 * HIDDEN * 4
    region.release(["heap"])
