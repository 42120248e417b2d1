#!/usr/bin/env bash
# GPU check of the encoder node: one command on one GPU machine, no network, no vLLM, no install.
#
#   bench/gpu/check.sh [flags of bench/gpu/check.py]           # default: cuda:0, bf16, 7B vision, 1080p
#   bench/gpu/check.sh --device cpu --depth 2 --images 4 --size 448 --rounds 1 --transport-rounds 1   # CPU proof run
#
# Runs bench/gpu/check.py (node vs in-process tower patches/s, MFU, attention implementation,
# then bench/data_plane/transport.py's table) from the source tree: `encdis` is assembled from
# pyproject.toml's package-dir as links in a temporary folder on PYTHONPATH (nothing installed).
# The JSON goes to $OUT/gpu_check.json when OUT is set, else to /tmp/gpu_check.json (--json overrides).
#
# Python packages the encoder node needs beyond torch/transformers (grpcio-health-checking,
# grpcio-reflection, and the grpcio/protobuf versions the committed stubs were generated with)
# are taken from wheels in bench/dist/ (or $GPU_CHECK_WHEELS) when the machine's own do not
# import. bench/dist/ is git-ignored (dist/), so it travels to the device machine only when
# named in `carry`.
# Fetch them (here, where a registry is reachable) for the device's Python 3.12 x86-64:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d bench/dist grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # we cd below
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/bench/dist}"
WORK="$(mktemp -d /tmp/encdis-gpu-check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
# Not the repository root: `python -c` and `python -m` put the working directory first on
# sys.path, where ./encdis (without client/, encoder_node/, ...) would hide the assembled package.
cd "$WORK"

"$PY" "$ROOT/bench/gpu/check.py" --source-tree "$WORK/src" >/dev/null
export PYTHONPATH="$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

# Everything the encoder node imports (grpc health/reflection, stubs, prometheus, torch, transformers).
node_imports() { "$PY" -c "import encdis.encoder_node.server, encdis.client.pb.encoder_pb2_grpc" 2>"$WORK/import.err"; }
if ! node_imports; then
    echo "gpu_check: the encoder node's imports fail here: $(tail -1 "$WORK/import.err")"
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu_check: installing $WHEELS/*.whl into $WORK/site (no index, no deps)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "$WHEELS"/*.whl
        export PYTHONPATH="$WORK/site:$PYTHONPATH"
    fi
    if ! node_imports; then
        cat "$WORK/import.err" >&2
        echo "gpu_check: still failing; are the wheels in bench/dist/ (carried: carry [\"bench/dist\"])?" >&2
        exit 2
    fi
fi

"$PY" -c "import sys, encdis.encoder_node; print('encdis.encoder_node from', encdis.encoder_node.__file__,
      '| python', sys.version.split()[0])"
"$PY" "$ROOT/bench/gpu/check.py" --json "${OUT:-/tmp}/gpu_check.json" "$@"
