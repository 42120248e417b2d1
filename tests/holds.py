"""Hold one step of a real node (its tower forward, its decoding) until the test lets it go, so
what a test needs to be in flight is in flight, without sleeping and hoping."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def held(owner: Any, attribute: str) -> Iterator[threading.Event]:
    """Inside the block calls of `owner.<attribute>` wait; the event is set once one waits."""
    real = getattr(owner, attribute)
    entered, gate = threading.Event(), threading.Event()

    def waiting(*args: Any) -> Any:
        entered.set()
        if not gate.wait(120):
            raise RuntimeError(f"held: the test never let {attribute} go on")
        return real(*args)

    setattr(owner, attribute, waiting)
    try:
        yield entered
    finally:
        gate.set()
        setattr(owner, attribute, real)
