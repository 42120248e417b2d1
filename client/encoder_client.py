"""Clients for an encoder node's EncoderService, sync and asyncio.

    with EncoderClient("127.0.0.1:50051") as enc:
        for e in enc.encode([open("cat.jpg", "rb").read()]):
            print(e.grid_thw, e.array().shape, e.digest)

Failed calls raise the typed exceptions of `encdis.client.errors`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from encdis.client.errors import from_rpc_error
from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
from encdis.client.wire import Embedding, StreamDecoder

# Embedding chunks are at most 4 MiB by default; leave room for a larger chunk setting.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


@dataclass(frozen=True)
class EncoderDescription:
    """An encoder node's model identity, limits and host (its Describe reply)."""

    vision_config: dict[str, Any]
    out_hidden_size: int
    weights_fingerprint: str
    device: str
    datatype: str
    max_batch_patches: int
    max_images_per_request: int
    max_image_bytes: int
    max_image_pixels: int
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    boot_id: str
    hostname: str
    version: str
    max_chunk_bytes: int
    image_loader: str = ""

    @classmethod
    def from_proto(cls, r: encoder_pb2.DescribeResponse) -> EncoderDescription:
        return cls(
            vision_config=json.loads(r.vision_config_json or "{}"),
            out_hidden_size=r.out_hidden_size,
            weights_fingerprint=r.weights_fingerprint,
            device=r.device,
            datatype=r.datatype,
            max_batch_patches=r.max_batch_patches,
            max_images_per_request=r.max_images_per_request,
            max_image_bytes=r.max_image_bytes,
            max_image_pixels=r.max_image_pixels,
            min_pixels=r.min_pixels,
            max_pixels=r.max_pixels,
            patch_size=r.patch_size,
            merge_size=r.merge_size,
            temporal_patch_size=r.temporal_patch_size,
            boot_id=r.boot_id,
            hostname=r.hostname,
            version=r.version,
            max_chunk_bytes=r.max_chunk_bytes,
            image_loader=r.image_loader,
        )


def encode_request(
    images: Sequence[bytes], min_pixels: int = 0, max_pixels: int = 0, max_chunk_bytes: int = 0
) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(
        images=list(images), min_pixels=min_pixels, max_pixels=max_pixels, max_chunk_bytes=max_chunk_bytes
    )


class EncoderClient:
    """Blocking client for one encoder node."""

    def __init__(self, target: str, *, timeout: float | None = None,
                 channel: grpc.Channel | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)

    def encode(self, images: Sequence[bytes], *, min_pixels: int = 0, max_pixels: int = 0,
               max_chunk_bytes: int = 0, timeout: float | None = None) -> list[Embedding]:
        """Embeddings of `images`, in order. Raises InvalidArgument naming a bad image."""
        req = encode_request(images, min_pixels, max_pixels, max_chunk_bytes)
        dec = StreamDecoder(len(images))
        out: list[Embedding] = []
        try:
            for msg in self._stub.Encode(req, timeout=timeout or self.timeout):
                emb = dec.feed(msg)
                if emb is not None:
                    out.append(emb)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        dec.close()
        return out

    def describe(self, *, timeout: float | None = None) -> EncoderDescription:
        try:
            r = self._stub.Describe(encoder_pb2.DescribeRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return EncoderDescription.from_proto(r)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EncoderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEncoderClient:
    """asyncio client for one encoder node (grpc.aio)."""

    def __init__(self, target: str, *, timeout: float | None = None,
                 channel: grpc.aio.Channel | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = channel or grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    async def encode(self, images: Sequence[bytes], *, min_pixels: int = 0, max_pixels: int = 0,
                     max_chunk_bytes: int = 0, timeout: float | None = None) -> list[Embedding]:
        out: list[Embedding] = []
        async for emb in self.encode_iter(images, min_pixels=min_pixels, max_pixels=max_pixels,
                                          max_chunk_bytes=max_chunk_bytes, timeout=timeout):
            out.append(emb)
        return out

    async def encode_iter(self, images: Sequence[bytes], *, min_pixels: int = 0, max_pixels: int = 0,
                          max_chunk_bytes: int = 0, timeout: float | None = None):
        """Yield each image's embedding as soon as its last chunk arrives."""
        req = encode_request(images, min_pixels, max_pixels, max_chunk_bytes)
        dec = StreamDecoder(len(images))
        call = self._stub.Encode(req, timeout=timeout or self.timeout)
        try:
            async for msg in call:
                emb = dec.feed(msg)
                if emb is not None:
                    yield emb
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()
        dec.close()

    async def describe(self, *, timeout: float | None = None) -> EncoderDescription:
        try:
            r = await self._stub.Describe(encoder_pb2.DescribeRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return EncoderDescription.from_proto(r)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncEncoderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
