"""The node's AsyncLLM as vLLM's OpenAI handlers see it: the same engine, each request's time split recorded.

vLLM's serving layer calls `generate` on the engine client it was built with; this wrapper passes
every call through unchanged and, for a request the HTTP door admitted (its DoorRequest in the
context variable CURRENT, set by the door around vLLM's handler), records the first token and the
end: TTFT, the prefill and decode spans after the coordinator's queue / encode / transfer, and the
token counts, into the node's metrics, as the gRPC door's generation does.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from encdis.llm_node.metrics import LLMNodeMetrics


@dataclass
class DoorRequest:
    """One HTTP request through the door: when it started and what its media cost before the engine."""

    started: float = field(default_factory=time.monotonic)
    split: dict[str, float] = field(default_factory=dict)  # queue, preprocess, encode, transfer (coordinator's)
    image_tokens: int = 0
    recorded: bool = False  # the split was observed (once per request, whatever n or beam width)
    held: list[Any] = field(default_factory=list)  # the request's embeddings held in the shared region
    cached: int = 0  # of its images, how many came from a cache
    timing: dict[str, float] = field(default_factory=dict)  # the whole split, once the request finished


CURRENT: contextvars.ContextVar[DoorRequest | None] = contextvars.ContextVar("encdis_door_request", default=None)


class TimedEngine:
    """Delegates everything to `engine` (an AsyncLLM); `generate` also feeds the node's metrics."""

    def __init__(self, engine: Any, metrics: LLMNodeMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any,
                       **kwargs: Any) -> AsyncIterator[Any]:
        from vllm.sampling_params import RequestOutputKind

        door = CURRENT.get()
        # Deltas carry each step's new tokens; the other kinds, all of them so far.
        deltas = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        t_submit = time.monotonic()
        t_first: float | None = None
        async for out in self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs):
            if door is not None:
                now = time.monotonic()
                if t_first is None and any(c.token_ids for c in out.outputs):
                    t_first = now
                    if not door.recorded:
                        self._metrics.ttft.observe(now - door.started)
                if deltas or out.finished:
                    self._metrics.completion_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
                if out.finished:
                    self._finished(door, out, t_submit, t_first if t_first is not None else now, now)
            yield out

    def _finished(self, door: DoorRequest, out: Any, t_submit: float, t_first: float, now: float) -> None:
        m = self._metrics
        if door.recorded:
            return
        door.recorded = True
        m.prompt_tokens.inc(len(out.prompt_token_ids or ()))
        m.image_tokens.inc(door.image_tokens)
        split = {"queue": 0.0, "preprocess": 0.0, "encode": 0.0, "transfer": 0.0, **door.split,
                 "prefill": t_first - t_submit, "decode": now - t_first, "total": now - door.started}
        door.timing = {k: max(0.0, v) for k, v in split.items()}
        m.observe_split(**door.timing)
