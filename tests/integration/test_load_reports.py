"""Load reports: encoders report their load over ORCA, and coordinators balance on the reports.

Two real encoder nodes (subprocesses on 127.0.0.1) serve the session's tiny checkpoint. Two
coordinators run in-process, as two LLM nodes would: A knows only encoder 1 and keeps it
busy; B knows both. With reports, B's images go to encoder 2, which B alone would take for
idle as much as encoder 1. FakeEncoder (tests/fake_encoder.py) plays encoders whose reports
hang or lie, which a real node never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import io

import grpc
import pytest
from google.protobuf import duration_pb2
from PIL import Image
from xds.data.orca.v3 import orca_load_report_pb2
from xds.service.orca.v3 import orca_pb2

from encdis.client.generate_client import EncoderInfo
from encdis.launcher import NodeProcess
from encdis.llm_node.grpc_front import encoder_info
from tests.fake_encoder import FakeEncoder
from tests.integration.test_coordinator import (
    coordinator,
    metric,
    png,
    started_encoders,
    wait_for,
)

ORCA_METHOD = "/xds.service.orca.v3.OpenRcaService/StreamCoreMetrics"


@pytest.fixture(scope="module")
def two(tiny_ckpt):
    with started_encoders(tiny_ckpt) as nodes:
        yield nodes


def report_stream(channel: grpc.aio.Channel, interval: float):
    call = channel.unary_stream(ORCA_METHOD, request_serializer=orca_pb2.OrcaLoadReportRequest.SerializeToString,
                                response_deserializer=orca_load_report_pb2.OrcaLoadReport.FromString)
    whole = int(interval)
    return call(orca_pb2.OrcaLoadReportRequest(
        report_interval=duration_pb2.Duration(seconds=whole, nanos=int((interval - whole) * 1e9))))


# A's requests in flight at once, 3 images of 1024 patches each: 36 images, more than two of
# the encoder's forwards (--max-batch-patches 16384 holds 16 of these), so when a batch ends
# another batch of A's is queued behind the next one, even while A is slow to send again. With
# all of A's work in one batch (3 requests), A's requests ended together and the encoder
# reported an empty queue until A sent again, which B rightly believed.
BUSY_STREAMS = 12


def big_images(seed: int, n: int) -> list[bytes]:
    """n distinct 448x448 PNGs (1024 patches each), one solid colour per seed: made in about 2 ms
    each, so this test's loop keeps the encoder fed (random pixels took 20 ms an image here, about
    what the encoder's forward of one takes, and its queue ran dry between A's requests)."""
    out = []
    for s in range(seed, seed + n):
        buf = io.BytesIO()
        Image.new("RGB", (448, 448), (s & 255, s >> 8 & 255, s >> 16 & 255)).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


async def test_an_encoder_reports_at_once_when_its_queue_grows_by_more_than_one_image(two, tiny_ckpt) -> None:
    node = two[0]
    async with grpc.aio.insecure_channel(node.address) as channel:
        # A long interval: any report after the first is one the queue change triggered.
        stream = report_stream(channel, 600.0)
        first = await stream.read()
        assert first.named_metrics["queued_patches"] == 0
        assert first.named_metrics["images_in_flight"] == 0
        assert set(first.named_metrics) == {"queued_patches", "images_in_flight", "drain_seconds"}
        async with coordinator(tiny_ckpt, [node.address], load_reports="off", hedge="off") as coord:
            work = asyncio.ensure_future(coord.encode(big_images(500, 6)))
            second = await asyncio.wait_for(stream.read(), 120)
            await work
        assert second.named_metrics["images_in_flight"] >= 2
        assert second.named_metrics["queued_patches"] > 0
        stream.cancel()


async def keep_busy(coord, stop: asyncio.Event, seed: int) -> None:
    k = 0
    while not stop.is_set():
        await coord.encode(big_images(seed + 10 * k, 3))
        k += 1


async def images_to(busy_node: NodeProcess, idle_node: NodeProcess, tiny_ckpt, load_reports: str,
                    seed: int) -> tuple[int, int]:
    """A keeps busy_node busy; B (knowing both) sends 16 one-image requests one after another.
    Returns B's images on (busy, idle) node."""
    async with coordinator(tiny_ckpt, [busy_node.address], load_reports=load_reports, hedge="off") as a, \
            coordinator(tiny_ckpt, [busy_node.address, idle_node.address], load_reports=load_reports,
                        hedge="off") as b:
        await wait_for(lambda: len(b.pool.serving()) == 2, what="both encoders serving B")
        # Fit B's cost models of both (so its own view means something), then start A.
        await b.encode([png(200 + 14 * i, 200, seed=seed + i) for i in range(4)])
        before = {e: metric(b.registry, "encdis_coordinator_assignments_total", encoder=e)
                  for e in (busy_node.address, idle_node.address)}
        stop = asyncio.Event()
        streams = [asyncio.ensure_future(keep_busy(a, stop, seed + 1000 * (s + 1))) for s in range(BUSY_STREAMS)]
        try:
            await wait_for(lambda: a.pool.backlog_patches(a.pool.encoders()[0]) > 0, what="A's work in flight")
            if load_reports == "on":
                h = next(h for h in b.pool.encoders() if h.address == busy_node.address)
                await wait_for(lambda: h.reports.latest is not None and h.reports.latest.queued_patches > 0,
                               what="the busy encoder's report of A's work reaching B")
            for i in range(16):
                await b.encode([png(300, 300, seed=seed + 100 + i)])
        finally:
            stop.set()
            await asyncio.gather(*streams)
        after = {e: metric(b.registry, "encdis_coordinator_assignments_total", encoder=e) - before[e]
                 for e in before}
        return int(after[busy_node.address]), int(after[idle_node.address])


