"""The README's quick start, `encdis demo`, runs as a user would run it.

The real command in a subprocess: it must print an answer for every request, each
request's time split and the encoders' shares of patches, exit 0, and leave no process
behind (nodes and vLLM's engine processes). Ctrl-C while the LLM node is starting must
also stop everything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from encdis.llm_node.demo import RANDOM_WEIGHTS_NOTE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def start_demo(model: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "encdis.cli", "demo", "--model", str(model), "--max-tokens", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def llm_node_spawned_vllm(demo_pid: int) -> bool:
    """The demo's LLM node (`encdis.cli llm`) has a child: vLLM is starting its engine."""
    for p in descendants(demo_pid):
        try:
            if "encdis.cli" in p.cmdline() and "llm" in p.cmdline() and p.children():
                return True
        except psutil.Error:  # it exited between the listing and the look
            continue
    return False


def assert_all_gone(procs: list[psutil.Process], timeout: float = 30) -> None:
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, ' '.join(p.cmdline())[:120]) for p in alive]}"


def test_demo_prints_answers_and_exits_cleanly(tiny_ckpt: Path):
    proc = start_demo(tiny_ckpt)
    seen: list[psutil.Process] = []
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("LLM node ready"):
            seen = descendants(proc.pid)  # nodes and vLLM's engine processes, while all are up
    rc = proc.wait(60)
    out = "".join(lines)
    assert rc == 0, out[-4000:]
    assert len(seen) >= 4, out  # two encoders, the LLM node, vLLM's engine core at least
    assert out.count("    answer: ") == 4
    assert RANDOM_WEIGHTS_NOTE in out  # says plainly that the answers are noise by design
    assert out.count("    time split (ms): queue ") == 4
    assert out.count("% of patches)") == 2
    assert "all nodes stopped" in out
    assert_all_gone(seen)


def test_demo_ctrl_c_while_llm_node_starts_leaves_no_process(tiny_ckpt: Path):
    proc = start_demo(tiny_ckpt)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("starting the LLM node"):
            break
    deadline = time.monotonic() + 300
    while not llm_node_spawned_vllm(proc.pid):  # the LLM node is loading vLLM now
        assert proc.poll() is None and time.monotonic() < deadline, "the LLM node never started vLLM"
        time.sleep(0.1)
    seen = descendants(proc.pid)
    assert len(seen) >= 3
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(120)
    out = proc.stdout.read()
    assert rc == 130, out
    assert "LLM node ready" not in out  # the interrupt came while it was starting
    assert "all nodes stopped" in out
    assert_all_gone(seen + descendants(proc.pid))
