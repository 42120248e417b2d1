"""systemd's notify protocol: one datagram to $NOTIFY_SOCKET; no dependency.

A unit with Type=notify is "started" only when the node sends READY=1 (model loaded,
port bound), and shows "deactivating" once it sends STOPPING=1 (draining). Outside
systemd NOTIFY_SOCKET is unset and every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to systemd; True if a socket was there to send to."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace socket
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as e:  # never let a supervisor problem take the node down
        log.warning("sd_notify %r to %s failed: %s", state, os.environ.get("NOTIFY_SOCKET"), e)
        return False
    return True
