"""Bad inputs get INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the image and the reason,
and the node stays healthy and serving right after each one."""

from __future__ import annotations

import contextlib
import re
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis.client import EncoderClient, InvalidArgument, ResourceExhausted, Unavailable
from encdis.client.errors import IMAGE_INVALID, FieldViolation
from encdis.encoder_node.settings import EncoderSettings
from tests import encoder_images as images
from tests.encoder_inproc import InProcessEncoder
from tests.holds import held

MAX_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def node(tiny_ckpt):
    settings = EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, max_images_per_request=4,
                               max_image_bytes=MAX_BYTES)
    with InProcessEncoder(settings) as n:
        yield n


@pytest.fixture(scope="module")
def client(node):
    with EncoderClient(node.address, timeout=60) as c:
        yield c


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def forwards_held(n: InProcessEncoder) -> contextlib.AbstractContextManager[threading.Event]:
    """Inside the block the node's tower forwards wait, so what was admitted stays queued and its
    call stays in flight for as long as the test needs; the event is set once a forward waits."""
    return held(n.node.model.batcher, "_forward")


GOOD = images.rgb_jpeg(64, 48)

BAD = {
    "corrupt": (images.rgb_jpeg()[:600] + b"\x00garbage" * 40, InvalidArgument, "cannot decode|corrupt|unreadable"),
    "random_bytes": (bytes(range(256)) * 8, InvalidArgument, "unsupported or corrupt"),
    "empty": (b"", InvalidArgument, "empty"),
    "unsupported_format": (images.encode(images._noise(32, 32, 0), "PPM"), InvalidArgument, "unsupported"),
    "claims_100000x100000": (images.png_claiming(100000, 100000), InvalidArgument, "pixels"),
    "too_many_bytes": (images.rgb_jpeg() + b"\0" * MAX_BYTES, InvalidArgument, f"exceeds the limit of {MAX_BYTES}"),
    "aspect_ratio_201": (images.encode(images._noise(4020, 20, 1), "PNG"), InvalidArgument, "aspect ratio 201"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_names_its_index_and_reason_and_the_node_keeps_serving(case, node, client):
    data, error, reason = BAD[case]
    with pytest.raises(error) as info:
        client.encode([GOOD, data, GOOD])
    assert re.match(rf"image 1: .*({reason})", info.value.message), info.value.message
    assert info.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    # The same, as data: gRPC's rich error details (ErrorInfo + BadRequest), no text to parse.
    assert (info.value.reason, info.value.image_index) == (IMAGE_INVALID, 1)
    assert info.value.violations == (FieldViolation("images[1]", info.value.message.removeprefix("image 1: ")),)
    assert _health(node.address) == health_pb2.HealthCheckResponse.SERVING
    (emb,) = client.encode([GOOD])
    assert emb.shape[0] > 0
    assert node.node.model.batcher.queued_patches == 0  # nothing of the failed call stays queued


def test_too_many_images_is_resource_exhausted_naming_the_first_one_over(node, client):
    with pytest.raises(ResourceExhausted, match=r"image 4: the request has 5 images, the limit is 4") as info:
        client.encode([GOOD] * 5)
    assert (info.value.reason, info.value.metadata) == ("TOO_MANY_IMAGES", {"limit": "4"})
    assert _health(node.address) == health_pb2.HealthCheckResponse.SERVING
    assert len(client.encode([GOOD] * 4)) == 4


def test_header_pixels_are_checked_before_decoding(tiny_ckpt):
    """A valid image over --max-image-pixels is refused from its header, with its size."""
    settings = EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, max_image_pixels=100 * 100)
    with InProcessEncoder(settings) as n, EncoderClient(n.address, timeout=60) as c:
        with pytest.raises(InvalidArgument, match=r"image 0: 320x240 = 76800 pixels exceeds the limit of 10000"):
            c.encode([images.rgb_jpeg()])
        assert len(c.encode([images.rgb_jpeg(100, 100)])) == 1


@pytest.mark.parametrize("kwargs, match", [
    ({"max_pixels": 10 * 28 * 28 * 256}, "max_pixels .* outside"),
    ({"min_pixels": 100}, "min_pixels 100 is outside"),
    ({"min_pixels": 28 * 28 * 100, "max_pixels": 28 * 28 * 50}, "above max_pixels"),
])
def test_resize_bounds_outside_the_nodes_are_invalid_argument(kwargs, match, client):
    with pytest.raises(InvalidArgument, match=match):
        client.encode([GOOD], **kwargs)


def test_a_node_may_widen_the_resize_bounds_but_not_exclude_the_checkpoints(tiny_ckpt):
    from encdis.encoder_node.preprocess import ImagePreprocessor

    wide = ImagePreprocessor(tiny_ckpt, weights_fingerprint="fp", max_image_bytes=1 << 20, max_image_pixels=1 << 24,
                             max_pixels=28 * 28 * 1024)
    assert wide.resolve_bounds(0, 0) == (56 * 56, 28 * 28 * 256)
    assert wide.resolve_bounds(0, 28 * 28 * 1024) == (56 * 56, 28 * 28 * 1024)
    with pytest.raises(ValueError, match="must contain the checkpoint's"):
        ImagePreprocessor(tiny_ckpt, weights_fingerprint="fp", max_image_bytes=1 << 20, max_image_pixels=1 << 24,
                          max_pixels=28 * 28 * 128)


def test_tiny_chunk_size_is_invalid_argument(client):
    with pytest.raises(InvalidArgument, match="max_chunk_bytes 100 is below the minimum"):
        client.encode([GOOD], max_chunk_bytes=100)


def test_empty_request_is_invalid_argument(client):
    with pytest.raises(InvalidArgument, match="no images"):
        client.encode([])


def test_a_full_queue_is_resource_exhausted(tiny_ckpt):
    """Beyond --max-queued-patches a call is refused (while others are queued), not queued forever."""
    settings = EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, max_queued_patches=2048,
                               cache_bytes=0)  # six identical images: a cache would forward one
    big = images.near_max_pixels()  # 1024 patches
    with InProcessEncoder(settings) as n, EncoderClient(n.address, timeout=120) as c:
        results: list[object] = []
        with forwards_held(n) as forwarding:
            first = threading.Thread(target=lambda: results.append(c.encode([big] * 6)))
            first.start()
            assert forwarding.wait(60), "the first call never reached the tower"
            assert n.node.model.batcher.queued_patches == 6 * 1024  # held in the tower: still queued
            with pytest.raises(ResourceExhausted, match="queue is full"):
                c.encode([big])
        first.join(120)
        assert len(results[0]) == 6
        assert n.node.model.batcher.queued_patches == 0


