"""Standard serving-benchmark clients beside `vllm bench serve` for bench/serving/serve.py: GuideLLM and aiperf.

Each runs in its own process from the venv scripts/setup_bench_clients.sh builds (.venv-bench:
guidellm 0.8.1, aiperf 0.13.0), confined to the client's cores, against a system's OpenAI chat
endpoint (streamed), with the workload bench/serving/serve.py gives `vllm bench serve`:

    client     image per request                 text of --input-len   --output-len, ignore_eos
    vllm       random RGB --image-size square     random tokens         yes (--ignore-eos)
    guidellm   noise PNG --image-size square      none (see below)      yes (max_completion_tokens)
    aiperf     noise PNG --image-size square      synthetic tokens      yes (--extra-inputs)

GuideLLM 0.8.1's synthetic_image data has no text prompt: its requests carry the image and the
chat template only, so their prefill is --input-len tokens shorter than the others'. Each
client draws its own images and text from --seed (the same seed for all, not the same bytes).
aiperf counts output tokens from the server's usage (--use-server-token-count): re-tokenizing
a tiny checkpoint's random text does not give back the tokens it generated.

Every client's result becomes one row of the same figures (ROW_KEYS; times in ms): requests/s
over the measured requests, mean and p99 time to first token, mean time per output token after
the first (vLLM's TPOT; GuideLLM's and aiperf's inter-token latency, the same quantity:
(latency - TTFT) / (output tokens - 1)), completed and failed requests.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH_BIN = Path(os.environ.get("ENCDIS_BENCH_VENV", ROOT / ".venv-bench")) / "bin"
CLIENTS = ("vllm", "guidellm", "aiperf")
ROW_KEYS = ("completed", "failed", "request_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")
TAIL_CHARS = 4000


class ClientError(RuntimeError):
    """A benchmark client failed or wrote no result; the message has its output's tail."""


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int
    image_size: int
    seed: int


def parse_clients(text: str) -> list[str]:
    """"vllm,guidellm" -> ["vllm", "guidellm"]; vllm always runs (its run carries the CPU figures)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CLIENTS))
    if unknown:
        raise ValueError(f"unknown benchmark client(s) {', '.join(unknown)}; known: {', '.join(CLIENTS)}")
    return ["vllm", *(n for n in CLIENTS[1:] if n in names)]


def missing_clients(clients: Sequence[str]) -> list[str]:
    """The clients asked for whose program is not installed."""
    return [c for c in clients if c != "vllm" and not (BENCH_BIN / c).exists()]


def vllm_row(result: dict[str, Any]) -> dict[str, Any]:
    """The row of one `vllm bench serve` result (its saved JSON)."""
    return {k: result.get(k) for k in ROW_KEYS}


def guidellm_cmd(base_url: str, model: str, tokenizer_dir: str, w: Workload, out_json: Path) -> list[str]:
    return [str(BENCH_BIN / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={base_url.rstrip('/')},model={model}",
            "--profile", f"kind=concurrent,streams={w.concurrency}",
            "--constraint", f"kind=max_requests,count={w.num_prompts}",
            # output_tokens makes GuideLLM send max_completion_tokens with ignore_eos.
            "--data", f"kind=synthetic_image,width={w.image_size},height={w.image_size},"
                      f"output_tokens={w.output_len},images_per_request=1,format=png,content=noise,seed={w.seed}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
            "--output", f"kind=json,path={out_json}",
            "--disable-console-interactive"]


def guidellm_row(report: dict[str, Any]) -> dict[str, Any]:
    """The row of GuideLLM's JSON report (its single benchmark)."""
    (bench,) = report["benchmarks"]
    m = bench["metrics"]
    totals = m["request_totals"]

    def ok(name: str, stat: str) -> float | None:
        s = m[name]["successful"]
        if not s["count"]:
            return None
        return s["percentiles"]["p99"] if stat == "p99" else s[stat]

    # requests_per_second's mean is the run's: finished requests over its duration, as vLLM's and aiperf's.
    return {"completed": totals["successful"], "failed": totals["errored"] + totals["incomplete"],
            "request_throughput": ok("requests_per_second", "mean"),
            "mean_ttft_ms": ok("time_to_first_token_ms", "mean"), "p99_ttft_ms": ok("time_to_first_token_ms", "p99"),
            "mean_tpot_ms": ok("inter_token_latency_ms", "mean")}


