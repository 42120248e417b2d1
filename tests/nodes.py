"""Start encdis nodes as real subprocesses and wait until they say they are ready.

    with start_node(["encoder", "--model", str(ckpt), "--port", "0"]) as node:
        EncoderClient(node.address).describe()

A node is ready when it prints `encdis ready {json}` (its real ports) on stdout. Output is
kept in a log file whose tail is shown if the node fails to start. Nodes always die with
the test: terminate on exit, kill if they do not stop in time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

READY_PREFIX = "encdis ready "


class NodeProcess:
    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, host: str = "127.0.0.1") -> None:
        self.args = list(args)
        self.host = host
        self.log_path = Path(tempfile.mkstemp(prefix=f"encdis-{args[0]}-", suffix=".log")[1])
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in wait()/stop
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "encdis.cli", *self.args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=full_env,
            text=True,
            start_new_session=True,  # its own process group: kill the node and its children
        )
        self.info: dict | None = None
        self.stdout_lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            self._log.write(line)
            self._log.flush()
            if line.startswith(READY_PREFIX) and self.info is None:
                self.info = json.loads(line[len(READY_PREFIX):])
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> NodeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ready.wait(0.2):
                break
        if self.info is None:
            self.kill()
            raise RuntimeError(
                f"node {self.args[:1]} not ready after {timeout:.0f}s (exit {self.proc.poll()});"
                f" log tail:\n{self.log_tail()}"
            )
        return self

    def log_tail(self, n: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    @property
    def grpc_port(self) -> int:
        assert self.info is not None
        return int(self.info["grpc_port"])

    @property
    def metrics_port(self) -> int | None:
        assert self.info is not None
        return self.info.get("metrics_port")

    def metric(self, name: str) -> float:
        """A label-less sample from the node's Prometheus endpoint; fails if it is not exported."""
        url = f"http://{self.host}:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} is not exported by {self.args[0]} node {self.address}"
        return float(m.group(1))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the node and everything in its process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL; the exit code (None if killed)."""
        self.terminate()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        try:  # children of the node (e.g. vLLM's engine core) must not outlive it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reader.join(5)
        self._log.close()
        return rc

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_node(args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 300,
               host: str = "127.0.0.1") -> NodeProcess:
    """Run `encdis <args>` and return once it printed its ready line (or raise with its log)."""
    return NodeProcess(args, env=env, host=host).wait_ready(timeout)
