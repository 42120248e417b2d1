"""The engine reaper: vLLM's engine processes never outlive the LLM node, also on kill -9.

vLLM starts its EngineCore (and, with TP > 1, its workers) as child processes that do not
notice their parent dying: a node killed with SIGKILL left 2.3 GB of engine processes
running. So the node starts one small reaper process first, tied to it by a pipe it alone
holds the write end of. After the engine has started, the node sends the reaper the pids
(and start times, so a recycled pid is never hit) of all its descendants. When the pipe
closes, however the node ended, the reaper kills those that still run, then exits.

    reaper = EngineReaper.start()      # before the engine starts
    ...engine.start()...
    reaper.watch_descendants()         # once the engine's processes exist
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys


class EngineReaper:
    def __init__(self, proc: subprocess.Popen, write_fd: int) -> None:
        self.proc = proc
        self._fd = write_fd

    @classmethod
    def start(cls) -> EngineReaper:
        read_fd, write_fd = os.pipe()
        os.set_inheritable(write_fd, False)  # only this process may hold it: its death is the signal
        proc = subprocess.Popen(
            [sys.executable, "-m", "encdis.llm_node.reaper", str(read_fd)],
            pass_fds=(read_fd,), stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the node's group must not kill it first
        )
        os.close(read_fd)
        return cls(proc, write_fd)

    def watch_descendants(self) -> int:
        """Tell the reaper about every descendant of this process now; how many."""
        import psutil

        procs = []
        for p in psutil.Process().children(recursive=True):
            if p.pid == self.proc.pid:
                continue
            try:
                if _is_resource_tracker(p):
                    continue
                procs.append({"pid": p.pid, "created": p.create_time()})
            except psutil.Error:
                continue
        os.write(self._fd, (json.dumps(procs) + "\n").encode())
        return len(procs)

    def close(self) -> None:
        """The node is exiting normally: the reaper kills any leftover and exits."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _is_resource_tracker(p) -> bool:
    """Python's multiprocessing resource tracker: it ignores SIGTERM (so killing it would cost
    _kill_all's whole wait), ends by itself once the last process holding its pipe is gone, and
    then unlinks what they leaked. Killed, it would leave that shared memory behind."""
    return "multiprocessing.resource_tracker" in " ".join(p.cmdline())


def _kill_all(procs: list[dict]) -> None:
    import psutil

    alive = []
    for entry in procs:
        try:
            p = psutil.Process(entry["pid"])
            if abs(p.create_time() - entry["created"]) < 0.01:  # the same process, not a recycled pid
                alive.append(p)
        except psutil.Error:
            continue
    for p in alive:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive, timeout=5)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass


def main(read_fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's end stops it
    procs: list[dict] = []
    buf = b""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while True:
            data = pipe.read(65536)
            if not data:
                break  # the node is gone
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                procs = json.loads(line)
    _kill_all(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
