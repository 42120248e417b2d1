"""The client SDK (and `encdis encode`) work where torch, transformers and safetensors are absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

from tests.needs import require_module

# Poisoned modules: `import torch` raises ImportError in the child, as if not installed.
_BLOCK = "import sys\nfor m in ('torch', 'transformers', 'safetensors', 'PIL', 'vllm'):\n    sys.modules[m] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_client_imports_without_torch():
    r = _run("""
        import encdis.client as c
        from encdis.client import AsyncEncoderClient, EncoderClient, InvalidArgument, Embedding
        from encdis.client.pb import encoder_pb2, encoder_pb2_grpc, llm_pb2, llm_pb2_grpc
        import encdis.client.encode_command
        from encdis.cli import build_parser
        build_parser()
        assert 'torch' not in [k for k, v in sys.modules.items() if v is not None]
        print('ok')
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")


def test_encode_command_writes_safetensors_without_torch(tmp_path):
    """The file the light client writes is read back equal by safetensors' own loader."""
    out = tmp_path / "e.safetensors"
    rng = np.random.default_rng(0)
    fp32 = rng.standard_normal((3, 8)).astype("<f4")
    bf16_bits = rng.integers(0, 2**16, size=(2, 8), dtype=np.uint16)
    bf16_bits[(bf16_bits & 0x7F80) == 0x7F80] = 0  # no NaN/inf patterns
    np.save(tmp_path / "fp32.npy", fp32)
    np.save(tmp_path / "bf16.npy", bf16_bits)
    r = _run(f"""
        import numpy as np
        from encdis.client.wire import Embedding
        from encdis.client.encode_command import write_embeddings
        fp32 = np.load({str(tmp_path / "fp32.npy")!r}); bf16 = np.load({str(tmp_path / "bf16.npy")!r})
        write_embeddings({str(out)!r}, [
            Embedding(0, (1, 2, 6), "FP32", (3, 8), fp32.astype('<f4').tobytes(), "aa"),
            Embedding(1, (1, 4, 2), "BF16", (2, 8), bf16.astype('<u2').tobytes(), "bb"),
        ])
    """)
    assert r.returncode == 0, r.stderr
    torch = require_module("torch")  # to read the file back with safetensors' torch loader
    from safetensors import safe_open
    from safetensors.torch import load_file

    t = load_file(str(out))
    assert sorted(t) == ["embeds.0", "embeds.1", "grid_thw.0", "grid_thw.1"]
    assert torch.equal(t["embeds.0"], torch.from_numpy(fp32))
    assert t["embeds.1"].dtype == torch.bfloat16
    assert torch.equal(t["embeds.1"].view(torch.int16), torch.from_numpy(bf16_bits.view(np.int16)))
    assert t["grid_thw.0"].tolist() == [1, 2, 6] and t["grid_thw.1"].dtype == torch.int64
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"digest.0": "aa", "digest.1": "bb"}
