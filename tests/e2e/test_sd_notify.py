"""A real encoder node as its supervisors see it: systemd's notify protocol, and the Prometheus
gauge the Kubernetes HPA scales on.

systemd (Type=notify, NotifyAccess=main) listens on a datagram socket named by NOTIFY_SOCKET and
believes only the unit's main process; here the test owns that socket and checks the sender's
pid the same way (SCM_CREDENTIALS).
"""

from __future__ import annotations

import io
import os
import random
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from encdis.client.encoder_client import EncoderClient
from encdis.client.pb import encoder_pb2
from encdis.launcher import NodeProcess

ENCODER_SERVICE = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name
HPA_METRIC = "encdis_encoder_queued_patches"
PATCH = 14  # pixels per patch side in Qwen2.5-VL


class NotifySocket:
    """The supervisor's end: a bound AF_UNIX datagram socket that records (pid, message)."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="encdis-sdn-")  # short: sun_path holds 108 bytes
        self.path = os.path.join(self._dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)

    def receive(self, timeout: float) -> tuple[int, str]:
        """The next datagram and its sender's pid (from the kernel, not the message)."""
        self.sock.settimeout(timeout)
        data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
        pid = next(struct.unpack("3i", d)[0] for level, kind, d in ancdata
                   if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
        return pid, data.decode()

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def png(width: int, height: int, seed: int) -> bytes:
    img = Image.frombytes("RGB", (width, height), random.Random(seed).randbytes(width * height * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def notify_socket() -> Iterator[NotifySocket]:
    s = NotifySocket()
    yield s
    s.close()


@pytest.fixture(scope="module")
def node(tiny_ckpt: Path, notify_socket: NotifySocket) -> Iterator[tuple[NodeProcess, int, str]]:
    """The encoder node, started with NOTIFY_SOCKET; yields it with the first notification."""
    proc = NodeProcess(["encoder", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                        "--metrics-port", "0", "--drain-grace-seconds", "20"],
                       env={"NOTIFY_SOCKET": notify_socket.path})
    try:
        try:
            pid, message = notify_socket.receive(timeout=240)
        except TimeoutError:
            pytest.fail(f"no notification from the node within 240 s; log tail:\n{proc.log_tail()}")
        # The ready line precedes READY=1 on stdout; it gives the ports.
        proc.wait_ready(30)
        yield proc, pid, message
    finally:
        proc.stop()


def test_ready_is_sent_by_the_main_process_once_it_serves(node: tuple[NodeProcess, int, str]) -> None:
    proc, pid, message = node
    assert message.splitlines() == ["READY=1"]
    assert pid == proc.pid  # NotifyAccess=main would drop it otherwise
    # When systemd hears READY=1 the node already serves: no retries, no waiting here.
    assert health(proc.address, ENCODER_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    assert health(proc.address, "") == health_pb2.HealthCheckResponse.SERVING
    with EncoderClient(proc.address, timeout=60) as client:
        [emb] = client.encode([png(56, 84, seed=1)])
    assert tuple(emb.grid_thw) == (1, 84 // PATCH, 56 // PATCH)


def test_queued_patches_rise_under_load_and_return_to_zero(node: tuple[NodeProcess, int, str]) -> None:
    """The HPA's signal: patches accepted but not finished, 0 when idle."""
    proc, _, _ = node
    assert proc.metrics_port
    assert proc.metric(HPA_METRIC) == 0
    side = 28 * 16  # 448 px: 32 x 32 = 1024 patches, the tiny checkpoint's max_pixels
    images = [png(side, side, seed=i) for i in range(4)]
    calls = 12
    total = calls * len(images) * (side // PATCH) ** 2

    seen: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.append(proc.metric(HPA_METRIC))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with EncoderClient(proc.address, timeout=120) as client, ThreadPoolExecutor(calls) as pool:
        results = list(pool.map(lambda _: client.encode(images), range(calls)))
    stop.set()
    poller.join(10)
    assert all(len(r) == len(images) for r in results)
    assert max(seen) > 0, "the gauge never rose while calls were queued"
    assert max(seen) <= total
    assert all(v == int(v) and v >= 0 for v in seen)
    deadline = time.monotonic() + 10
    while proc.metric(HPA_METRIC) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.metric(HPA_METRIC) == 0, "the gauge did not return to 0 when idle"


def test_stopping_is_sent_on_sigterm_and_the_node_exits_cleanly(
        node: tuple[NodeProcess, int, str], notify_socket: NotifySocket) -> None:
    proc, _, _ = node
    proc.terminate()
    pid, message = notify_socket.receive(timeout=20)
    assert message.splitlines() == ["STOPPING=1"]
    assert pid == proc.pid
    assert proc.wait(timeout=30) == 0  # drained and exited well inside the drain grace
    with pytest.raises(TimeoutError):  # nothing after STOPPING=1 (no second READY=1)
        notify_socket.receive(timeout=0.5)
