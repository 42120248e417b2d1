"""Node launcher: run `encdis <command>` as a child process and wait until it is ready.

    with start_node(["encoder", "--model", str(ckpt), "--port", "0"]) as node:
        EncoderClient(node.address).describe()

Used by `encdis demo`, the benchmarks and the end-to-end tests. A node is ready when it
prints `encdis ready {json}` (its real ports) on stdout. Each node runs in its own session,
so stopping it kills its whole process group: vLLM's engine processes never outlive the
node, and a Ctrl-C in the parent's terminal reaches the parent only, which then stops its
nodes in order. A node's stdout and stderr go to a log file whose tail is shown if it
fails to start. Standard library only: the light client's users may launch nodes too.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# What a node prints on stdout once it serves (encdis.serving.announce_ready).
READY_PREFIX = "encdis ready "


class NodeProcess:
    """One `python -m encdis.cli <args>` child: started at construction, watched by a thread.

    `env` overrides this process's environment for the child. The log goes to
    `log_dir/<name>.log` when `log_dir` is given, else to a new temporary file. `wrapper` is a
    command the node runs under (it must exec or run the rest of its arguments, and pass
    signals on), such as `unshare -n --` for a network namespace of its own.
    """

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, host: str = "127.0.0.1",
                 name: str | None = None, log_dir: Path | None = None, wrapper: Sequence[str] = ()) -> None:
        self.args = list(args)
        self.host = host
        self.name = name or self.args[0]
        if log_dir is not None:
            self.log_path = Path(log_dir) / f"{self.name}.log"
        else:
            fd, path = tempfile.mkstemp(prefix=f"encdis-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)
        self._log = open(self.log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "encdis.cli", *self.args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            text=True,
            start_new_session=True,  # its own process group: stop() kills the node and its children
        )
        self.info: dict[str, Any] | None = None
        self.stdout_lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_stdout, name=f"{self.name}-stdout", daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            if not self._log.closed:
                self._log.write(line)
                self._log.flush()
            if line.startswith(READY_PREFIX) and self.info is None:
                self.info = json.loads(line[len(READY_PREFIX):])
                self._ready.set()
        self._ready.set()  # exited before (or after) its ready line

    def wait_ready(self, timeout: float) -> NodeProcess:
        """Return once the ready line is read; kill the node and raise with its log tail if it
        exits or takes longer than `timeout` seconds."""
        deadline = time.monotonic() + timeout
        # Short waits keep the main thread responsive to Ctrl-C / SIGTERM.
        while not self._ready.wait(0.2) and time.monotonic() < deadline:
            pass
        if self.info is None:
            self.kill()
            raise RuntimeError(f"node {self.name} not ready after {timeout:.0f}s (exit {self.proc.poll()}); "
                               f"log {self.log_path}, tail:\n{self.log_tail()}")
        return self

    def log_tail(self, n: int = 60) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    @property
    def grpc_port(self) -> int:
        assert self.info is not None, f"node {self.name} is not ready"
        return int(self.info["grpc_port"])

    @property
    def metrics_port(self) -> int | None:
        assert self.info is not None, f"node {self.name} is not ready"
        return self.info.get("metrics_port")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metric(self, name: str) -> float:
        """A label-less sample from the node's Prometheus endpoint; fails if it is not exported."""
        url = f"http://{self.host}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} is not exported by {self.name} node {self.address}"
        return float(m.group(1))

    def terminate(self) -> None:
        """SIGTERM to the node alone: it drains, then stops its own children."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the node and everything in its process group."""
        self._kill_group()
        self.proc.wait()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL; the exit code (None if it had to be killed)."""
        self.terminate()
        try:
            rc: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        self._kill_group()  # children of the node (e.g. vLLM's engine core) must not outlive it
        self._reader.join(5)
        self._log.close()
        return rc

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_node(args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 300,
               host: str = "127.0.0.1", name: str | None = None, log_dir: Path | None = None) -> NodeProcess:
    """Run `encdis <args>` and return once it printed its ready line (or raise with its log)."""
    return NodeProcess(args, env=env, host=host, name=name, log_dir=log_dir).wait_ready(timeout)
