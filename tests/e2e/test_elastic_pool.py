"""The encoder pool grows and shrinks under load without losing a request.

What Kubernetes does to an LLM node (a headless Service whose A records follow the ready
encoder pods; SIGTERM to a pod being scaled down), replayed with real processes on loopback:

- the test's own DNS server answers for the encoder name with 127.0.0.x addresses; every
  encoder listens on its own loopback address and the same port (DNS gives addresses, the
  port is part of the `--encoders NAME:PORT` target);
- requests flow continuously through an LLM node started with `--encoders NAME:PORT
  --dns-server`; the embedding cache is off, so every image of every request reaches an
  encoder;
- the test adds two encoders to the name (they must get work within seconds), then sends
  SIGTERM to one of them while it is still in DNS (it must get no work once it is
  NOT_SERVING, and drain cleanly), then removes it from DNS.

No request may fail, and every output must equal the monolithic model's.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis.client import GenerateClient
from encdis.launcher import NodeProcess
from tests.dns_server import LoopbackDNS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

DNS_NAME = "encoders.encdis.test"
ENCODER_SERVICE = "encdis.encoder.v1.EncoderService"
ENCODER_IPS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
DNS_REFRESH_SECONDS = 0.5
JOIN_WITHIN_SECONDS = 5.0  # DNS refresh + connect + health + the next request with images
LEAVE_WITHIN_SECONDS = 30.0  # from the end of the load: several refreshes, each lookup bounded by 2 s
DRAIN_GRACE_SECONDS = 20
# Requests with several images of different sizes, so each one spreads over the encoders.
LOAD_CASES = ("three_images", "c6_four", "three_images_reordered", "c3_small_large")
CLIENTS = 2


def free_port_on_all(ips: tuple[str, ...]) -> int:
    """A TCP port free on every one of `ips` (each encoder binds its own loopback address)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = s.getsockname()[1]
        try:
            for ip in ips:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {ips}")


def images_encoded(node: NodeProcess) -> float:
    return node.metric("encdis_encoder_images_total")


@dataclass
class Load:
    """Clients sending requests back to back; every outcome is kept with its finish time."""

    address: str
    cases: list
    done: list[tuple[float, str, list[int]]] = field(default_factory=list)
    failed: list[tuple[float, str, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, clients: int) -> None:
        for k in range(clients):
            t = threading.Thread(target=self._run, args=(k,), name=f"load-{k}", daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, k: int) -> None:
        with GenerateClient(self.address, timeout=180) as client:
            i = k
            while not self.stop.is_set():
                case = self.cases[i % len(self.cases)]
                i += 1
                try:
                    r = client.generate(case.prompt, case.images, max_tokens=case.max_tokens, ignore_eos=True)
                    self.done.append((time.monotonic(), case.name, r.token_ids))
                except Exception as e:  # every failure is a test failure, recorded
                    self.failed.append((time.monotonic(), case.name, repr(e)))

    def completed_after(self, t: float) -> int:
        return sum(1 for when, _, _ in self.done if when > t)

    def wait_completed_after(self, t: float, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.completed_after(t) < n:
            assert not self.failed, self.failed[:3]
            assert time.monotonic() < deadline, f"only {self.completed_after(t)} requests completed in {timeout}s"
            time.sleep(0.1)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


class HealthWatcher:
    """The test's own grpc.health.v1 Watch on one encoder: when it turned NOT_SERVING."""

    def __init__(self, address: str) -> None:
        self.not_serving_at: float | None = None
        self.seen_serving = threading.Event()
        self._channel = grpc.insecure_channel(address)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service=ENCODER_SERVICE))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for r in self._call:
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    self.seen_serving.set()
                elif self.not_serving_at is None and self.seen_serving.is_set():
                    self.not_serving_at = time.monotonic()
        except grpc.RpcError:
            pass  # the node went away
        if self.not_serving_at is None and self.seen_serving.is_set():
            self.not_serving_at = time.monotonic()

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()
        self._thread.join(5)


