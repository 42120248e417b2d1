"""Serving benchmark: `vllm bench serve` against monolithic vLLM and against encdis, on the same cores.

Three systems serve the same tiny checkpoint and vLLM's own benchmark client
(bench/serving/vllm_bench.py: random-mm, one synthetic image per request, fixed lengths, ignore_eos)
drives each over its OpenAI-compatible HTTP API:

  (a) vllm       monolithic `vllm serve` (tower loaded), confined with taskset to the CPU set S;
  (b) encdis     two encoder nodes + one LLM node, every process confined to S;
  (c) encdis+E   the LLM node on S, its two encoders on the extra cores E (outside S).

Threads are set so nothing oversubscribes its cores: OMP_NUM_THREADS (torch's threads) is
the size of the process's CPU set, vLLM's OpenMP threads are bound to it
(VLLM_CPU_OMP_THREADS_BIND), an encoder's preprocessing pool is no larger. The client runs
on the cores outside S (it is no part of the system under test; on a 2-core machine it
shares E with (c)'s encoders). All three are started first (the idle ones take a few % of
a core, reported), warmed up, then the runs are interleaved: each round runs every
--concurrency on every system in a rotated order, with a new seed per (round, concurrency)
shared by the three (same requests; no cache hit carries over), so drifts in the machine's
other load hit all of them alike; with --repeats N the table has each metric's median.

Printed: requests/s, mean/median/p99 time to first token and mean time per output token,
each with its ratio to (a) at the same concurrency; the goals with PASS/MISS; for (b) and
(c) the LLM node's mean time split per request (Prometheus histograms
encdis_request_*_seconds, differenced around each run): queue/preprocess/encode/transfer
(coordinator and encoders; preprocess is the encoder's decoding and preprocessing, which
tables measured before it was reported apart count in queue), prefill/decode (vLLM), other
(rendering, waits), and front = the client's TTFT minus the node's own (HTTP, JSON, base64,
SSE); for (a) the same from vLLM's own histograms (vllm:request_queue_time_seconds, _prefill_,
_decode_, e2e latency, time to first token): its tower's forward is inside its prefill, its
image preprocessing inside its other; and the servers' CPU time per request by role (read from
/proc around the measured requests only), with how busy each role kept its cores.

    python -m bench.serving.serve [--model DIR] [--cpus 0] [--extra-cpus 1] [--concurrency 1,8]
                                  [--num-prompts 16] [--input-len 64] [--output-len 16] [--image-size 224]
                                  [--repeats 1] [--clients vllm] [--json out.json]

Two more standard clients can drive every system beside it: `bash scripts/setup_bench_clients.sh`,
then `python -m bench.serving.serve --clients vllm,guidellm,aiperf`. GuideLLM and aiperf
(bench/serving/clients.py) run right after `vllm bench serve` on the same system, concurrency and
seed, with the same workload as far as they allow: GuideLLM sends no text, only the image (its
synthetic image data has no prompt), and each client draws its own random images and text. One
more table gives every client's req/s, mean/p99 TTFT, mean TPOT (GuideLLM's and aiperf's
inter-token latency, the same quantity) and counts, each with its ratio to vllm as measured by
the same client.

Measured: the tables of every kind of run (the three clients side by side; medians of 3 with
the goals, the node's split and CPU per request; the split with preprocessing apart; monolithic
vLLM's own split beside encdis's) are in bench/README.md (Serving). What they showed: the three
clients agree on (b), 0.84-0.88x the req/s and 1.7x the TTFT in one short run; on (c) the
clients differ more, as the client shares E with (c)'s encoders on two cores. At c=1 an image
waits for nothing (queue 0.0): what the oldest table calls queue there was the encoder decoding
and preprocessing the image.

`vllm serve` spends other + front = 13.0 ms of a c=1 request outside its queue and prefill (its
tower's forward is in prefill); its other holds its image preprocessing (the encoder's preprocess:
3.0 ms on a core of its own, 6.8 ms beside vLLM), so 6-10 ms is overhead of the kind encdis's
transfer + other + front is (9.2 ms encdis+1, 11.5 ms encdis): above 5 ms for both on this machine.

What limits (b) on one core: the same image's tower forward takes 29 ms on core 0 beside
the LLM node and 13 ms on a core of its own. vLLM's worker busy-polls its shared-memory
queue (sched_yield, for 1 s after every step), so any other process on its core gets only
part of it while vLLM is active: a CPU loop on core 0 ran at 0.46-0.74x speed right after a
request to an otherwise idle `vllm serve` compared with 2 s later. Monolithic vLLM runs its
tower inside that worker and pays nothing; (b) pays it on every encode, which is most of its
+18 ms TTFT at c=1 (queue + encode + transfer 37 ms before prefill, against 18 ms in (c)).
At c=8 the CPU per request is about the same (1.0-1.2x of vLLM's), so (b)'s throughput is
within noise of (a) or below by that factor. At c=1 decode is ~2/3 of a request and runs on
S in every system, so the encoders' own core cannot give (c) 1.2x there; at c=8 it does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.serving.clients import ROW_KEYS, Workload, missing_clients, parse_clients, run_client, vllm_row  # noqa: E402
from bench.serving.report import (  # noqa: E402
    COLUMNS,
    client_ratios,
    clients_text,
    cpu_text,
    goals,
    goals_text,
    ratio,
    split_text,
    table,
)
from bench.serving.systems import (  # noqa: E402
    OFFLINE_ENV,
    System,
    cpu_list,
    cpu_seconds,
    parse_cpus,
    source_tree_env,
    stage_means_ms,
    stage_sums,
    start_encdis,
    start_vllm,
    vllm_stage_sums,
)
from bench.serving.vllm_bench import MAIN_RUN_ENDS, MAIN_RUN_STARTS, run_vllm_bench  # noqa: E402

# vLLM's result keys kept per run (times in ms).
RESULT_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_input_tokens",
               "total_output_tokens", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
               "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "p99_e2el_ms")


def run_once(system: System, everyone: Sequence[System], args: argparse.Namespace, c: int, seed: int,
             client_cpus: list[int], out_dir: Path) -> dict:
    """One `vllm bench serve` run: vLLM's numbers, the node's time split, CPU time per request."""
    # The node's split for encdis, vLLM's own histograms for monolithic vLLM.
    sums = (lambda: stage_sums(system.llm)) if system.llm else (lambda: vllm_stage_sums(system.base_url))
    before = sums()
    marks: dict[str, tuple[float, dict[str, dict[str, float]]]] = {}

    def on_output(line: str) -> None:
        # CPU time is read around the measured requests only: the client's start-up (tens of
        # seconds of imports and synthetic images) would add the servers' idle cost to it.
        if MAIN_RUN_STARTS in line:
            marks["start"] = (time.monotonic(), cpu_seconds(everyone))
        elif MAIN_RUN_ENDS in line:
            marks["end"] = (time.monotonic(), cpu_seconds(everyone))

    r = run_vllm_bench(system.base_url, system.model, system.model, num_prompts=args.num_prompts, max_concurrency=c,
                       out_dir=out_dir / system.name, seed=seed, input_len=args.input_len,
                       output_len=args.output_len, image_size=args.image_size, cpus=client_cpus, env=OFFLINE_ENV,
                       on_output=on_output)
    if set(marks) != {"start", "end"}:
        raise RuntimeError(f"vllm bench serve did not print both {MAIN_RUN_STARTS!r} and {MAIN_RUN_ENDS!r}: "
                           "cannot tell its measured part")
    (t0, cpu0), (t1, cpu1) = marks["start"], marks["end"]
    row: dict[str, Any] = {k: r.get(k) for k in RESULT_KEYS}
    done = max(1, r["completed"])
    used = {role: cpu1[system.name][role] - cpu0[system.name][role] for role in system.groups}
    row["cpu_ms_per_request"] = {role: 1000 * v / done for role, v in used.items()}
    # Busy fraction of each role's cores: near 1.0 means that role is CPU-bound.
    row["cpu_busy"] = {role: v / (t1 - t0) / len(system.cpus[role]) for role, v in used.items()}
    # What the idle systems waiting their turn took meanwhile (they share the cores), per second.
    row["idle_others_cpu_per_s"] = sum(cpu1[o.name][role] - cpu0[o.name][role] for o in everyone
                                       if o is not system for role in o.groups) / (t1 - t0)
    row["split_ms"] = stage_means_ms(before, sums(), r["mean_ttft_ms"])
    print(f"  {system.name} c={c} seed={seed}: {r['request_throughput']:.2f} req/s, mean TTFT "
          f"{r['mean_ttft_ms']:.1f} ms, {r['completed']} done, {r['failed']} failed", flush=True)
    return row


def median_of(rows: list[Any]) -> Any:
    """Per-key median of several runs' records (nested dicts too); counts are summed."""
    if isinstance(rows[0], dict):
        return {k: median_of([r[k] for r in rows]) for k in rows[0]}
    if rows[0] is None:
        return None
    return float(statistics.median(rows))


