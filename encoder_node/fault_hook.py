"""A test fault hook: makes the tower fail on one image, so tests can prove a bad image harms
only its own request. Off unless a test sets ENCDIS_TEST_FAULT_FAIL_GRID in the node's
environment (e.g. "1,6,10": any forward holding an image of that grid_thw raises)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

TEST_FAULT_ENV = "ENCDIS_TEST_FAULT_FAIL_GRID"


def with_test_fault(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` itself, or (only with the test variable set) one that fails on the poisoned grid."""
    raw = os.environ.get(TEST_FAULT_ENV, "")
    if not raw:
        return forward
    poisoned = tuple(int(v) for v in raw.split(","))

    def faulty(pixel_values: Sequence[Any], grid_thw: Sequence[tuple[int, int, int]]) -> Any:
        if poisoned in [tuple(g) for g in grid_thw]:
            raise RuntimeError(f"test fault hook ({TEST_FAULT_ENV}): forward with grid {poisoned}")
        return forward(pixel_values, grid_thw)

    return faulty