class CoordinatorView:
    """ListEncoders polled from the LLM node: (time, state, assigned_images) per encoder."""

    def __init__(self, llm_address: str, period: float = 0.05) -> None:
        self.samples: dict[str, list[tuple[float, str, int]]] = {}
        self._stop = threading.Event()
        self._client = GenerateClient(llm_address, timeout=10)
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                encoders = self._client.list_encoders()
            except Exception:  # the node is busy; sample again
                time.sleep(self._period)
                continue
            now = time.monotonic()
            for e in encoders:
                self.samples.setdefault(e.address, []).append((now, e.state, e.assigned_images))
            time.sleep(self._period)

    def first_assigned(self, address: str) -> float | None:
        """When this view first saw the coordinator assign `address` an image (None: not yet)."""
        return next((t for t, _, n in list(self.samples.get(address, ())) if n > 0), None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._client.close()


@pytest.fixture(scope="module")
def dns_server() -> Iterator[LoopbackDNS]:
    server = LoopbackDNS()
    yield server
    server.close()


@pytest.fixture(scope="module")
def pool(tiny_ckpt: Path, dns_server: LoopbackDNS) -> Iterator[tuple[NodeProcess, list[NodeProcess]]]:
    """Three encoders (127.0.0.1-3, one port) and an LLM node that knows them only by DNS name."""
    port = free_port_on_all(ENCODER_IPS)
    dns_server.set_addresses(DNS_NAME, [ENCODER_IPS[0]])
    started: list[NodeProcess] = []
    try:
        # Started together (the machine loads them while vLLM starts); only the first is in DNS.
        # --cache-bytes 0: the load repeats its images, and images_total must count work the encoders did.
        encoders = [NodeProcess(["encoder", "--model", str(tiny_ckpt), "--host", ip, "--port", str(port),
                                 "--metrics-port", "0", "--drain-grace-seconds", str(DRAIN_GRACE_SECONDS),
                                 "--cache-bytes", "0"],
                                host=ip)
                    for ip in ENCODER_IPS]
        started += encoders
        llm = NodeProcess(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                           "--metrics-port", "0", "--encoders", f"{DNS_NAME}:{port}",
                           "--dns-server", dns_server.address,
                           "--dns-refresh-seconds", str(DNS_REFRESH_SECONDS), "--cache-bytes", "0"])
        started.append(llm)
        for node in encoders:
            node.wait_ready(300)
        llm.wait_ready(900)
        yield llm, encoders
    finally:
        for node in started:
            node.stop()


