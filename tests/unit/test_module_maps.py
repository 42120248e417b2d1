"""Each package's docstring names every module in it, so a newcomer's map of the tree is complete."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

PACKAGES = ["encdis.llm_node", "encdis.llm_node.coordinator"]


@pytest.mark.parametrize("package", PACKAGES)
def test_the_package_docstring_names_every_module(package: str) -> None:
    mod = importlib.import_module(package)
    doc = mod.__doc__ or ""
    modules = sorted(p.stem for p in Path(mod.__file__).parent.glob("*.py") if p.stem != "__init__")
    subpackages = sorted(p.parent.name for p in Path(mod.__file__).parent.glob("*/__init__.py"))
    listed = {line.split()[0].removesuffix(".py").rstrip("/") for line in doc.splitlines() if line.startswith("    ")}
    missing = [m for m in modules + subpackages if m not in listed]
    assert not missing, f"{package}'s docstring does not name {missing}"
