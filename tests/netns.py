"""A node in a network namespace of its own: two Kubernetes pods on one host, on this machine.

Two pods on one node share the host's boot id but not a loopback. `pod_wrapper` gives
NodeProcess the command that starts a node that way: `unshare -n` (root only) puts it in a new
network namespace, whose loopback is brought up and nothing else; this module, run there,
relays a Unix socket (a file: reachable from any namespace) to the node's fixed port on that
loopback, then runs the node. `Relay` is the other end, in the test's namespace: a port on
this namespace's 127.0.0.1 that leads to the socket. So the node is reachable, and only as a
pod is: over a path that is not this namespace's loopback.

    python -m tests.netns SOCKET PORT -- COMMAND...      (inside the new namespace)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

from tests.needs import require_or_skip

POD_PORT = 50051  # the namespace is new and empty: any port is free in it
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def require_network_namespaces() -> None:
    """Skip (fail under CI) unless this process may create network namespaces (root, unshare)."""
    unshare = shutil.which("unshare")
    ok = unshare is not None and os.geteuid() == 0 and subprocess.run(
        [unshare, "-n", "true"], capture_output=True).returncode == 0
    require_or_skip(ok, "`unshare -n` (a new network namespace)",
                    "run as root on Linux with util-linux installed")


def pod_wrapper(socket_path: str) -> list[str]:
    """What NodeProcess(wrapper=...) needs to run a node as a pod; give the node --port POD_PORT."""
    return ["unshare", "-n", "--", sys.executable, "-m", "tests.netns", socket_path, str(POD_PORT), "--"]


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _serve(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Accept forever; each connection gets its own upstream connection and two pumps."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return  # closed
        try:
            upstream = connect()
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


class Relay:
    """127.0.0.1:`port` in this namespace, relayed to the Unix socket at `socket_path`."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=_serve, args=(self._listener, self._connect), daemon=True).start()

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.socket_path)
        return s

    def close(self) -> None:
        self._listener.close()


def _loopback_up() -> None:
    """`ip link set lo up`, with the ioctl itself (no iproute2 needed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _run_in_pod(socket_path: str, port: int, command: Sequence[str]) -> int:
    _loopback_up()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen()
    threading.Thread(target=_serve, args=(listener, lambda: socket.create_connection(("127.0.0.1", port))),
                     daemon=True).start()
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT):  # the node drains on these: pass them on
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    return child.wait()


if __name__ == "__main__":
    args = sys.argv[1:]
    split = args.index("--")
    sys.exit(_run_in_pod(args[0], int(args[1]), args[split + 1:]))
