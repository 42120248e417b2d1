"""A dead engine is a dead node, and the node's engine processes never outlive it.

Real LLM nodes (vLLM on CPU). One test kills vLLM's EngineCore process under a node: the
node must answer health NOT_SERVING within a second and exit non-zero, leaving no engine
process. The other kills the node itself with SIGKILL: its engine processes must go too.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdis.launcher import NodeProcess, start_node
from encdis.llm_node.server import ENGINE_DEAD_EXIT_CODE

pytestmark = pytest.mark.vllm


def start_llm(ckpt: Path) -> NodeProcess:
    return start_node(["llm", "--model", str(ckpt), "--host", "127.0.0.1", "--port", "0"], timeout=600)


def engine_processes(node: NodeProcess) -> list[psutil.Process]:
    return [p for p in psutil.Process(node.pid).children(recursive=True)
            if p.name().startswith("VLLM::") or "multiprocessing" in " ".join(p.cmdline())]


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            continue
    return alive


def health(address: str) -> int | None:
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return None  # not answering (stopped)


def test_engine_death_turns_health_not_serving_at_once_and_the_node_exits_non_zero(tiny_ckpt: Path) -> None:
    node = start_llm(tiny_ckpt)
    try:
        engines = engine_processes(node)
        core = [p for p in engines if p.name() == "VLLM::EngineCore"]
        assert core, [p.name() for p in engines]
        assert health(node.address) == health_pb2.HealthCheckResponse.SERVING
        core[0].kill()
        killed = time.monotonic()
        status = health(node.address)
        while status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() - killed < 5:
            time.sleep(0.02)
            status = health(node.address)
        assert status != health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - killed < 1.0, "health still SERVING a second after the engine died"
        assert node.wait(60) == ENGINE_DEAD_EXIT_CODE
        gone, alive = psutil.wait_procs(running(engines), timeout=15)
        assert not alive, alive
    finally:
        node.stop()


def test_kill_9_of_the_node_leaves_no_engine_process(tiny_ckpt: Path) -> None:
    node = start_llm(tiny_ckpt)
    try:
        engines = engine_processes(node)
        assert any(p.name() == "VLLM::EngineCore" for p in engines), [p.name() for p in engines]
        os.kill(node.pid, signal.SIGKILL)  # the node only: not its process group
        node.wait(10)
        _, alive = psutil.wait_procs(running(engines), timeout=30)
        assert not alive, f"engine processes outlived the node: {alive}"
    finally:
        node.stop()
