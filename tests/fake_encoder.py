"""FakeEncoder: a real gRPC EncoderService on loopback whose replies a test scripts.

A fake, because the behaviour tests need (a stream that stalls for a known time, reports
chosen timings, or misbehaves) is what a real encoder node must never do. It describes
itself as the given checkpoint's tower (so the coordinator routes to it), computes each
image's grid from its header with the same smart_resize as the real node, and sends rows
of a constant value. Knobs are attributes a test sets:

    stall_after_header: seconds between an image's header and its first chunk
    hold: a threading.Event or None: after the header (and the stall) each image waits until
        the test sets it; `images_held` counts the images that came to wait
    (a call keeps the stall and hold it started with; `calls` counts it after reading them)
    hang_up_after_header: after the header (and the stall) the call ends UNAVAILABLE, as a call
        to an encoder killed mid-stream does: the embedding never arrives
    linger_after_images: seconds a call stays open after its last image before it ends OK
    extra_after_images: after its images, a call sends one header more (an image no one asked for)
    queue_seconds, preprocess_seconds, batch_seconds: what each header reports
    rows_delta: rows more (or, negative, fewer) than the image's grid gives;
    rows_delta_in_header: True: the header announces those rows too (a self-consistent stream
        of the wrong size); False: the header announces the right rows, the bytes do not
    announce_bytes: > 0: the header announces this many bytes (e.g. 2 GiB for a 64-token
        image) and garbage chunks follow until the caller hangs up (`sent_bytes` counts them)
    wrong_digest: the header carries another image's digest
    datatype: what the header says and the bytes are (Describe always says FP32)
    resource_exhausted: every Encode answers RESOURCE_EXHAUSTED
    on_this_loopback: Describe reports this process's boot id and network namespace (a
        co-located encoder, as far as the coordinator can tell)
    open_colocated_seconds: OpenColocated answers UNAVAILABLE after this long (a slow
        rendezvous); `open_calls` counts the calls, `open_answered` the answers
    report_drain_seconds, report_queued_patches: what its ORCA load reports say (every 20 ms)
    report_hang_after: after this many reports the report stream sends nothing more (None: never)

FakeEncoderThread runs one in a thread with its own event loop, for tests whose own loop
is not running while the fake must answer (a synchronous test driving an LLM node).
"""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import numpy as np
from xds.data.orca.v3 import orca_load_report_pb2
from xds.service.orca.v3 import orca_pb2

from encdis import serving
from encdis.checkpoint import read_processor_config, read_vision_config, text_hidden_size, weights_fingerprint
from encdis.client.errors import ResourceExhausted, Unavailable
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.client.wire import DEFAULT_MAX_CHUNK_BYTES, BatchInfo, content_digest, embedding_messages
from encdis.image_header import read_header
from encdis.llm_node.coordinator.identity import ModelIdentity
from encdis.llm_node.coordinator.patches import grid_for_image
from encdis.pair_group import read_boot_id, read_net_namespace

SERVICE = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name
NUMPY_DTYPES = {"FP32": "<f4", "FP16": "<f2", "BF16": "<u2"}


class FakeEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, ckpt) -> None:
        self.fingerprint = weights_fingerprint(ckpt)
        self.identity = ModelIdentity.from_processor(self.fingerprint, text_hidden_size(ckpt),
                                                     read_processor_config(ckpt))
        self.vision_config = read_vision_config(ckpt)
        self.stall_after_header = 0.0
        self.hold: threading.Event | None = None
        self.images_held = 0
        self.hang_up_after_header = False
        self.linger_after_images = 0.0
        self.extra_after_images = False
        self.queue_seconds = 0.0
        self.preprocess_seconds = 0.0
        self.batch_seconds = 0.01
        self.rows_delta = 0
        self.rows_delta_in_header = True
        self.announce_bytes = 0
        self.wrong_digest = False
        self.datatype = "FP32"
        self.resource_exhausted = False
        self.on_this_loopback = False
        self.open_colocated_seconds = 0.0
        self.open_calls = self.open_answered = 0
        self.report_drain_seconds = 0.0
        self.report_queued_patches = 0.0
        self.report_hang_after: int | None = None
        self.reports_sent = 0
        self.calls = 0
        self.calls_ended = self.calls_cancelled = 0  # calls that ran to their end / the caller cancelled
        self.sent_bytes = 0  # embedding bytes yielded to gRPC, over all calls
        self.address = ""
        self._server: grpc.aio.Server | None = None

    async def start(self) -> FakeEncoder:
        self._server = grpc.aio.server(interceptors=[serving.ErrorMappingInterceptor()])
        encoder_pb2_grpc.add_EncoderServiceServicer_to_server(self, self._server)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "xds.service.orca.v3.OpenRcaService", {"StreamCoreMetrics": grpc.unary_stream_rpc_method_handler(
                self.StreamCoreMetrics, request_deserializer=orca_pb2.OrcaLoadReportRequest.FromString,
                response_serializer=orca_load_report_pb2.OrcaLoadReport.SerializeToString)}),))
        health = await serving.add_health_and_reflection(self._server, [SERVICE])
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        await health.set_serving()
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)

    async def StreamCoreMetrics(self, request, context):
        sent = 0
        while True:
            if self.report_hang_after is not None and sent >= self.report_hang_after:
                await asyncio.get_running_loop().create_future()  # open and silent until cancelled
            report = orca_load_report_pb2.OrcaLoadReport(application_utilization=0.0)
            report.named_metrics["queued_patches"] = self.report_queued_patches
            report.named_metrics["images_in_flight"] = 0.0
            report.named_metrics["drain_seconds"] = self.report_drain_seconds
            sent += 1
            self.reports_sent += 1
            yield report
            await asyncio.sleep(0.02)

    async def Describe(self, request, context) -> encoder_pb2.DescribeResponse:
        ident = self.identity
        return encoder_pb2.DescribeResponse(
            vision_config_json=json.dumps(self.vision_config), out_hidden_size=ident.hidden_size,
            weights_fingerprint=self.fingerprint, device="cpu", datatype="FP32", max_images_per_request=64,
            min_pixels=ident.min_pixels, max_pixels=ident.max_pixels, patch_size=ident.patch_size,
            merge_size=ident.merge_size, temporal_patch_size=ident.temporal_patch_size, image_loader=ident.image_loader,
            tower_impl=ident.tower_impl,
            boot_id=read_boot_id() if self.on_this_loopback else "",
            net_namespace=read_net_namespace() if self.on_this_loopback else "",
        )

    async def OpenColocated(self, request, context) -> encoder_pb2.OpenColocatedResponse:
        self.open_calls += 1
        await asyncio.sleep(self.open_colocated_seconds)
        self.open_answered += 1
        raise Unavailable("the fake encoder opens no co-located pair")

    async def Encode(self, request, context):
        # This call's stall and hold, read before it is counted: a test that sees the count may change them.
        stall, hold = self.stall_after_header, self.hold
        self.calls += 1
        try:
            async for msg in self._encode(request, stall, hold):
                yield msg
            if self.extra_after_images:
                yield encoder_pb2.EncodeResponse(header=encoder_pb2.EmbeddingHeader(image_index=len(request.images)))
            await asyncio.sleep(self.linger_after_images)
        except (asyncio.CancelledError, GeneratorExit):
            self.calls_cancelled += 1
            raise
        self.calls_ended += 1

    async def _encode(self, request, stall: float, hold: threading.Event | None):
        if self.resource_exhausted:
            raise ResourceExhausted("the fake encoder's queue is full")
        ident = self.identity
        grids = []
        for data in request.images:
            header = read_header(bytes(data))
            grids.append(grid_for_image(header.width, header.height, min_pixels=request.min_pixels,
                                        max_pixels=request.max_pixels, patch_size=ident.patch_size,
                                        merge_size=ident.merge_size, temporal_patch_size=ident.temporal_patch_size))
        batch = BatchInfo(seconds=self.batch_seconds, image_patches=tuple(t * h * w for t, h, w in grids))
        for i, (data, grid) in enumerate(zip(request.images, grids, strict=True)):
            digest = content_digest(b"another image" if self.wrong_digest else bytes(data), request.min_pixels,
                                    request.max_pixels, self.fingerprint, ident.image_loader,
                                    tower_impl=ident.tower_impl)
            rows = grid[0] * grid[1] * grid[2] // ident.merge_size**2
            if self.announce_bytes:
                async for msg in self._endless(i, grid, digest):
                    yield msg
                return
            messages = self._messages(i, grid, rows, digest, batch)
            yield next(messages)  # the header
            if stall:
                await asyncio.sleep(stall)
            if hold is not None:
                await self._wait_for_release(hold)
            if self.hang_up_after_header:
                raise Unavailable("the fake encoder hung up mid-stream")
            for msg in messages:
                self.sent_bytes += len(msg.chunk.data)
                yield msg

    async def _wait_for_release(self, hold: threading.Event) -> None:
        # Polled: the test sets it from its own thread and loop.
        self.images_held += 1
        while not hold.is_set():
            await asyncio.sleep(0.01)

    def _messages(self, index: int, grid, rows: int, digest: str, batch: BatchInfo):
        """Header and chunks of one image, with rows_delta applied as the knobs say."""
        hidden = self.identity.hidden_size
        sent_rows = rows + self.rows_delta
        emb = np.full((sent_rows, hidden), float(index), dtype=NUMPY_DTYPES[self.datatype])
        if self.rows_delta_in_header:
            yield from embedding_messages(image_index=index, grid_thw=grid, datatype=self.datatype,
                                          shape=emb.shape, data=emb.tobytes(), digest=digest, batch=batch,
                                          queue_seconds=self.queue_seconds, preprocess_seconds=self.preprocess_seconds)
            return
        # The header of the right size, then the bytes of the wrong one.
        right = np.zeros((rows, hidden), dtype=NUMPY_DTYPES[self.datatype])
        header = next(embedding_messages(image_index=index, grid_thw=grid, datatype=self.datatype,
                                         shape=right.shape, data=right.tobytes(), digest=digest, batch=batch,
                                         queue_seconds=self.queue_seconds))
        yield header
        data = emb.tobytes()
        for k in range(header.header.num_chunks):
            part = data if k == header.header.num_chunks - 1 else data[:DEFAULT_MAX_CHUNK_BYTES]
            data = data[len(part):]
            yield encoder_pb2.EncodeResponse(
                chunk=encoder_pb2.EmbeddingChunk(image_index=index, chunk_index=k, data=part))

    async def _endless(self, index: int, grid, digest: str):
        """A header announcing `announce_bytes`, then garbage chunks until the caller hangs up."""
        hidden, size = self.identity.hidden_size, np.dtype(NUMPY_DTYPES[self.datatype]).itemsize
        tokens = self.announce_bytes // (hidden * size)
        total = tokens * hidden * size
        chunks = -(-total // DEFAULT_MAX_CHUNK_BYTES)
        yield encoder_pb2.EncodeResponse(header=encoder_pb2.EmbeddingHeader(
            image_index=index, grid_thw=list(grid), num_tokens=tokens, hidden_size=hidden, datatype=self.datatype,
            digest=digest, total_bytes=total, num_chunks=chunks))
        garbage = bytes(range(256)) * (DEFAULT_MAX_CHUNK_BYTES // 256)  # one buffer, sent again and again
        for k in range(chunks):
            part = garbage[: min(len(garbage), total - k * len(garbage))]
            self.sent_bytes += len(part)
            yield encoder_pb2.EncodeResponse(
                chunk=encoder_pb2.EmbeddingChunk(image_index=index, chunk_index=k, data=part))


class FakeEncoderThread:
    """A FakeEncoder serving from its own thread and event loop; set its knobs on `.fake`."""

    def __init__(self, ckpt) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-encoder", daemon=True)
        self._thread.start()
        self.fake: FakeEncoder = self._run(self._start(ckpt))

    async def _start(self, ckpt) -> FakeEncoder:
        return await FakeEncoder(ckpt).start()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=60)

    @property
    def address(self) -> str:
        return self.fake.address

    def stop(self) -> None:
        self._run(self.fake.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> FakeEncoderThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
