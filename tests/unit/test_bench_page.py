"""bench/README.md, the results page: every bench it names exists and answers `--help`, and every
bench in the tree is on it.

A bench renamed or moved without its page (or a page naming one that no longer runs) would send
a reader to a command that fails; `--help` runs each module's imports and argument parser, which
is where a broken move shows, without running the bench.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "bench" / "README.md"
# Modules with a command line that are parts of a bench, not benches: run by another bench.
HELPERS = {"bench.fleet.live_node", "bench.serving.vllm_bench"}
HELP_TIMEOUT_S = 180


def page() -> str:
    return PAGE.read_text()


def commands_on_page() -> set[str]:
    return set(re.findall(r"python -m (bench(?:\.\w+)+)", page()))


def entry_points() -> set[str]:
    """Every module under bench/ that runs as a program."""
    found = set()
    for path in (ROOT / "bench").rglob("*.py"):
        if 'if __name__ == "__main__"' in path.read_text():
            found.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def help_of(module: str) -> tuple[str, int, str]:
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=HELP_TIMEOUT_S, env=None)
    return module, done.returncode, done.stdout + done.stderr


def test_every_path_the_page_names_exists() -> None:
    paths = set(re.findall(r"\b(bench/[\w/]+\.(?:py|sh))\b", page()))
    assert paths, "the page names no bench file"
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"bench/README.md names files that do not exist: {missing}"


def test_every_bench_in_the_tree_is_on_the_page() -> None:
    absent = sorted(entry_points() - HELPERS - commands_on_page())
    assert not absent, f"benches missing from bench/README.md: {absent}"


def test_every_bench_on_the_page_answers_help() -> None:
    modules = sorted(commands_on_page())
    assert len(modules) >= 20, modules
    unknown = [m for m in modules if not (ROOT / Path(*m.split("."))).with_suffix(".py").is_file()]
    assert not unknown, f"bench/README.md names modules that do not exist: {unknown}"
    # Mostly imports (torch, vLLM for some): a few at a time keeps the wall time near the slowest.
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(help_of, modules))
    failed = [f"{m} (exit {rc}): {out[-600:]}" for m, rc, out in results if rc != 0 or "usage" not in out.lower()]
    assert not failed, "\n\n".join(failed)
