"""A real Prometheus scrapes a real encoder node pool and a real LLM node, and evaluates
deploy/prometheus/encdis-rules.yml (alerts' `for:` shortened to seconds).

The LLM node is this module's own: its pool is the session's two encoder nodes and a
FakeEncoder (tests/fake_encoder.py: a real gRPC EncoderService scripted to send rows of the
wrong size), which the coordinator quarantines for 5 minutes on its first image. Checked:
every target is up; every recording rule and every dashboard expression returns a series
from these live nodes, and every metric name they read exists; each alert's signal (its
expression without the threshold) returns a series; the quarantine alert fires; under load
the HPA's queued-patches recording rule rises above 0 and falls back to 0.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from encdis.client import EncoderClient, GenerateClient
from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.demo import synthetic_photo
from tests.e2e.conftest import encoders_by_address, wait_until
from tests.fake_encoder import FakeEncoderThread
from tests.monitoring import alert_rules, dashboard_exprs, names_in, recording_rules, rules, with_for
from tests.needs import require_tool
from tests.prometheus_server import PrometheusServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

ALERT_FOR_SECONDS = 3.0
QUARANTINE_SECONDS = 300.0
# An alert's expression is its signal compared with a threshold; the signal must exist.
_THRESHOLD = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.e+]+\s*$")


@dataclass
class Rig:
    prom: PrometheusServer
    llm: NodeProcess
    encoders: list[NodeProcess]
    fake: FakeEncoderThread


@pytest.fixture(scope="module")
def rig(tiny_ckpt: Path, encoder_nodes: list[NodeProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    binary = require_tool("prometheus", "apt-get install prometheus")
    fake = FakeEncoderThread(tiny_ckpt)
    fake.fake.rows_delta = 4  # a self-consistent stream of the wrong size: quarantined
    llm = None
    try:
        llm = start_node(["llm", "--model", str(tiny_ckpt), "--host", "127.0.0.1", "--port", "0",
                          "--metrics-port", "0",
                          "--quarantine-seconds", str(QUARANTINE_SECONDS),
                          "--quarantine-max-seconds", str(QUARANTINE_SECONDS),
                          "--encoders", ",".join([*(n.address for n in encoder_nodes), fake.address])],
                         timeout=900)
        targets = {"encdis-encoder": [f"127.0.0.1:{n.metrics_port}" for n in encoder_nodes],
                   "encdis-llm": [f"127.0.0.1:{llm.metrics_port}"]}
        with PrometheusServer(binary, tmp_path_factory.mktemp("prometheus"), targets,
                              rules=with_for(rules(), ALERT_FOR_SECONDS)) as prom:
            yield Rig(prom, llm, encoder_nodes, fake)
    finally:
        if llm is not None:
            llm.stop()
        fake.stop()


@pytest.fixture(scope="module")
def quarantined(rig: Rig) -> float:
    """Requests of three images each (fresh ones, so no cache hit hides the fake) until the fake
    got one and was quarantined; then one repeated (cache hits). Returns when it was quarantined."""
    seed = 100
    images: list[bytes] = []
    with GenerateClient(rig.llm.address, timeout=120) as client:
        while encoders_by_address(rig.llm)[rig.fake.address].state != "quarantined":
            assert seed < 160, "the fake never got an image"
            images = [synthetic_photo(224, 168 + 28 * i, seed=seed + i) for i in range(3)]
            client.generate("Describe the pictures.", images, max_tokens=2)
            seed += 3
        at = time.monotonic()
        client.generate("Describe the pictures.", images, max_tokens=2)
    return at


def returns_series(prom: PrometheusServer, exprs: dict[str, str], timeout: float) -> dict[str, str]:
    """Those of `exprs` that still return no series after `timeout` seconds of polling."""
    missing = dict(exprs)
    deadline = time.monotonic() + timeout
    while missing and time.monotonic() < deadline:
        missing = {k: e for k, e in missing.items() if not prom.query(e)}
        time.sleep(1.0)
    return missing


def test_every_rule_and_dashboard_expression_returns_a_series_from_live_nodes(rig: Rig, quarantined: float) -> None:
    wait_until(lambda: {t["health"] for t in rig.prom.api("targets")["activeTargets"]} == {"up"}
               and len(rig.prom.api("targets")["activeTargets"]) == 3, 60, "all three targets up")

    recorded = {f"rule {k}": k for k in recording_rules()}
    panels = {f"dashboard {k}": e for k, e in dashboard_exprs().items()}
    signals = {}
    for name, rule in alert_rules().items():
        signal, n = _THRESHOLD.subn("", rule["expr"])
        assert n == 1, f"alert {name}: expected '<signal> <op> <threshold>', got {rule['expr']!r}"
        signals[f"alert {name}"] = signal
    missing = returns_series(rig.prom, {**recorded, **panels, **signals}, timeout=90)
    assert not missing, f"no series from the live nodes for {missing}\n{rig.prom.log_tail()}"

    exported = rig.prom.metric_names()  # what the nodes exported, and the rules recorded
    exprs = [*recording_rules().values(), *(r["expr"] for r in alert_rules().values()), *panels.values()]
    absent = set().union(*(names_in(e) for e in exprs)) - exported
    assert not absent, f"expressions read names Prometheus never got: {sorted(absent)}"
    # Every alert expression is valid PromQL as Prometheus evaluates it.
    for rule in alert_rules().values():
        rig.prom.query(rule["expr"])


def test_a_quarantined_encoder_fires_its_alert_within_the_for_window(rig: Rig, quarantined: float) -> None:

    def firing() -> list[dict]:
        return [a for a in rig.prom.alerts() if a["labels"]["alertname"] == "EncdisEncoderQuarantinedOrSlow"
                and a["state"] == "firing"]

    # Scrape (1 s) + evaluation (1 s) + for (3 s), with room for a loaded 2-core machine.
    wait_until(lambda: bool(firing()), 60, "EncdisEncoderQuarantinedOrSlow firing")
    [alert] = firing()
    assert alert["labels"]["state"] == "quarantined" and float(alert["value"]) == 1.0
    assert alert["labels"]["severity"] == "warning"
    assert time.monotonic() - quarantined < QUARANTINE_SECONDS  # it fired while the fake was still out
    assert encoders_by_address(rig.llm)[rig.fake.address].state == "quarantined"
    # The pool still serves: the no-encoder alert is not even pending.
    assert not [a for a in rig.prom.alerts() if a["labels"]["alertname"] == "EncdisNoEncoderServing"]


def test_queued_patches_recording_rule_rises_under_load_and_returns_to_zero(rig: Rig) -> None:
    rule = "max(encdis:encoder_queued_patches:avg1m)"

    def value() -> float:
        [sample] = rig.prom.query(rule)
        return float(sample["value"][1])

    wait_until(lambda: rig.prom.query(rule) != [], 30, "the recording rule evaluated")
    stop = threading.Event()

    def load(worker: int) -> int:
        calls = 0
        with EncoderClient(rig.encoders[worker % 2].address, timeout=120) as client:
            while not stop.is_set():
                # New images every call: the encoders' embedding caches would answer repeats
                # without queueing anything.
                seed = 100_000 + 1000 * worker + 4 * calls
                client.encode([synthetic_photo(448, 448, seed=seed + i) for i in range(4)])
                calls += 1
        return calls

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(load, worker) for worker in range(8)]
        try:
            wait_until(lambda: value() > 0, 60, "queued patches above 0 under load")
        finally:
            stop.set()
        assert all(f.result() > 0 for f in futures)
    # The minute's average forgets the load a minute after it ended.
    wait_until(lambda: value() == 0, 120, "queued patches back to 0 after the load")
    assert all(n.metric("encdis_encoder_queued_patches") == 0 for n in rig.encoders)