def aiperf_cmd(base_url: str, model: str, tokenizer_dir: str, w: Workload, out_dir: Path) -> list[str]:
    return [str(BENCH_BIN / "aiperf"), "profile",
            "--model", model, "--tokenizer", tokenizer_dir, "--url", base_url.rstrip("/"),
            "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(w.concurrency), "--request-count", str(w.num_prompts),
            "--prompt-input-tokens-mean", str(w.input_len), "--prompt-input-tokens-stddev", "0",
            "--output-tokens-mean", str(w.output_len), "--output-tokens-stddev", "0",
            "--extra-inputs", '{"ignore_eos": true}', "--use-server-token-count",
            "--image-batch-size", "1", "--image-format", "png",
            "--image-width-mean", str(w.image_size), "--image-width-stddev", "0",
            "--image-height-mean", str(w.image_size), "--image-height-stddev", "0",
            "--random-seed", str(w.seed), "--artifact-dir", str(out_dir),
            # Its scrape of the server's /metrics would be load on the system under test.
            "--no-server-metrics", "--no-gpu-telemetry", "--export-level", "summary", "--ui-type", "none"]


def aiperf_row(export: dict[str, Any]) -> dict[str, Any]:
    """The row of aiperf's profile_export_aiperf.json."""

    def avg(name: str) -> float | None:
        return export[name]["avg"] if name in export else None

    if export.get("was_cancelled"):
        raise ClientError("aiperf's run was cancelled: its figures cover part of the requests")
    # A metric with no sample is left out of the export: no error_request_count means no error.
    return {"completed": int(avg("request_count") or 0), "failed": int(avg("error_request_count") or 0),
            "request_throughput": avg("request_throughput"), "mean_ttft_ms": avg("time_to_first_token"),
            "p99_ttft_ms": export["time_to_first_token"]["p99"] if "time_to_first_token" in export else None,
            "mean_tpot_ms": avg("inter_token_latency")}


def run_client(client: str, base_url: str, model: str, tokenizer_dir: str, w: Workload, out_dir: Path,
               cpus: Sequence[int] | None = None, timeout: float = 1800) -> dict[str, Any]:
    """Run GuideLLM or aiperf once against `base_url`; its row, with the result file's path."""
    out_dir = Path(out_dir) / f"{client}-c{w.concurrency}-s{w.seed}"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}
    if client == "guidellm":
        result = out_dir / "report.json"
        cmd = guidellm_cmd(base_url, model, tokenizer_dir, w, result)
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    elif client == "aiperf":
        result = out_dir / "profile_export_aiperf.json"
        cmd = aiperf_cmd(base_url, model, tokenizer_dir, w, out_dir)
        # aiperf's offline mode looks the tokenizer up in the hub cache only, never in a local
        # directory; online, a directory is read as transformers reads it (nothing is fetched).
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("TRANSFORMERS_OFFLINE", None)
    else:
        raise ValueError(f"run_client runs guidellm or aiperf, not {client!r}")
    result.unlink(missing_ok=True)
    if cpus is not None:
        cmd = ["taskset", "-c", ",".join(str(c) for c in cpus), *cmd]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=out_dir)
    except subprocess.TimeoutExpired as e:
        raise ClientError(f"{client} did not finish in {timeout:.0f}s") from e
    out = run.stdout + run.stderr
    (out_dir / "output.log").write_text(out)
    if run.returncode != 0 or not result.exists():
        raise ClientError(f"{client} failed (exit {run.returncode}), result "
                          f"{'written' if result.exists() else 'not written'}; output tail:\n{out[-TAIL_CHARS:]}")
    data = json.loads(result.read_text())
    row = guidellm_row(data) if client == "guidellm" else aiperf_row(data)
    row["result_file"] = str(result)
    return row
