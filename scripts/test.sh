#!/usr/bin/env bash
# README's test command: set up a CPU environment (first run only) and run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/unit -x`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup_cpu.sh" "$ROOT/.venv"
# The standard benchmark clients the e2e tests run against the OpenAI door (GuideLLM).
bash "$ROOT/scripts/setup_bench_clients.sh" "$ROOT/.venv-bench"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# The summary names the 15 slowest set-ups, calls and teardowns, and counts the vLLM engines the run
# started (tests/engine_starts.py): the suite's time stays visible in every run.
exec "$ROOT/.venv/bin/python" -m pytest -ra --durations=15 "$@"
