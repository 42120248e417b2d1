"""Fleet, live: three coordinators sharing three real encoder nodes on loopback.

Real processes on 127.0.0.1, no fakes: three `encdis encoder` nodes (encdis/launcher.py) on a
tiny checkpoint, and three coordinator processes (bench/fleet/live_node.py). There is no
coordinator-only LLM node, and three vLLM engines do not fit a 2-core machine beside the
encoders, so each "LLM node" here is the REAL coordinator package (encdis.llm_node.coordinator,
built as llm_node/server.py builds it, from CoordinatorSettings, on its own CoordinatorThread)
in its own process, driving its share of the load; no engine, no prefill. Only JSON crosses
between processes: each process makes an image's bytes from its (width, height, seed).

Load: one-image requests (so a request's figures are its image's), sizes from
bench/balancer/workloads.py's heavy-tailed generator scaled by SIZE_SCALE (the tiny checkpoint
caps images at 448x448 pixels' worth, where full-size sizes would all be capped), Poisson
arrivals spread round-robin over the three coordinators, all three loaded at once. The rate is
`--load` x the fleet's capacity, measured first with every coordinator in a closed loop.
Each variant starts fresh coordinators (no learnt costs, empty caches), warmed up with
WARMUP_IMAGES one at a time; image seeds are new in every run, so no run hits a cache an
earlier one filled. Variants are interleaved (their order rotates per repeat); tables show
medians over `--repeats`.

Part 1, balance and hedging (encoders without a cache, so digest affinity is inactive):
    reports off / on       --load-reports off vs on (every coordinator balances on the
                           encoders' ORCA reports, or on its own outstanding work only)
    stop, hedge off / on   one encoder SIGSTOPped for 3 s (at 30% of the arrivals), then
                           SIGCONT; --hedge off vs on (load reports on)
    q+e: queue + encode seconds per image, as Coordinator.encode returns them (the encoder's
    queue time and forward). They cannot see time a call spends before an encoder accepts it
    (a stopped process's socket buffer) or on a losing attempt, so under a stop they
    understate the wait; lat: from an image's due time to its embedding in the coordinator's
    hands, which sees everything, is the figure the hedging goal is judged on.
Part 2, encode once per fleet (encoders with --cache-bytes CACHE_BYTES):
    workload A: `--references` image references drawn Zipf(1.1) from `--distinct` images;
    workload B: every reference distinct; --affinity off vs on. fwd/distinct: tower forwards
    (the encoders' encdis_encoder_images_total; cache hits run none) per distinct image. Each
    coordinator keeps its own embedding cache (CoordinatorSettings' default, 256 MiB, as in an
    LLM node): it answers its own repeats without a network trip, which is part of the real
    system ("coord hits"); what reaches the encoders is the repeats across coordinators.

    python -m bench.fleet.live [--part 1|2|both] [--repeats 3] [--seconds 20] [--load 0.6]
                               [--references 2000] [--distinct 300] [--affinity-slack 1.0]
                               [--quick] [--json FILE]

Heavy: run it alone (it starts six processes on the machine it measures).

Measured: shared 2-core x86 VM (load average 1.5-2.8 around the runs, mostly the benchmark's
own; other sessions' work may have run beside it), torch CPU, tiny checkpoint (its forward:
3-8 ms an image), defaults;
`python -m bench.fleet.live --part 1 --json part1.json`:

    part 1: 3 coordinators x 3 encoders, rate 102.1/s (0.60 x 170.2 measured), 20 s per run, medians of 3
      variant                  q+e p50   q+e p99   lat p50   lat p99      hedges   extra timeouts errors
      reports off                 12.7     109.8      21.1     126.4      0/0       0.0%        0      0
      reports on                  12.3      98.5      20.9     192.3      0/0       0.0%        0      0
        on/off                   0.97x     0.90x     0.99x     1.52x
      stop, hedge off             13.9     136.3      22.2    2007.3      0/0       0.0%       21      0
      stop, hedge on              15.2     132.6      25.8     373.6     39/14      2.3%        0      0
        on/off                   1.09x     0.97x     1.16x     0.19x

`python -m bench.fleet.live --part 2 --json part2.json`:

    part 2: 2000 references (A: Zipf(1.1) over 300), rate 100.1/s, medians of 3
      workload, affinity     fwd/distinct   lat p50   lat p99 enc hits coord hits  fwd per encoder  gap p50  fwd p50
      A, affinity off               1.546       1.4      32.9       86       1547      129/114/129      3.7      3.3
      A, affinity on                1.038       1.4      32.5      207       1547         95/70/78      2.1      2.3
        on/off                      0.67x     0.96x     0.99x
      B, affinity off               1.000      15.4      94.0        0          0      638/739/679     43.8      5.5
      B, affinity on                1.000      13.6      77.8        0          0      640/651/709     33.4      4.8
        on/off                      1.00x     0.89x     0.83x
    per repeat: A on 1.039 / 1.038 / 1.034 forwards per distinct image (233-238 distinct a run);
    B lat p99 off 94 / 148 / 86 ms, on 78 / 83 / 71 ms.

The policy before (a hit priced as waiting out its encoder's whole backlog, nothing asked,
spills decided on the estimated backlogs): A on 1.416 (off 1.550), B p99 1.06x. Steps on the
way, same command: spills on seen backlogs alone 1.172; with Has asked of every forwarded
image once the pool is seen shared, A 1.047 but B p50 1.25x and p99 1.30x (every one of B's
images paid the round trip to two encoders' busy loops on this machine), which the stop after
32 fruitless answers removed (the table above).

Against the goals (ms; "gap": the median spread of the three encoders' predicted backlogs as a
coordinator's assignment sees them; "fwd": an image's median forward):
- Hedging, p99 cut >= 2x with <= 5% extra patches: met in the medians, 5.4x (2007 -> 374 ms)
  with 2.3% extra patches; not in every repeat: with hedging p99 was 103, 374 and 1046 ms, as
  10 images of the third run still waited out the 2 s attempt bound. q+e cannot show the stop
  (the stopped encoder never accepted those calls): lat is the figure.
- Load reports, no goal at 3 LLM nodes: no effect above this machine's noise (lat p99 per
  repeat off 119/126/393 ms, on 192/115/203 ms; q+e p99 0.90x).
- Affinity, forwards/distinct <= 1.05 on A: met, 1.038 (1.546 off; about 1.91 would run without
  encoder caches, each coordinator caching its own repeats).
- Affinity, p99 on B within 1.1x of off: met, 0.83x (B's p99 spans 86-148 ms off per repeat).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.balancer.workloads import request_sizes
from bench.fleet.live_node import Child
from bench.fleet.live_report import goals, medians, part1_table, part2_table, summarize
from encdis.launcher import NodeProcess

REPO = Path(__file__).resolve().parents[2]
COORDINATORS = ENCODERS = 3
SIZE_SCALE = 0.25  # median image ~175 px on its long side; the largest capped at the tiny checkpoint's bound
MIN_SIDE = 28
WARMUP_IMAGES = 9  # per coordinator: hedging wants 8 prediction errors before its margin is learnt
CALIBRATION_CONCURRENCY = 4  # per coordinator: enough to keep every encoder's queue full
STOP_SECONDS, STOP_AT = 3.0, 0.3  # the stop, and when it starts (share of the arrival span)
ZIPF_S = 1.1
CACHE_BYTES = 256 * 1024 * 1024  # part 2's encoder caches: every run's images fit
PART1 = {"reports off": {"load_reports": "off"}, "reports on": {"load_reports": "on"},
         "stop, hedge off": {"hedge": "off"}, "stop, hedge on": {"hedge": "on"}}
AFFINITY = {"affinity off": {"affinity": "off"}, "affinity on": {"affinity": "on"}}


class Fleet:
    """ENCODERS encoder nodes on 127.0.0.1, one torch thread each (three share two cores)."""

    def __init__(self, model: Path, cache_bytes: int, log_dir: Path, tag: str) -> None:
        args = ["encoder", "--model", str(model), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                "--torch-threads", "1", "--cache-bytes", str(cache_bytes)]
        self.nodes = [NodeProcess(args, name=f"{tag}-encoder-{i}", log_dir=log_dir) for i in range(ENCODERS)]
        try:
            for n in self.nodes:
                n.wait_ready(300)
        except BaseException:
            self.stop()
            raise

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def counters(self) -> list[dict[str, float]]:
        return [{"images": n.metric("encdis_encoder_images_total"),
                 "cache_hits": n.metric("encdis_encoder_cache_hits_total"),
                 "dropped": n.metric("encdis_encoder_dropped_images_total"),
                 "batch_seconds": n.metric("encdis_encoder_batch_seconds_sum")} for n in self.nodes]

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                os.kill(n.pid, signal.SIGCONT)  # a stopped node cannot drain
            n.stop(timeout=30)


def deltas(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    each = {k: [a[k] - b[k] for a, b in zip(after, before, strict=True)] for k in before[0]}
    return {"images": sum(each["images"]), "images_each": each["images"], "cache_hits": sum(each["cache_hits"]),
            "dropped": sum(each["dropped"]), "batch_seconds": sum(each["batch_seconds"])}


# -- workloads -------------------------------------------------------------------------------


def image_size(rng: random.Random) -> tuple[int, int]:
    w, h = request_sizes("heavy_tailed", rng)[0]
    return max(MIN_SIDE, round(w * SIZE_SCALE)), max(MIN_SIDE, round(h * SIZE_SCALE))


def arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """Poisson arrival offsets (seconds) of `count` requests at `rate` per second."""
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def round_robin(offsets: list[float], images: list[tuple[int, int, int]]) -> list[list[list[float]]]:
    """Request k to coordinator k mod 3, as a load balancer in front of the LLM nodes would spread them."""
    plans: list[list[list[float]]] = [[] for _ in range(COORDINATORS)]
    for k, (offset, image) in enumerate(zip(offsets, images, strict=True)):
        plans[k % COORDINATORS].append([offset, *image])
    return plans


def warmups(rng: random.Random, seed_base: int) -> list[list[tuple[int, int, int]]]:
    return [[(*image_size(rng), seed_base + 900_000 + 100 * c + j) for j in range(WARMUP_IMAGES)]
            for c in range(COORDINATORS)]


# -- runs ------------------------------------------------------------------------------------


async def hold_stopped(pid: int, at: float, seconds: float) -> None:
    """SIGSTOP `pid` at wall time `at` for `seconds`; SIGCONT also when cancelled."""
    await asyncio.sleep(max(0.0, at - time.time()))
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


async def run_once(children: list[Child], fleet: Fleet, model: Path, settings: dict[str, Any],
                   plans: list[list[list[float]]], warmup: list, *, concurrency: int = 0,
                   stop_at: float | None = None) -> dict[str, Any]:
    """Fresh coordinators with `settings` run their plans at once; encoder counters around the run."""
    base = {"encoders": fleet.addresses, **settings}
    for child, plan, warm in zip(children, plans, warmup, strict=True):
        await child.send({"cmd": "prepare", "model": str(model), "settings": base, "warmup": warm, "plan": plan})
    await asyncio.gather(*(c.reply() for c in children))
    before = await asyncio.to_thread(fleet.counters)
    start = time.time() + 0.5  # every process's clock: all three start together
    for child in children:
        await child.send({"cmd": "go", "start": start, "concurrency": concurrency})
    stopper = None
    if stop_at is not None:
        stopper = asyncio.ensure_future(hold_stopped(fleet.nodes[0].pid, start + stop_at, STOP_SECONDS))
    try:
        replies = await asyncio.gather(*(c.reply() for c in children))
        if stopper is not None:
            await stopper
    finally:
        if stopper is not None:
            stopper.cancel()
    await asyncio.sleep(0.5)  # a cancelled call's images reach the encoders' counters as dropped, not later
    after = await asyncio.to_thread(fleet.counters)
    return {"coordinators": replies, "encoders": deltas(before, after),
            "seconds": max(r["seconds"] for r in replies)}


async def calibrate(children: list[Child], fleet: Fleet, model: Path, seeds: itertools.count, per: int) -> float:
    """Images per second the whole fleet finishes with every coordinator in a closed loop."""
    rng = random.Random(next(seeds))
    base = next(seeds)
    plans = [[[0.0, *image_size(rng), base + 1000 * c + j] for j in range(per)] for c in range(COORDINATORS)]
    run = await run_once(children, fleet, model, {}, plans, warmups(rng, base), concurrency=CALIBRATION_CONCURRENCY)
    return COORDINATORS * per / run["seconds"]


def rotated(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def progress(label: str, s: dict[str, Any]) -> None:
    print(f"  {label:34} lat p50 {s['lat_p50'] * 1e3:7.1f} p99 {s['lat_p99'] * 1e3:7.1f} ms, "
          f"fwd {s['forwards']:.0f}, hedges {s['hedges_sent']:.0f}, errors {s['errors']}"
          + (f" ({s['first_error']})" if s.get("first_error") else ""), file=sys.stderr, flush=True)


async def part1(children: list[Child], model: Path, args: argparse.Namespace, log_dir: Path,
                seeds: itertools.count) -> dict[str, Any]:
    fleet = await asyncio.to_thread(Fleet, model, 0, log_dir, "part1")
    try:
        capacity = await calibrate(children, fleet, model, seeds, args.calibration_images)
        rate = args.load * capacity
        print(f"part 1: capacity {capacity:.1f} images/s, rate {rate:.1f}/s", file=sys.stderr, flush=True)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PART1}
        for r in range(args.repeats):
            rng = random.Random(args.seed * 1000 + r)
            offsets = arrivals(rate, max(1, round(rate * args.seconds)), rng)
            sizes = [image_size(rng) for _ in offsets]
            for name in rotated(list(PART1), r):
                base = next(seeds)
                plans = round_robin(offsets, [(w, h, base + k) for k, (w, h) in enumerate(sizes)])
                stop_at = STOP_AT * offsets[-1] if name.startswith("stop") else None
                run = await run_once(children, fleet, model, PART1[name], plans, warmups(rng, base), stop_at=stop_at)
                runs[name].append(summarize(run))
                progress(f"repeat {r + 1} {name}", runs[name][-1])
    finally:
        await asyncio.to_thread(fleet.stop)
    return {"capacity_images_per_s": capacity, "rate_per_s": rate, "runs": runs,
            "medians": {name: medians(v) for name, v in runs.items()}}


def references(workload: str, args: argparse.Namespace, rng: random.Random) -> tuple[list[int], list[tuple]]:
    """(picks, sizes): reference k is image picks[k], whose size is sizes[picks[k]]."""
    if workload == "A":
        sizes = [image_size(rng) for _ in range(args.distinct)]
        weights = [1.0 / (k + 1) ** ZIPF_S for k in range(args.distinct)]
        return rng.choices(range(args.distinct), weights=weights, k=args.references), sizes
    return list(range(args.references)), [image_size(rng) for _ in range(args.references)]


async def part2(children: list[Child], model: Path, args: argparse.Namespace, log_dir: Path,
                seeds: itertools.count) -> dict[str, Any]:
    fleet = await asyncio.to_thread(Fleet, model, CACHE_BYTES, log_dir, "part2")
    try:
        capacity = await calibrate(children, fleet, model, seeds, args.calibration_images)
        rate = args.load * capacity
        print(f"part 2: capacity {capacity:.1f} images/s, rate {rate:.1f}/s", file=sys.stderr, flush=True)
        runs: dict[str, list[dict[str, Any]]] = {f"{w}, {a}": [] for w in "AB" for a in AFFINITY}
        for r in range(args.repeats):
            for workload in "AB":
                rng = random.Random(args.seed * 1000 + 100 + 2 * r + (workload == "B"))
                picks, sizes = references(workload, args, rng)
                offsets = arrivals(rate, len(picks), rng)
                for name in rotated(list(AFFINITY), r):
                    base = next(seeds)  # new pixels: the encoders' caches hold nothing of this run
                    images = [(*sizes[i], base + i) for i in picks]
                    settings = {**AFFINITY[name], "affinity_slack": args.affinity_slack}
                    run = await run_once(children, fleet, model, settings, round_robin(offsets, images),
                                         warmups(rng, base))
                    run["distinct"] = len(set(picks))
                    runs[f"{workload}, {name}"].append(summarize(run))
                    progress(f"repeat {r + 1} {workload}, {name}", runs[f"{workload}, {name}"][-1])
    finally:
        await asyncio.to_thread(fleet.stop)
    return {"capacity_images_per_s": capacity, "rate_per_s": rate, "runs": runs,
            "medians": {name: medians(v) for name, v in runs.items()}}


async def bench(args: argparse.Namespace, model: Path, log_dir: Path) -> dict[str, Any]:
    children = [await Child.start(i, log_dir, REPO) for i in range(COORDINATORS)]
    seeds = itertools.count(args.seed * 10**9 + 10**6, 10**6)  # each run's images: a block of seeds of its own
    result: dict[str, Any] = {}
    try:
        if args.part in ("1", "both"):
            result["part1"] = await part1(children, model, args, log_dir, seeds)
        if args.part in ("2", "both"):
            result["part2"] = await part2(children, model, args, log_dir, seeds)
    finally:
        await asyncio.gather(*(c.close() for c in children))
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("1", "2", "both"), default="both")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=20.0, help="part 1: seconds of arrivals per run")
    p.add_argument("--load", type=float, default=0.6, help="arrival rate as a share of the measured capacity")
    p.add_argument("--references", type=int, default=2000, help="part 2: requests per run")
    p.add_argument("--distinct", type=int, default=300, help="part 2, workload A: distinct images")
    p.add_argument("--affinity-slack", type=float, default=1.0, help="part 2: the coordinators' --affinity-slack")
    p.add_argument("--calibration-images", type=int, default=40, help="per coordinator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: a new tiny one)")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures and the medians here")
    p.add_argument("--quick", action="store_true", help="a smoke run of a minute or two")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.seconds, args.references, args.distinct, args.calibration_images = 1, 6.0, 150, 50, 12
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="encdis-fleet-live-"))
    model = args.model
    if model is None:
        from encdis.tiny_checkpoint import make_tiny_checkpoint

        model = make_tiny_checkpoint(log_dir / "tiny", seed=0)
    print(f"logs in {log_dir}", file=sys.stderr, flush=True)
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    result = asyncio.run(bench(args, model, log_dir))
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    lines = []
    if "part1" in result:
        p = result["part1"]
        lines += part1_table(p["medians"], f"part 1: {COORDINATORS} coordinators x {ENCODERS} encoders, rate "
                             f"{p['rate_per_s']:.1f}/s ({args.load:.2f} x {p['capacity_images_per_s']:.1f} measured), "
                             f"{args.seconds:.0f} s per run, medians of {args.repeats}")
    if "part2" in result:
        p = result["part2"]
        lines += part2_table(p["medians"], f"part 2: {args.references} references (A: Zipf({ZIPF_S}) over "
                             f"{args.distinct}), rate {p['rate_per_s']:.1f}/s, medians of {args.repeats}")
    lines += ["goals:", *goals({**result.get("part1", {}).get("medians", {}),
                                **result.get("part2", {}).get("medians", {})})]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, **result}, indent=2))
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
