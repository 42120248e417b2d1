"""FakeEncoder: a real gRPC EncoderService on loopback whose replies a test scripts.

A fake, because the behaviour tests need (a stream that stalls for a known time, reports
chosen timings, or misbehaves) is what a real encoder node must never do. It describes
itself as the given checkpoint's tower (so the coordinator routes to it), computes each
image's grid from its header with the same smart_resize as the real node, and sends rows
of a constant value. Knobs are attributes a test sets:

    stall_after_header: seconds between an image's header and its first chunk
    queue_seconds, batch_seconds: what each header reports
"""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np

from encdis import serving
from encdis.checkpoint import read_processor_config, read_vision_config, text_hidden_size, weights_fingerprint
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.client.wire import BatchInfo, content_digest, embedding_messages
from encdis.image_header import read_header
from encdis.llm_node.coordinator.identity import ModelIdentity
from encdis.llm_node.coordinator.patches import grid_for_image

SERVICE = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name


class FakeEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, ckpt) -> None:
        self.fingerprint = weights_fingerprint(ckpt)
        self.identity = ModelIdentity.from_processor(self.fingerprint, text_hidden_size(ckpt),
                                                     read_processor_config(ckpt))
        self.vision_config = read_vision_config(ckpt)
        self.stall_after_header = 0.0
        self.queue_seconds = 0.0
        self.batch_seconds = 0.01
        self.calls = 0
        self.address = ""
        self._server: grpc.aio.Server | None = None

    async def start(self) -> FakeEncoder:
        self._server = grpc.aio.server()
        encoder_pb2_grpc.add_EncoderServiceServicer_to_server(self, self._server)
        health = await serving.add_health_and_reflection(self._server, [SERVICE])
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        await health.set_serving()
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)

    async def Describe(self, request, context) -> encoder_pb2.DescribeResponse:
        ident = self.identity
        return encoder_pb2.DescribeResponse(
            vision_config_json=json.dumps(self.vision_config), out_hidden_size=ident.hidden_size,
            weights_fingerprint=self.fingerprint, device="cpu", datatype="FP32", max_images_per_request=64,
            min_pixels=ident.min_pixels, max_pixels=ident.max_pixels, patch_size=ident.patch_size,
            merge_size=ident.merge_size, temporal_patch_size=ident.temporal_patch_size, image_loader=ident.image_loader,
        )

    async def Encode(self, request, context):
        self.calls += 1
        ident = self.identity
        grids = []
        for data in request.images:
            header = read_header(bytes(data))
            grids.append(grid_for_image(header.width, header.height, min_pixels=request.min_pixels,
                                        max_pixels=request.max_pixels, patch_size=ident.patch_size,
                                        merge_size=ident.merge_size, temporal_patch_size=ident.temporal_patch_size))
        batch = BatchInfo(seconds=self.batch_seconds, image_patches=tuple(t * h * w for t, h, w in grids))
        for i, (data, grid) in enumerate(zip(request.images, grids, strict=True)):
            rows = grid[0] * grid[1] * grid[2] // ident.merge_size**2
            emb = np.full((rows, ident.hidden_size), float(i), dtype="<f4")
            messages = embedding_messages(
                image_index=i, grid_thw=grid, datatype="FP32", shape=emb.shape, data=emb.tobytes(),
                digest=content_digest(bytes(data), request.min_pixels, request.max_pixels, self.fingerprint,
                                      ident.image_loader),
                batch=batch, queue_seconds=self.queue_seconds,
            )
            yield next(messages)  # the header
            if self.stall_after_header:
                await asyncio.sleep(self.stall_after_header)
            for msg in messages:
                yield msg
