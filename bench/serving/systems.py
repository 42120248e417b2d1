"""The systems bench/serving/serve.py compares: monolithic `vllm serve` and encdis, each confined to a CPU set.

Starting them (taskset for vLLM; the calling thread's affinity for the encdis nodes, which
the launcher's children inherit), reading back the cores every thread may use, the CPU time
each role spent (from /proc), and the LLM node's per-stage time split (its Prometheus
histograms).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from encdis.launcher import NodeProcess

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
# Same engine limits on both sides: the LLM node's defaults are vLLM serve's here.
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 4096
VLLM_SERVE_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
                   "--seed", "0", "--enforce-eager", "--limit-mm-per-prompt", '{"image": 16, "video": 0}']
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STAGES = ("queue", "preprocess", "encode", "transfer", "prefill", "decode", "total")
# Monolithic vLLM's own histograms for the same split (its /metrics), under the node's names: queue
# (waiting to be scheduled), prefill (scheduled to first token, its tower's forward included), decode,
# total and time to first token (both from its arrival, once its front has parsed the request).
VLLM_STAGES = {"encdis_request_queue_seconds": "vllm:request_queue_time_seconds",
               "encdis_request_prefill_seconds": "vllm:request_prefill_time_seconds",
               "encdis_request_decode_seconds": "vllm:request_decode_time_seconds",
               "encdis_request_total_seconds": "vllm:e2e_request_latency_seconds",
               "encdis_request_time_to_first_token_seconds": "vllm:time_to_first_token_seconds"}


def parse_cpus(text: str) -> list[int]:
    """"0", "0,2", "0-3" -> sorted core ids."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in cpus)


def thread_env(cpus: Sequence[int]) -> dict[str, str]:
    """One compute thread per core of the process's set, no more."""
    n = str(len(cpus))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}


@contextlib.contextmanager
def pinned(cpus: Sequence[int]) -> Iterator[None]:
    """Confine the calling thread while children are started: a child inherits the affinity of
    the thread that forks it (the launcher has no command prefix such as taskset)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def group_cpus(pgid: int) -> set[int]:
    """Union of the allowed cores of every thread in process group `pgid` (to prove confinement)."""
    cores: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for task in (entry / "task").iterdir():
                cores |= os.sched_getaffinity(int(task.name))
        except (OSError, ValueError, IndexError):  # the process or thread went away meanwhile
            continue
    return cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left (vLLM's engine core included)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class System:
    """One running system under test, reachable at `base_url`, serving `model`."""

    name: str
    base_url: str
    model: str
    cpus: dict[str, list[int]]  # role -> cores it was confined to
    llm: NodeProcess | None = None  # encdis only: its metrics give the time split
    groups: dict[str, list[int]] = field(default_factory=dict)  # role -> process-group ids
    stops: list[Callable[[], None]] = field(default_factory=list)

    def stop(self) -> None:
        while self.stops:
            with contextlib.suppress(Exception):
                self.stops.pop()()

    def confinement(self) -> dict[str, list[int]]:
        """The cores every process of each role may run on, read back from /proc."""
        return {role: sorted(set().union(*(group_cpus(g) for g in pgids))) for role, pgids in self.groups.items()}


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        time.sleep(1)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s (exit {proc.poll()}); log {log_path}:\n{tail}")


def start_vllm(system: System, model: str, cpus: list[int], log_dir: Path, timeout: float) -> None:
    port = free_port()
    log_path = log_dir / f"{system.name}-vllm.log"
    env = {**os.environ, **OFFLINE_ENV, **thread_env(cpus), "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
           "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["taskset", "-c", cpu_list(cpus), sys.executable, "-m", "vllm.entrypoints.openai.api_server",
             "--model", model, "--host", "127.0.0.1", "--port", str(port), *VLLM_SERVE_ARGS],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    system.stops.append(lambda: kill_group(proc))
    system.groups["vllm"] = [proc.pid]
    system.base_url = f"http://127.0.0.1:{port}"
    wait_http(f"{system.base_url}/health", proc, timeout, log_path)


def source_tree_env(tree: Path, shim: Path) -> dict[str, str]:
    """PYTHONPATH under which `python -m encdis...` runs the encdis of another source tree (a worktree of an
    earlier commit): `shim/encdis` lays the repository's flat folders out as the installed package."""
    package = shim / "encdis"
    package.mkdir(parents=True, exist_ok=True)
    for f in (tree / "encdis").iterdir():
        if not (package / f.name).exists():
            (package / f.name).symlink_to(f.resolve())
    for sub in ("client", "encoder_node", "llm_node"):
        if not (package / sub).exists():
            (package / sub).symlink_to((tree / sub).resolve())
    # PYTHONSAFEPATH: `python -m` puts no working directory first on sys.path, where this repository's
    # own encdis/ would be found before the shim.
    return {"PYTHONPATH": str(shim), "PYTHONSAFEPATH": "1"}


