"""Co-location is one loopback, not one host: two pods on one Kubernetes node, on this machine.

A real encoder node runs in a network namespace of its own (`unshare -n`, tests/netns.py): the
same boot id as this process, another loopback, reachable only through a relay, as a pod is
through its pod IP. The coordinator (in-process) must see it is not co-located from its
Describe (boot id equal, namespace not) and never try a rendezvous that could only time out;
the encoder must refuse a pair from a caller outside its namespace. And under auto a
rendezvous, however slow, runs beside the traffic: requests go over gRPC until it is up
(a FakeEncoder whose OpenColocated never answers in time plays the slow peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from encdis.client.encoder_client import EncoderClient
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.launcher import NodeProcess
from encdis.llm_node.coordinator import colocated
from encdis.llm_node.coordinator.coordinator import Coordinator
from encdis.llm_node.coordinator.settings import CoordinatorSettings
from encdis.pair_group import read_boot_id, read_net_namespace
from tests.fake_encoder import FakeEncoder
from tests.integration.test_coordinator import NODE_TIMEOUT, coordinator, encoder_args, metric, png, wait_for
from tests.needs import require_or_skip
from tests.netns import POD_PORT, Relay, pod_wrapper, require_network_namespaces

pytestmark = [pytest.mark.timeout(600)]

require_or_skip(bool(read_boot_id()) and bool(read_net_namespace()),
                "a host boot id and /proc/self/ns/net", "co-location is decided by both; Linux only")

COLOCATED = "encdis_coordinator_colocated_embeddings_total"


@pytest.fixture
def auto_pairs_gloo(monkeypatch) -> None:
    """--colocated auto pairs NCCL only, which this machine lacks: let it pair gloo too, so auto's
    own path runs here as it does on GPUs."""
    monkeypatch.setattr(colocated, "AUTO_BACKENDS", ("nccl", "gloo"))


@contextlib.asynccontextmanager
async def auto(ckpt, encoders: list[str], **settings) -> AsyncIterator[Coordinator]:
    registry = CollectorRegistry()
    coord = Coordinator.from_checkpoint(CoordinatorSettings(encoders=tuple(encoders), colocated="auto", **settings),
                                        registry, ckpt)
    coord.registry = registry
    await coord.start()
    assert coord.colocated.auto_backends == ("nccl", "gloo")
    try:
        yield coord
    finally:
        await coord.stop()


@pytest.fixture(scope="module")
def pod(tiny_ckpt):
    """A real encoder node in its own network namespace, and the relay that reaches it."""
    require_network_namespaces()
    with tempfile.TemporaryDirectory(prefix="encdis-pod-") as tmp:
        sock = str(Path(tmp) / "encoder.sock")
        node = NodeProcess(encoder_args(tiny_ckpt, "127.0.0.1", POD_PORT), wrapper=pod_wrapper(sock),
                           name="encoder-pod").wait_ready(NODE_TIMEOUT)
        relay = Relay(sock)
        try:
            yield relay
        finally:
            relay.close()
            node.stop()


def test_the_pod_shares_the_boot_id_not_the_network_namespace(pod) -> None:
    with EncoderClient(pod.address) as client:
        desc = client.describe()
    assert desc.boot_id == read_boot_id()
    assert desc.net_namespace.startswith("net:[") and desc.net_namespace != read_net_namespace()


async def test_require_refuses_the_pod_naming_the_namespace_without_a_rendezvous(pod, tiny_ckpt) -> None:
    async with coordinator(tiny_ckpt, [pod.address], colocated="require") as coord:
        await wait_for(lambda: coord.encoders() and coord.encoders()[0].state == "refused",
                       what="the pod refused")
        reason = coord.encoders()[0].reason
        assert "--colocated require" in reason and "another network namespace" in reason, reason
        assert not coord.colocated.opening(pod.address)


async def test_auto_serves_the_pod_over_grpc_and_never_opens_a_pair(pod, tiny_ckpt, auto_pairs_gloo) -> None:
    async with auto(tiny_ckpt, [pod.address], encoder_wait_seconds=30.0) as coord:
        result = await coord.encode([png(224, 224, seed=1), png(112, 168, seed=2)])
        assert len(result.images) == 2 and [s.state for s in coord.encoders()] == ["serving"]
        assert metric(coord.registry, COLOCATED) == 0
        assert not coord.colocated.opening(pod.address)
        assert coord.colocated.receiver(coord.pool.encoders()[0]) is None


async def test_the_pod_refuses_a_pair_from_outside_its_namespace(pod) -> None:
    req = encoder_pb2.OpenColocatedRequest(session_id="from-another-pod", store_host="127.0.0.1", store_port=1,
                                           backend="gloo", boot_id=read_boot_id(),
                                           net_namespace=read_net_namespace(), timeout_seconds=5)
    async with grpc.aio.insecure_channel(pod.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await encoder_pb2_grpc.EncoderServiceStub(channel).OpenColocated(req, timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another network namespace" in refused.value.details()


async def test_under_auto_requests_never_wait_for_a_slow_rendezvous(tiny_ckpt, auto_pairs_gloo) -> None:
    fake = await FakeEncoder(tiny_ckpt).start()
    fake.on_this_loopback = True
    fake.open_colocated_seconds = 600.0
    try:
        # The rendezvous may take 20 s; a request waits 5 s at most for an encoder to serve.
        async with auto(tiny_ckpt, [fake.address], colocated_timeout_seconds=20.0,
                        encoder_wait_seconds=5.0) as coord:
            await wait_for(lambda: fake.open_calls == 1, what="the rendezvous under way")
            # The rendezvous has not answered, and the encoder serves over gRPC all the same.
            results = await asyncio.gather(*(coord.encode([png(112, 112 + 28 * i, seed=10 + i)]) for i in range(3)))
            assert all(len(r.images) == 1 for r in results)
            assert fake.open_answered == 0 and coord.colocated.opening(fake.address)
            assert [s.state for s in coord.encoders()] == ["serving"]
            assert metric(coord.registry, COLOCATED) == 0
    finally:
        await fake.stop()