def start_system(name: str, start: Callable[[System], None], cpus: dict[str, list[int]], model: str,
                 running: list[System]) -> System:
    system = System(name=name, base_url="", model=model, cpus=cpus)
    running.append(system)  # stopped by the caller, also when it fails to start
    t0 = time.monotonic()
    start(system)
    confined = system.confinement()
    print(f"{name}: ready in {time.monotonic() - t0:.0f}s at {system.base_url}; cores allowed "
          + ", ".join(f"{r} {cpu_list(c)}" for r, c in confined.items()), flush=True)
    for role, want in cpus.items():
        if not set(confined.get(role, [])) <= set(want):
            raise RuntimeError(f"{name}: {role} may run on cores {confined[role]}, not only {want}")
    return system


def benchmark(systems: list[System], args: argparse.Namespace, client_cpus: list[int],
              out_dir: Path) -> dict[str, dict]:
    """Warm every system up, then interleave the runs: each round runs every concurrency on every
    system (in a rotated order), so slow drifts in the machine's other load hit all of them alike."""
    top = max(args.concurrency)
    for s in systems:
        run_vllm_bench(s.base_url, s.model, s.model, num_prompts=top, max_concurrency=top,
                       out_dir=out_dir / s.name / "warmup", seed=args.seed + 1000, input_len=args.input_len,
                       output_len=args.output_len, image_size=args.image_size, cpus=client_cpus, env=OFFLINE_ENV)
    runs: dict[str, dict[int, list[dict]]] = {s.name: {c: [] for c in args.concurrency} for s in systems}
    others: dict[str, dict[str, dict[int, list[dict]]]] = {
        s.name: {client: {c: [] for c in args.concurrency} for client in args.clients[1:]} for s in systems}
    for rnd in range(args.repeats):
        for i, c in enumerate(args.concurrency):
            # A new seed per run: new random images and text, so no cache hit carries over.
            seed = args.seed + rnd * len(args.concurrency) + i
            k = (rnd + i) % len(systems)
            for s in systems[k:] + systems[:k]:
                runs[s.name][c].append(run_once(s, systems, args, c, seed, client_cpus, out_dir))
                for client in args.clients[1:]:  # the other clients: same system, same workload
                    w = Workload(args.num_prompts, c, args.input_len, args.output_len, args.image_size, seed)
                    row = run_client(client, s.base_url, s.model, s.model, w, out_dir / s.name, client_cpus)
                    print(f"  {s.name} c={c} {client}: {row['request_throughput']:.2f} req/s, mean TTFT "
                          f"{row['mean_ttft_ms']:.1f} ms, {row['completed']} done, {row['failed']} failed", flush=True)
                    others[s.name][client][c].append(row)
    out = {}
    for s in systems:
        by_c = {}
        for c, rows in runs[s.name].items():
            agg = median_of(rows)
            agg["completed"] = sum(r["completed"] for r in rows)
            agg["failed"] = sum(r["failed"] for r in rows)
            agg["runs"] = rows
            by_c[c] = agg
        clients = {"vllm": {c: vllm_row(by_c[c]) for c in args.concurrency}}
        for client, by_c_rows in others[s.name].items():
            clients[client] = {c: client_median(rows) for c, rows in by_c_rows.items()}
        out[s.name] = {"cpus": s.cpus, "cores_allowed": s.confinement(), "by_concurrency": by_c, "clients": clients}
    return out


