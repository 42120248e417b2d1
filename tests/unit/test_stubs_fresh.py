"""The committed gRPC stubs are exactly what scripts/gen_protos.sh produces from proto/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PB = ROOT / "client" / "pb"


def test_regenerated_stubs_equal_the_committed_ones(tmp_path):
    out = tmp_path / "pb"
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(out)], check=True,
                   env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    generated = sorted(p.name for p in out.iterdir() if p.is_file())
    committed = sorted(p.name for p in PB.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    assert generated == committed
    stale = [name for name in generated if (out / name).read_bytes() != (PB / name).read_bytes()]
    assert not stale, f"stale stubs {stale}: edit proto/ and run `bash scripts/gen_protos.sh`"
