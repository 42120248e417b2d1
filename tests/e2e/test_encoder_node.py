"""`encdis encoder` as a real process: ready line, health, `encdis encode`, metrics, SIGTERM drain."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis.client import EncoderClient, Unavailable
from encdis.client.channels import CHANNEL_OPTIONS
from encdis.client.encoder_client import encode_request
from encdis.client.pb import encoder_pb2_grpc
from encdis.client.wire import Embedding, StreamDecoder
from encdis.launcher import start_node
from tests import encoder_images as images


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class HeldCall:
    """An Encode call the node cannot finish until `release()`.

    This client reads the first message and then stops; with HTTP/2 BDP probing off, its
    receive window stays at 64 KiB, far below the call's embeddings, so the node's reply stream
    waits on flow control with the call in flight.
    """

    def __init__(self, address: str, data: list[bytes]) -> None:
        self._channel = grpc.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("grpc.http2.bdp_probe", 0)])
        self._call = encoder_pb2_grpc.EncoderServiceStub(self._channel).Encode(encode_request(data), timeout=180)
        self._decoder = StreamDecoder(len(data))
        self._out = [e for e in [self._decoder.feed(next(self._call))] if e is not None]

    def release(self) -> list[Embedding]:
        """Read the rest of the stream: every embedding of the call."""
        try:
            for msg in self._call:
                emb = self._decoder.feed(msg)
                if emb is not None:
                    self._out.append(emb)
            self._decoder.close()
            return self._out
        finally:
            self._channel.close()


@pytest.fixture(scope="module")
def encoder(tiny_ckpt):
    # --cache-bytes 0: the load and drain tests repeat one image and need each copy to be real work.
    node = start_node(["encoder", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0", "--drain-grace-seconds", "60", "--cache-bytes", "0"], timeout=180)
    yield node
    node.stop()


def test_ready_line_health_and_encode_command(encoder, tmp_path):
    assert encoder.info["role"] == "encoder" and encoder.grpc_port > 0 and encoder.metrics_port > 0
    assert _health(encoder.address) == health_pb2.HealthCheckResponse.SERVING
    files = []
    for name, data in [("a.jpg", images.rgb_jpeg()), ("b.png", images.rgba_png())]:
        (tmp_path / name).write_bytes(data)
        files.append(str(tmp_path / name))
    out = tmp_path / "embeds.safetensors"
    r = subprocess.run([sys.executable, "-m", "encdis.cli", "encode", "--server", encoder.address, "--out", str(out),
                        *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    from safetensors.numpy import load_file

    saved = load_file(str(out))
    with EncoderClient(encoder.address, timeout=60) as c:
        direct = c.encode([open(f, "rb").read() for f in files])
    for i, e in enumerate(direct):
        np.testing.assert_array_equal(saved[f"embeds.{i}"], e.array())
        assert saved[f"grid_thw.{i}"].tolist() == list(e.grid_thw)


def test_encode_command_reports_a_bad_image(encoder, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    r = subprocess.run([sys.executable, "-m", "encdis.cli", "encode", "--server", encoder.address,
                        "--out", str(tmp_path / "x.safetensors"), str(bad)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "INVALID_ARGUMENT: image 0:" in r.stderr


def test_a_node_that_cannot_load_its_model_exits_1_and_says_why(tmp_path):
    r = subprocess.run([sys.executable, "-m", "encdis.cli", "encoder", "--model", str(tmp_path / "missing"),
                        "--host", "127.0.0.1", "--port", "0"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 1
    assert "failed to start" in r.stderr and "config.json not found" in r.stderr
    assert "encdis ready" not in r.stdout


def test_queued_patches_rise_under_load_and_return_to_zero(encoder):
    big = [images.near_max_pixels()] * 8
    seen: list[float] = []
    with EncoderClient(encoder.address, timeout=120) as c:
        t = threading.Thread(target=c.encode, args=(big,))
        t.start()
        while t.is_alive():
            seen.append(encoder.metric("encdis_encoder_queued_patches"))
        t.join()
    assert max(seen) > 0
    assert encoder.metric("encdis_encoder_queued_patches") == 0
    assert encoder.metric("encdis_encoder_patches_total") >= 8 * 1024


def _refuses_new_call(address: str) -> bool:
    with EncoderClient(address, timeout=30) as c:
        try:
            c.encode([images.smallest()])
        except Unavailable as e:
            assert "draining" in e.message
            return True
    return False


def test_sigterm_drains_in_flight_calls_refuses_new_ones_and_exits_0(encoder):
    """Runs last in this module: it stops the shared node."""
    big = [images.near_max_pixels()] * 8  # 8 x 1024 patches per call: seconds of work on 2 CPUs
    results: list[object] = []

    def call() -> None:
        with EncoderClient(encoder.address, timeout=180) as c:
            try:
                results.append(c.encode(big))
            except Exception as e:  # reported by the assertion below
                results.append(e)

    # One call that surely outlasts the checks below (it cannot finish before it is released),
    # beside four that finish by themselves during the drain.
    held = HeldCall(encoder.address, big)
    callers = [threading.Thread(target=call) for _ in range(4)]
    for t in callers:
        t.start()
    _wait_for(lambda: encoder.metric("encdis_encoder_inflight_requests") == 5, 60, "5 calls in flight")
    encoder.terminate()  # SIGTERM
    _wait_for(lambda: _health(encoder.address) == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
    # Calls are still accepted for --drain-accept-seconds after NOT_SERVING, then refused.
    _wait_for(lambda: _refuses_new_call(encoder.address), 30, "new calls refused as draining")
    assert encoder.proc.poll() is None  # still finishing the calls in flight (the held one at least)
    for t in callers:
        t.join(180)
    assert all(isinstance(r, list) and len(r) == 8 for r in results), results
    assert encoder.proc.poll() is None  # the held call is still in flight: the drain waits for it
    assert len(held.release()) == 8
    assert encoder.wait(60) == 0
