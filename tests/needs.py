"""What a test needs from its environment (a program, a module): skip here, fail under CI.

A developer without systemd-analyze, kubectl, torch or vLLM gets a skip that says what to
install. CI runs with the environment variable CI set (`.ci/run` runs as CI=true): there a
missing need is a failure, so a green CI run can never be one that skipped what it was meant
to check. Every test that depends on something optional goes through `require_or_skip`.

    torch = require_module("torch")                                 # at module level or in a test
    analyze = require_tool("systemd-analyze", "apt-get install systemd")
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest

_NOT_CI = {"", "0", "false", "no"}


def in_ci() -> bool:
    """True when the environment variable CI is set (to anything but an explicit false)."""
    return os.environ.get("CI", "").strip().lower() not in _NOT_CI


def require_or_skip(available: bool, what: str, hint: str = "") -> None:
    """Nothing if `available`; else skip the test (or module) naming `what`, or fail under CI."""
    if available:
        return
    reason = f"{what} is not available" + (f" ({hint})" if hint else "")
    if in_ci():
        pytest.fail(f"{reason}; CI is set, where a missing need fails instead of skipping", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, hint: str = "") -> ModuleType:
    """The imported module `name`; skips (fails under CI) when it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        require_or_skip(False, f"module {name}", hint or f"import failed: {e}")
        raise  # not reached: require_or_skip skipped or failed


def require_tool(name: str, hint: str = "") -> str:
    """The path of the program `name` on PATH; skips (fails under CI) when there is none."""
    path = shutil.which(name)
    require_or_skip(path is not None, f"program {name}", hint)
    assert path is not None
    return path
