"""Decoded pixels in flight, bounded like the batcher's patches: a flood of small files that
declare huge sizes gets RESOURCE_EXHAUSTED instead of the node's memory.

A file's header says how many pixels decoding it will produce (a 198 KiB PNG can declare
8000x8000: 64M pixels, ~200 MB once decoded, seconds of work), so a call reserves its
images' pixels before any decoding and gives them back once they are preprocessed. A call
larger than the whole budget still runs when nothing else is decoding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from encdis.client.errors import ResourceExhausted


class DecodeBudget:
    def __init__(self, max_pixels: int) -> None:
        self.max_pixels = max_pixels
        self.in_flight = 0

    @contextlib.contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        if self.in_flight and self.in_flight + pixels > self.max_pixels:
            raise ResourceExhausted(f"{self.in_flight} decoded pixels in flight, this call needs {pixels}, "
                                    f"the limit is {self.max_pixels}; retry later", reason="DECODE_BUDGET_FULL",
                                    metadata={"limit": str(self.max_pixels)})
        self.in_flight += pixels
        try:
            yield
        finally:
            self.in_flight -= pixels
