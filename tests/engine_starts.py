"""Counts the vLLM engines the suite starts, and prints the count beside pytest's slowest items.

An engine start is the suite's largest fixed cost (30-45 s on a 2-core machine), so its count is
kept visible in every run's summary: a new test that starts its own node instead of sharing one
shows there. Engines start in many places (LLM node processes, the monolithic references'
subprocesses, `vllm serve`, engine hosts inside the test process), so rather than hook each, a
daemon thread watches this process's descendants for vLLM's engine-core process (it titles
itself `VLLM::EngineCore`) and records each new one once, with the module of the test running
when it appeared and the role of the process that started it. Engines live for seconds at the
least, so a poll every 0.2 s sees every one.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import psutil
import pytest

POLL_SECONDS = 0.2
ENGINE_TITLE = "VLLM::EngineCore"

# The role of an engine's parent, from its command line: first match wins.
ROLES = (
    ("encdis.cli llm", "LLM node"),
    ("encdis.llm_node.reference", "monolithic reference"),
    ("vllm.entrypoints.openai.api_server", "vllm serve"),
    ("vllm serve", "vllm serve"),
)


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except (psutil.Error, OSError):
        return ""


def _role(engine: psutil.Process) -> str:
    try:
        parent = engine.parent()
    except (psutil.Error, OSError):
        return "other"
    if parent is None:
        return "other"
    if parent.pid == os.getpid():
        return "in the test process"
    line = _cmdline(parent)
    return next((role for needle, role in ROLES if needle in line), "other")


class EngineStarts:
    """Engines seen so far: by module of the running test and by the role of their parent."""

    def __init__(self) -> None:
        self.module = "(collection)"
        self.by_module: Counter[str] = Counter()
        self.by_role: Counter[str] = Counter()
        self._seen: set[tuple[int, float]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-starts", daemon=True)

    @property
    def total(self) -> int:
        return sum(self.by_role.values())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()  # engines started since the last poll and still alive

    def poll(self) -> None:
        try:
            children = psutil.Process().children(recursive=True)
        except (psutil.Error, OSError):
            return
        for child in children:
            try:
                key = (child.pid, child.create_time())
            except (psutil.Error, OSError):
                continue
            if key in self._seen or not _cmdline(child).startswith(ENGINE_TITLE):
                continue
            self._seen.add(key)
            self.by_module[self.module] += 1
            self.by_role[_role(child)] += 1

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.poll()


_STARTS = EngineStarts()


def pytest_sessionstart(session: pytest.Session) -> None:
    _STARTS.start()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Module-scoped set-ups run inside the first test's setup, so this names the module that pays.
    _STARTS.module = item.nodeid.split("::")[0]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    _STARTS.stop()
    tr = terminalreporter
    tr.section("vLLM engine starts")
    roles = ", ".join(f"{role} {n}" for role, n in _STARTS.by_role.most_common())
    tr.write_line(f"{_STARTS.total} engine starts" + (f" ({roles})" if roles else ""))
    for module, n in _STARTS.by_module.most_common():
        tr.write_line(f"{n:4d}  {module}")
