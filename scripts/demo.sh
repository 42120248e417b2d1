#!/usr/bin/env bash
# README quick-start: set up a CPU environment (first run only) and run `encdis demo`:
# a tiny Qwen2.5-VL checkpoint, two encoder nodes and one LLM node on this machine.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup_cpu.sh" "$ROOT/.venv"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "$ROOT/.venv/bin/encdis" demo "$@"