def test_draining_node_refuses_new_calls_with_unavailable(tiny_ckpt):
    with InProcessEncoder(EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0)) as n:
        with EncoderClient(n.address, timeout=60) as c:
            n.node.servicer.start_draining()
            with pytest.raises(Unavailable, match="draining"):
                c.encode([GOOD])


def test_calls_beyond_max_concurrent_rpcs_are_resource_exhausted(tiny_ckpt):
    settings = EncoderSettings(model=tiny_ckpt, host="127.0.0.1", port=0, max_concurrent_rpcs=1)
    big = images.near_max_pixels()
    with InProcessEncoder(settings) as n, EncoderClient(n.address, timeout=120) as c:
        results: list[object] = []
        with forwards_held(n) as forwarding:
            first = threading.Thread(target=lambda: results.append(c.encode([big] * 8)))
            first.start()
            assert forwarding.wait(60), "the first call never reached the tower"
            assert n.node.servicer.inflight == 1  # held in the tower: still in progress
            with pytest.raises(ResourceExhausted, match="1 Encode calls in progress, the limit is 1"):
                c.encode([GOOD])
            assert c.describe().weights_fingerprint  # nor is Describe
            assert _health(n.address) == health_pb2.HealthCheckResponse.SERVING  # probes are not limited
        first.join(120)
        assert len(results[0]) == 8
        assert len(c.encode([GOOD])) == 1  # the limit frees up with the call
