"""An encoder node served in-process (its own event loop in a thread) for integration tests.

    with InProcessEncoder(EncoderSettings(model=ckpt, host="127.0.0.1", port=0)) as node:
        EncoderClient(node.address).encode([...])

It is the real EncoderNode (grpc.aio server, interceptor, health, batcher) on loopback,
minus the process boundary and signal handling (tests/e2e cover those with `encdis encoder`).
"""

from __future__ import annotations

import asyncio
import threading

from encdis.encoder_node.server import EncoderNode
from encdis.encoder_node.settings import EncoderSettings


class InProcessEncoder:
    def __init__(self, settings: EncoderSettings, timeout: float = 120) -> None:
        self.node = EncoderNode(settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="encdis-test-encoder", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.node.start(), self._loop).result(timeout)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.node.port}"

    def call(self, coro, timeout: float = 120):
        """Run a coroutine on the node's loop (e.g. node.drain()) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self.call(self.node.stop(grace=0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def __enter__(self) -> InProcessEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