def client_median(rows: list[dict]) -> dict:
    """One client's runs at one concurrency: each figure's median, the counts summed."""
    agg = median_of([{k: r[k] for k in ROW_KEYS} for r in rows])
    return agg | {"completed": sum(r["completed"] for r in rows), "failed": sum(r["failed"] for r in rows),
                  "runs": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: a tiny one built in a temp dir)")
    p.add_argument("--cpus", default="0", help="the CPU set S every system runs on (default: core 0)")
    p.add_argument("--extra-cpus", default=None,
                   help="cores for (c)'s encoders, outside S (default: the lowest core not in S)")
    p.add_argument("--client-cpus", default=None, help="cores of the benchmark client (default: those not in S)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64, help="random text tokens per request (image tokens extra)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--image-size", type=int, default=224, help="side of each request's square random image")
    p.add_argument("--encoders", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="rounds of runs; the table has each metric's median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--log-dir", type=Path, default=None, help="node logs and vLLM's result files (default: temp)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="another encdis source tree (e.g. a worktree of an earlier commit): adds system (d) "
                        "encdis-before, set up as (b), and the ratios of (b) to it")
    p.add_argument("--clients", default="vllm",
                   help="benchmark clients run on every system, comma-separated from vllm,guidellm,aiperf "
                        "(vllm always runs; the others need scripts/setup_bench_clients.sh)")
    args = p.parse_args(argv)
    try:
        args.clients = parse_clients(args.clients)
    except ValueError as e:
        p.error(str(e))
    if missing_clients(args.clients):
        p.error(f"not installed: {', '.join(missing_clients(args.clients))} (bash scripts/setup_bench_clients.sh)")

    online = sorted(os.sched_getaffinity(0))
    s_cpus = parse_cpus(args.cpus)
    rest = [c for c in online if c not in s_cpus]
    extra = parse_cpus(args.extra_cpus) if args.extra_cpus else rest[:1]
    client = parse_cpus(args.client_cpus) if args.client_cpus else rest
    if not s_cpus or not set(s_cpus) <= set(online):
        p.error(f"--cpus {args.cpus} is not a subset of the usable cores {cpu_list(online)}")
    if not extra or set(extra) & set(s_cpus):
        p.error("(c) needs at least one core outside --cpus (--extra-cpus)")
    if not client:
        client = online
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="encdis-serve-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from encdis.tiny_checkpoint import make_tiny_checkpoint

        args.model = make_tiny_checkpoint(log_dir / "tiny", seed=0, shards=3)
    # A SIGTERM must run the finally blocks that stop every server, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    extra_name = f"encdis+{cpu_list(extra)}"
    print(f"S = cores {cpu_list(s_cpus)}, (c)'s encoders on {cpu_list(extra)}, client on {cpu_list(client)}; "
          f"logs in {log_dir}", flush=True)
    model, timeout = str(args.model), args.startup_timeout
    plans: list[tuple[str, Callable[[System], None], dict[str, list[int]]]] = [
        ("vllm", lambda s: start_vllm(s, model, s_cpus, log_dir, timeout), {"vllm": s_cpus}),
        ("encdis", lambda s: start_encdis(s, model, s_cpus, s_cpus, args.encoders, log_dir, timeout),
         {"llm": s_cpus, "encoders": s_cpus}),
        (extra_name, lambda s: start_encdis(s, model, s_cpus, extra, args.encoders, log_dir, timeout),
         {"llm": s_cpus, "encoders": extra}),
    ]
    if args.baseline_src is not None:
        before_env = source_tree_env(args.baseline_src, log_dir / "baseline-src")
        plans.append(("encdis-before", lambda s: start_encdis(s, model, s_cpus, s_cpus, args.encoders, log_dir,
                                                             timeout, extra_env=before_env),
                      {"llm": s_cpus, "encoders": s_cpus}))
    running: list[System] = []
    try:
        for name, start, cpus in plans:
            start_system(name, start, cpus, model, running)
        systems = benchmark(running, args, client, log_dir)
    finally:
        for s in reversed(running):
            s.stop()

    print()
    print(table(systems, args.concurrency))
    print()
    goal_rows = goals(systems, args.concurrency, extra_name)
    print(goals_text(goal_rows))
    print()
    print("time split, mean ms per request (front = client TTFT - the server's own; vllm: its own histograms, "
          "its tower's forward inside prefill, its image preprocessing inside other):")
    print(split_text(systems, args.concurrency))
    print()
    print("server CPU ms per request (all processes of each role, user + system; busy = share of its cores):")
    print(cpu_text(systems, args.concurrency))
    idle = max(r["idle_others_cpu_per_s"] for s in systems.values() for c in s["by_concurrency"].values()
               for r in c["runs"])
    print(f"idle systems waiting their turn took at most {100 * idle:.1f}% of a core during another's run")
    if len(args.clients) > 1:
        print()
        print("every client on every system (ratio to vllm with the same client; TPOT = GuideLLM's and aiperf's ITL):")
        print(clients_text(systems, args.concurrency, args.clients))
    if args.baseline_src is not None:
        print()
        print("encdis over encdis-before (the same system from --baseline-src), same runs:")
        for c in args.concurrency:
            now, before = systems["encdis"]["by_concurrency"][c], systems["encdis-before"]["by_concurrency"][c]
            print(f"  c={c}: " + ", ".join(f"{k} {ratio(now[k], before[k]):.3f}x" for k, _ in COLUMNS))
    ratios = {name: {c: {k: ratio(s["by_concurrency"][c][k], systems["vllm"]["by_concurrency"][c][k])
                         for k, _ in COLUMNS} for c in args.concurrency} for name, s in systems.items()}
    result = {
        "systems": systems, "ratios_to_vllm": ratios, "goals": goal_rows,
        "client_ratios_to_vllm": client_ratios(systems, args.concurrency, args.clients),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"cpus": s_cpus, "extra_cpus": extra, "client_cpus": client},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                 "loadavg": os.getloadavg()},
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"written to {args.json}")
    failed = sum(r["failed"] or 0 for s in systems.values() for by_c in s["clients"].values() for r in by_c.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