def start_encdis(system: System, model: str, llm_cpus: list[int], encoder_cpus: list[int], encoders: int,
                 log_dir: Path, timeout: float, extra_env: dict[str, str] | None = None) -> None:
    """`extra_env`: more environment for every node (source_tree_env: another tree's encdis)."""
    enc_env = {**OFFLINE_ENV, **thread_env(encoder_cpus), **(extra_env or {})}
    nodes: list[NodeProcess] = []
    with pinned(encoder_cpus):
        for i in range(encoders):
            node = NodeProcess(["encoder", "--model", model, "--host", "127.0.0.1", "--port", "0",
                                "--preprocess-workers", str(len(encoder_cpus))],
                               env=enc_env, name=f"{system.name}-encoder-{i}", log_dir=log_dir)
            nodes.append(node)
            system.stops.append(node.stop)
    for node in nodes:
        node.wait_ready(timeout)
    llm_env = {**OFFLINE_ENV, **thread_env(llm_cpus), "VLLM_CPU_OMP_THREADS_BIND": cpu_list(llm_cpus),
               **(extra_env or {})}
    with pinned(llm_cpus):
        llm = NodeProcess(["llm", "--model", model, "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                           "--metrics-port", "0", "--max-num-seqs", str(MAX_NUM_SEQS),
                           "--max-model-len", str(MAX_MODEL_LEN), "--encoders", ",".join(n.address for n in nodes)],
                          env=llm_env, name=f"{system.name}-llm", log_dir=log_dir)
    # Stopped first: it drains its requests while the encoders still serve.
    system.stops.append(llm.stop)
    llm.wait_ready(timeout)
    system.llm = llm
    system.groups = {"llm": [llm.pid], "encoders": [n.pid for n in nodes]}
    system.base_url = f"http://127.0.0.1:{llm.info['http_port']}"


def stage_sums(llm: NodeProcess) -> dict[str, float]:
    names = [f"encdis_request_{s}_seconds" for s in STAGES] + ["encdis_request_time_to_first_token_seconds"]
    return {f"{n}_{k}": llm.metric(f"{n}_{k}") for n in names for k in ("sum", "count")}


def vllm_stage_sums(base_url: str) -> dict[str, float]:
    """VLLM_STAGES' sums and counts from a `vllm serve`'s /metrics, named as stage_sums names the node's."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for ours, name in VLLM_STAGES.items():
        for k in ("sum", "count"):
            m = re.search(rf"^{re.escape(name)}_{k}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            if m is None:
                raise RuntimeError(f"{name}_{k} is not among {base_url}/metrics")
            out[f"{ours}_{k}"] = float(m.group(1))
    return out


def stage_means_ms(before: dict[str, float], after: dict[str, float], client_ttft_ms: float) -> dict[str, float]:
    """Mean ms per request of each stage between two scrapes, with what the stages leave out
    (NaN: a stage the system does not time apart, as vLLM's encode is inside its prefill)."""

    def mean(name: str) -> float:
        if f"{name}_count" not in after:
            return float("nan")
        n = after[f"{name}_count"] - before[f"{name}_count"]
        return 1000 * (after[f"{name}_sum"] - before[f"{name}_sum"]) / n if n else float("nan")

    out = {s: mean(f"encdis_request_{s}_seconds") for s in STAGES}
    # Rendering, validation and waits between the parts the node times.
    out["other"] = out["total"] - sum(out[s] for s in STAGES if s != "total" and out[s] == out[s])
    out["node_ttft"] = mean("encdis_request_time_to_first_token_seconds")
    out["front"] = client_ttft_ms - out["node_ttft"]
    return out


def cpu_seconds(systems: Sequence[System]) -> dict[str, dict[str, float]]:
    """CPU time (user + system, all threads) used so far by each role of each system."""
    by_group = {g: 0.0 for s in systems for gs in s.groups.values() for g in gs}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        pgid = int(fields[2])
        if pgid in by_group:
            by_group[pgid] += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return {s.name: {role: sum(by_group[g] for g in gs) for role, gs in s.groups.items()} for s in systems}
