"""The coordinator package needs neither vLLM nor the engine host: it imports with both unimportable."""

from __future__ import annotations

import subprocess
import sys

# Run in a fresh interpreter: this process may have imported vLLM already.
PROBE = """
import importlib.abc, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm.") or name == "encdis.llm_node.engine":
            raise ImportError(f"{name} is unimportable in this test")
        return None

sys.meta_path.insert(0, Refuse())
import encdis.llm_node.coordinator as c
from encdis.llm_node.coordinator import coordinator, dispatch, pool, health, discovery, cost_model, assignment
from encdis.llm_node.coordinator import embedding_cache, patches, identity, records, metrics, handle
c.Coordinator, c.CoordinatorSettings
assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "vllm was imported"
print("ok")
"""


def test_coordinator_imports_without_vllm_or_the_engine() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_probe_does_refuse_vllm() -> None:
    # The guard itself must bite: importing the engine host under it fails.
    probe = PROBE.replace("import encdis.llm_node.coordinator as c", "import encdis.llm_node.engine")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "unimportable in this test" in out.stderr