async def test_a_coordinator_sends_its_images_past_an_encoder_another_coordinator_keeps_busy(two, tiny_ckpt) -> None:
    busy, idle = two
    on_busy, on_idle = await images_to(busy, idle, tiny_ckpt, "on", seed=10_000)
    assert on_busy + on_idle == 16
    assert on_busy <= 3, f"with load reports, B still sent {on_busy} of 16 images to the busy encoder"


@pytest.mark.parametrize("load_reports", ["on", "off"])
async def test_an_encoder_reporting_a_long_queue_gets_work_only_without_load_reports(
        two, tiny_ckpt, load_reports) -> None:
    """The same contrast, exact: a fake encoder whose every report says 100 s of queued work
    (as another LLM node's load would), beside a real idle one."""
    fake = await FakeEncoder(tiny_ckpt).start()
    fake.report_drain_seconds = 100.0
    fake.report_queued_patches = 100_000.0
    fake.batch_seconds = 1e-4  # its batches look faster than any real one: the cheaper encoder by far
    real = two[1]
    try:
        async with coordinator(tiny_ckpt, [fake.address, real.address], load_reports=load_reports,
                               hedge="off") as coord:
            await wait_for(lambda: len(coord.pool.serving()) == 2, what="both serving")
            if load_reports == "on":
                await wait_for(lambda: all(h.reports.latest is not None for h in coord.pool.encoders()),
                               what="reports from both")
            else:
                assert all(h.reports is None for h in coord.pool.encoders())  # no report stream opened
                assert not any(s.has_report for s in coord.encoders())
            for i in range(16):
                await coord.encode([png(200, 200, seed=700 + i)])
            to_fake = metric(coord.registry, "encdis_coordinator_assignments_total", encoder=fake.address)
            if load_reports == "on":
                assert to_fake == 0, f"the encoder reporting 100 s of queue got {to_fake} of 16 images"
            else:
                # Its own view only: the fake looks idle and the cheapest, and gets most of the work.
                assert to_fake >= 8, f"without load reports the fake got only {to_fake} of 16 images"
    finally:
        await fake.stop()


async def test_a_hung_report_stream_ages_out_and_no_request_waits_for_it(tiny_ckpt) -> None:
    fake = await FakeEncoder(tiny_ckpt).start()
    fake.report_drain_seconds = 100.0  # its one report: very busy
    fake.report_queued_patches = 50_000.0
    fake.report_hang_after = 1
    try:
        async with coordinator(tiny_ckpt, [fake.address], load_report_max_age_seconds=0.5, hedge="off") as coord:
            await wait_for(lambda: len(coord.pool.serving()) == 1, what="the fake serving")
            h = coord.pool.encoders()[0]
            await wait_for(lambda: h.reports.latest is not None, what="the one report")
            received = h.reports.latest.received_at
            assert coord.pool.backlog_seconds(h) > 50  # the report counts while fresh
            await wait_for(lambda: coord.pool.backlog_seconds(h) < 1.0, what="the report aging out")
            assert h.reports.latest.received_at == received  # no newer report came: it aged out
            # ListEncoders (and the SDK) show that last report and how old it is.
            shown = EncoderInfo.from_proto(encoder_info(coord.encoders()[0]))
            assert shown.report is not None and shown.report["drain_seconds"] == 100.0
            assert shown.report["queued_patches"] == 50_000.0
            assert shown.report_age_seconds > 0.5
            # The stream is still open and silent; a request goes through without waiting on it.
            result = await coord.encode([png(120, 120, seed=1)])
            assert len(result.images) == 1
            assert h.reports.reports == 1
    finally:
        await fake.stop()


async def test_an_encoder_reporting_idle_but_answering_late_gets_a_bounded_share(two, tiny_ckpt) -> None:
    fake = await FakeEncoder(tiny_ckpt).start()
    fake.stall_after_header = 1.0  # answers late, while its reports always say idle
    real = two[1]
    try:
        async with coordinator(tiny_ckpt, [fake.address, real.address], hedge="off") as coord:
            await wait_for(lambda: len(coord.pool.serving()) == 2, what="both serving")
            await wait_for(lambda: all(h.reports.latest is not None for h in coord.pool.encoders()),
                           what="reports from both")
            for i in range(4):  # fit both cost models
                await coord.encode([png(150 + 14 * i, 150, seed=300 + i), png(160, 150 + 14 * i, seed=400 + i)])
            before = metric(coord.registry, "encdis_coordinator_assignments_total", encoder=fake.address)
            for i in range(20):
                await coord.encode([png(200, 200, seed=500 + i)])
            to_fake = metric(coord.registry, "encdis_coordinator_assignments_total", encoder=fake.address) - before
            assert to_fake <= 5, f"the late encoder that reports idle got {to_fake} of 20 images"
    finally:
        with contextlib.suppress(Exception):
            await fake.stop()
