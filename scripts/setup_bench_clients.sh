#!/usr/bin/env bash
# Build the environment of the standard serving-benchmark clients run against encdis's OpenAI
# door: GuideLLM (with its image extras) and aiperf. It lives apart from the project's venv
# because their pins (pydantic, transformers, datasets, httpx) need not agree with vLLM's.
# aiperf needs no torch and agrees with GuideLLM's pins (`pip check`), so both share one venv.
#
# Usage: bash scripts/setup_bench_clients.sh [VENV_DIR]     (default: .venv-bench)
#
# torch is pinned to the CPU build the project uses, so nothing pulls a multi-GB CUDA build.
# Idempotent: re-running on a ready venv is quick; the stamp is this script's hash, so a venv
# built by an older version of it (another client or pin) is brought up to date.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-$ROOT/.venv-bench}
GUIDELLM="guidellm[vision]==0.8.1"
AIPERF="aiperf==0.13.0"
TORCH="torch==2.13.0+cpu"

STAMP="$V/.encdis-setup"
WANT=$(sha256sum "$0" | cut -d' ' -f1)
if [[ -x "$V/bin/guidellm" && -x "$V/bin/aiperf" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then exit 0; fi

if [[ ! -x "$V/bin/python" ]]; then python3 -m venv "$V"; fi
"$V/bin/pip" install -q --upgrade pip
"$V/bin/pip" install -q "$TORCH"
"$V/bin/pip" install -q "$GUIDELLM" "$AIPERF" "$TORCH"
"$V/bin/pip" check
"$V/bin/guidellm" --version
"$V/bin/aiperf" --version
echo "$WANT" > "$STAMP"
