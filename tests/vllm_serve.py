"""A real monolithic `vllm serve` (tower loaded) as the reference the OpenAI door is held to.

`python -m vllm.entrypoints.openai.api_server` (the CPU wheel's `vllm` command cannot find its own
metadata) on a checkpoint, in float32 like the LLM node's engine. Answers are kept in pytest's
cache under a key of everything that decides them (library versions, every checkpoint file's
bytes, the requests, the server's arguments), so a change to any of them runs the server again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from encdis.llm_node.reference import installed_versions

SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "16", "--seed", "0",
              "--enforce-eager", "--limit-mm-per-prompt", '{"image": 16, "video": 0}']
START_TIMEOUT_SECONDS = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"vllm serve not healthy after {timeout}s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def vllm_serve(ckpt: Path, log: Path, *args: str) -> Iterator[str]:
    """`vllm serve` on `ckpt` with SERVE_ARGS and `args`; yields its base URL, kills it after."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
             "--host", "127.0.0.1", "--port", str(port), *SERVE_ARGS, *args],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, log, timeout=START_TIMEOUT_SECONDS)
        yield base
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def reference_key(ckpt: Path, *parts: Any) -> str:
    h = hashlib.sha256(b"encdis vllm-serve reference v1\0")
    h.update(json.dumps(installed_versions(), sort_keys=True).encode())
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        h.update(f.relative_to(ckpt).as_posix().encode() + hashlib.sha256(f.read_bytes()).digest())
    h.update(json.dumps([SERVE_ARGS, *parts], sort_keys=True).encode())
    return h.hexdigest()