def test_pool_grows_and_shrinks_under_load_without_failures(monolithic, equality_cases, pool,
                                                            dns_server: LoopbackDNS) -> None:
    # (monolithic first: the reference engine runs before this test's nodes load the machine)
    llm, (first, added_a, added_b) = pool
    cases = [equality_cases[name] for name in LOAD_CASES]
    load = Load(llm.address, cases)
    view = CoordinatorView(llm.address)
    try:
        # Phase 1: one encoder in DNS; the others are up but unknown to the LLM node.
        load.start(CLIENTS)
        load.wait_completed_after(0, 3, timeout=300)
        assert images_encoded(first) > 0
        assert images_encoded(added_a) == images_encoded(added_b) == 0
        with GenerateClient(llm.address, timeout=10) as client:
            assert [e.address for e in client.list_encoders()] == [first.address]

        # Phase 2: two encoders join the name; they get work within seconds. "Get work" is the
        # coordinator assigning them an image (as the view sees it), not their first call
        # finishing, which would add that call's run time to the measure.
        appeared = time.monotonic()
        dns_server.set_addresses(DNS_NAME, list(ENCODER_IPS))
        joined: dict[str, float] = {}
        while len(joined) < 2 and time.monotonic() - appeared < 60:
            for node in (added_a, added_b):
                assigned_at = view.first_assigned(node.address)
                if node.address not in joined and assigned_at is not None:
                    joined[node.address] = assigned_at - appeared
            time.sleep(0.05)
        assert set(joined) == {added_a.address, added_b.address}, f"encoders never got work: {joined}"
        assert max(joined.values()) < JOIN_WITHIN_SECONDS, f"seconds from DNS to first work: {joined}"
        # ... and they did that work.
        deadline = time.monotonic() + 60
        while not (images_encoded(added_a) > 0 and images_encoded(added_b) > 0):
            assert time.monotonic() < deadline, "an added encoder was assigned images but never encoded one"
            time.sleep(0.05)
        load.wait_completed_after(time.monotonic(), 4, timeout=120)

        # Phase 3: SIGTERM one of them while it is still in DNS: it drains, gets nothing new.
        watcher = HealthWatcher(added_a.address)
        assert watcher.seen_serving.wait(10)
        before_drain = images_encoded(added_a)
        added_a.terminate()
        assert added_a.wait(timeout=DRAIN_GRACE_SECONDS + 30) == 0, added_a.log_tail()
        watcher.close()
        assert watcher.not_serving_at is not None
        drained_at = time.monotonic()
        # Kubernetes removes a terminating pod from the Service; here after it has exited.
        dns_server.set_addresses(DNS_NAME, [ENCODER_IPS[0], ENCODER_IPS[2]])
        still = [images_encoded(first), images_encoded(added_b)]
        load.wait_completed_after(drained_at, 6, timeout=120)
        # The remaining encoders carried the load.
        assert images_encoded(first) + images_encoded(added_b) > sum(still)
        assert before_drain > 0
    finally:
        load.finish()
        view.close()

    # No request failed, and every answer is the monolithic model's.
    assert not load.failed, f"{len(load.failed)} failed requests, e.g. {load.failed[:3]}"
    assert len(load.done) >= 13
    wrong = [(name, ids) for _, name, ids in load.done if ids != monolithic[name]]
    assert not wrong, f"{len(wrong)} of {len(load.done)} outputs differ from monolithic, e.g. {wrong[:2]}"

    # The draining encoder was sent nothing once NOT_SERVING: it refused no call (a call
    # arriving while draining is refused with UNAVAILABLE and logged), and the coordinator
    # assigned it no image after it saw the drain.
    log = added_a.log_path.read_text(errors="replace")
    refused = [line for line in log.splitlines() if "Encode -> UNAVAILABLE" in line or "is draining" in line]
    assert not refused, refused[:3]
    samples = view.samples[added_a.address]
    # From the coordinator's last "serving" view of it on (earlier non-serving samples are from
    # before it first served: connecting, with nothing assigned yet).
    last_serving = max((i for i, (_, state, _) in enumerate(samples) if state == "serving"), default=-1)
    noticed = [(t, n) for t, _, n in samples[last_serving + 1:]]
    assert last_serving >= 0 and noticed, f"the coordinator never saw {added_a.address} leave: {samples[-5:]}"
    assert samples[last_serving][0] <= watcher.not_serving_at + 1, "the coordinator saw the drain late"
    assert len({n for _, n in noticed}) == 1, f"assigned after draining: {noticed}"
    print(f"elastic pool: {len(load.done)} requests, 0 failed; first work on the added encoders "
          f"{', '.join(f'{a} {s:.2f}s' for a, s in joined.items())} after DNS; drain of {added_a.address}: "
          f"{samples[-1][2]} images assigned before NOT_SERVING, none after")
    # ... and it left the pool once it left DNS: at the next refresh whose lookup answers (a lookup
    # that times out keeps the addresses it had; this test's DNS server is a thread of this busy
    # process), not within the few requests above, which may take less than a lookup's timeout.
    deadline = time.monotonic() + LEAVE_WITHIN_SECONDS
    with GenerateClient(llm.address, timeout=10) as client:
        while added_a.address in (final := {e.address: e.state for e in client.list_encoders()}):
            assert time.monotonic() < deadline, f"still in the pool {LEAVE_WITHIN_SECONDS}s on: {final}"
            time.sleep(DNS_REFRESH_SECONDS)
    assert final == {first.address: "serving", added_b.address: "serving"}
