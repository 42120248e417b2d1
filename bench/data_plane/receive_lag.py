"""Token-streaming loop lag while embeddings arrive: the receive path on the node's loop vs on its own thread.

    python -m bench.data_plane.receive_lag [--senders 8] [--rounds 5] [--image 4K] [--model 72B] [--sender-nice 0]
                                [--json out.json]

--senders sender processes, as that many encoder nodes would be (each the encoder's real send
path from a pre-made embedding: bench/data_plane/transport.py --serve), each send one BF16 embedding of
--image for a --model at the same moment (4K 72B: 10549 rows x 8192, 173 MB). The coordinator's
receiver (an EncoderHandle's channel, AsyncEncoderClient.encode_iter with the image's
expectation, records.embedding_tensor) takes them:

  main    on the loop that also streams tokens (where the coordinator ran before);
  thread  on a loop of its own in another thread (coordinator_thread.LoopThread, as the LLM
          node now runs its coordinator), awaited from the main loop;
  thread+1ms  the same with the GIL switch interval the LLM node sets (coordinator_thread.
          SWITCH_INTERVAL_SECONDS; Python's default is 5 ms).
  region  thread+1ms receiving into the node's shared region (llm_node/embedding_region.py: the
          coordinator's receive buffers on the default --handoff region), each buffer made when
          its first bytes arrive, as when an encoder answers at once (a hit in its cache).
  ahead   the same with the buffers made before the bytes come (client/receive_buffer.py
          PreparedBuffers, as the node's dispatcher makes them while the encoders work; these
          senders send at once, so the bench makes them first);
  making  the making of those buffers, measured alone (the lag it causes while the encoders
          work; MB/s: bytes made per second).

Either way a 1 ms sleeper on the main loop records how late it wakes (bench/data_plane/transport.py's
probe): that lateness is what every token stream on the node waits. The variants alternate
within each round (rotated order); the table has the medians over rounds and the ratio
thread/main per round's medians.

Measured: 2 shared vCPUs, Python 3.11, grpcio 1.85; the eight senders on the same two cores;
`python -m bench.data_plane.receive_lag --rounds 5`:

    main-loop lag of a 1 ms sleeper while 8 x 4K 72B embeddings (172.8 MB each) arrive at once;
    medians of 5 rounds (idle: p50 0.08, p99 0.22, max 2.86 ms)
    receiver on        p50 ms   p99 ms   max ms     MB/s
    main                  4.1     23.0     23.5     1337
    thread                0.4     15.3     28.2      999
    thread+1ms            0.8      7.8     12.8     1757
    thread/main          0.12     0.66     0.77     0.98
    thread+1ms/main      0.21     0.47     0.54     1.31

Another day, with the region variant (idle: p50 0.08, p99 0.11, max 0.18 ms):

    receiver on        p50 ms   p99 ms   max ms     MB/s
    main                  4.2     31.9     38.1     1146
    thread                0.6     10.0     22.7     1821
    thread+1ms            0.7      6.5      9.2     1785
    region                0.6     12.1     24.7     1205
    region/main          0.15     0.38     0.65     1.10

The lag left at 1 ms is the eight sender processes and the receiver sharing two cores with the
sleeper (a receiving host with its own cores has no senders on them). --sender-nice 19 gives the
senders the CPU only when the receiving side does not want it, as on a node whose eight encoders
are other machines; the node's own receiving (its kernel's TCP, gRPC's threads, the copies, the
region's pages) still shares the cores with the sleeper. The same day, side by side:

    `python -m bench.data_plane.receive_lag --rounds 5 --sender-nice 19` (idle: p50 0.09, p99 0.19, max 2.87 ms)
    receiver on        p50 ms   p99 ms   max ms     MB/s
    main                  0.3      6.6     13.2     1009
    thread                0.3      4.3      8.8     1239
    thread+1ms            0.4      3.1      6.6     1876
    region                0.3      3.8     13.1     1181
    region/main          0.84     0.58     0.99     1.17

    `python -m bench.data_plane.receive_lag --rounds 5` (senders at the receiver's priority)
    main                  3.6     25.5     34.9     1052
    thread+1ms            0.7     17.3     38.3     1024
    region                0.8     11.9     23.6     1024
    region/main          0.15     0.49     0.66     1.05

Receiving into the region costs its tmpfs pages being allocated and mapped during the receive
(~100 ms of kernel time per 173 MB here, where the heap recycles freed pages): the same work the
heap route does later, when a request's rows are written into the region on their way to the
engine (llm_node/handoff.py). The node's dispatcher now makes each buffer while the encoder
works (its size is known from the image's grid), so that work is done before the bytes come:
the "ahead" rows, the same day (`--rounds 5 --sender-nice 19`, then `--rounds 5`):

    senders niced 19 (idle: p50 0.08, p99 0.17, max 4.61 ms)
    receiver on        p50 ms   p99 ms   max ms     MB/s
    thread+1ms            0.4      4.1      9.8     1656
    region                0.3      4.4     10.4     1176
    ahead                 0.4      4.0      6.8     1800
    making                0.1      2.6      4.9     3293
    ahead/region         1.38     0.72     0.63     1.48

    senders at the receiver's priority (idle: p50 0.08, p99 0.16, max 5.59 ms)
    thread+1ms            0.6      7.5     13.4     1499
    region                0.7     13.7     27.2     1219
    ahead                 0.8     10.1     30.7     1986
    making                0.1      0.8      3.8     3509
    ahead/region         0.96     0.64     1.25     1.64

Made ahead, the region route moves 1.5-1.6x the bytes per second of making each buffer at its
first bytes, as fast as the heap (thread+1ms) or faster, and the main loop's p99 lag is lower;
making the eight buffers (1.4 GB in two worker threads, about 0.4 s) costs the main loop a p99
of 0.8-2.6 ms meanwhile. A buffer made ahead has one byte per page written (the page faults
then, in the worker thread); mapping it with MAP_POPULATE instead was tried and dropped: that
holds the process's memory map while it fills a whole buffer, and every thread that allocates
waits (region p99 22.7-69 ms, max 244-330 ms, with MAP_POPULATE at the first bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.data_plane.transport import HIDDEN, SIZES, encdis_receive, idle_lag, loop_lag, rows_for  # noqa: E402
from encdis.client.encoder_client import RECEIVE_CHUNK_BYTES  # noqa: E402
from encdis.client.receive_buffer import PreparedBuffers  # noqa: E402
from encdis.llm_node.coordinator_thread import SWITCH_INTERVAL_SECONDS as SWITCH_INTERVAL  # noqa: E402
from encdis.llm_node.coordinator_thread import LoopThread  # noqa: E402
from encdis.llm_node.embedding_region import EmbeddingRegion  # noqa: E402

TRANSPORT = Path(__file__).resolve().parent / "transport.py"


def start_senders(n: int, niceness: int = 0) -> tuple[list[subprocess.Popen], list[str]]:
    procs = [subprocess.Popen(["nice", "-n", str(niceness), sys.executable, str(TRANSPORT), "--serve"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    addresses = []
    for p in procs:
        _tcp_port, grpc_port = map(int, p.stdout.readline().split())
        addresses.append(f"127.0.0.1:{grpc_port}")
    return procs, addresses


async def make_handles(addresses: list[str]) -> list:
    """One EncoderHandle (its own channel) per sender, made on the loop that will use them."""
    from encdis.llm_node.coordinator.handle import EncoderHandle

    return [EncoderHandle(a, "bench", cost_model=None) for a in addresses]


async def close_handles(handles: list) -> None:
    for h in handles:
        await h.channel.close()


async def receive_all(handles: list, rows: int, hidden: int, keep: list, allocate=None) -> None:
    await asyncio.gather(*(encdis_receive(h, rows, hidden, RECEIVE_CHUNK_BYTES, keep, allocate) for h in handles))


async def make_ahead(region: EmbeddingRegion, count: int, nbytes: int, into: list) -> None:
    """`count` region buffers of `nbytes` made as the dispatcher makes them (two worker threads), into `into`."""
    with ThreadPoolExecutor(2, thread_name_prefix="bench-buffers") as executor:
        buffers = PreparedBuffers(region.buffer, [nbytes] * count, executor)
        await asyncio.to_thread(buffers.wait)
    into.append(buffers)


async def with_switch_interval(seconds: float, work) -> None:
    """`work` with the interpreter's GIL switch interval at `seconds` (the LLM node's setting)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        await work
    finally:
        sys.setswitchinterval(before)


async def measure(args: argparse.Namespace) -> dict:
    rows, hidden = rows_for(*SIZES[args.image]), HIDDEN[args.model]
    nbytes = args.senders * rows * hidden * 2
    procs, addresses = start_senders(args.senders, args.sender_nice)
    other = LoopThread("bench-receiver")
    other.start()
    region = EmbeddingRegion()
    try:
        on_main = await make_handles(addresses)
        on_thread = await other.run(make_handles, addresses)
        variants = {
            "main": lambda keep: receive_all(on_main, rows, hidden, keep),
            "thread": lambda keep: other.run(receive_all, on_thread, rows, hidden, keep),
            "thread+1ms": lambda keep: with_switch_interval(
                SWITCH_INTERVAL, other.run(receive_all, on_thread, rows, hidden, keep)),
            "region": lambda keep: with_switch_interval(
                SWITCH_INTERVAL, other.run(receive_all, on_thread, rows, hidden, keep, region.buffer)),
            "ahead": lambda keep: with_switch_interval(
                SWITCH_INTERVAL, other.run(receive_all, on_thread, rows, hidden, keep, keep.pop())),
        }
        making = lambda keep: make_ahead(region, args.senders, rows * hidden * 2, keep)  # noqa: E731
        for name, run in variants.items():  # warm both sets of channels (windows, buffers)
            keep: list = []
            if name == "ahead":
                await making(keep)
            await run(keep)
        idle = await idle_lag()
        results: dict[str, list[dict]] = {name: [] for name in [*variants, "making"]}
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                keep = []  # the variant's tensors; "ahead" takes its buffers from it first
                if name == "ahead":
                    results["making"].append(await loop_lag([making(keep)], nbytes))
                results[name].append(await loop_lag([variants[name](keep)], nbytes))
                keep.clear()
        await other.run(close_handles, on_thread)
        await close_handles(on_main)
        return {"senders": args.senders, "image": args.image, "model": args.model, "rows": rows, "hidden": hidden,
                "mbytes_per_image": rows * hidden * 2 / 1e6, "rounds": args.rounds, "idle": idle, "runs": results}
    finally:
        await other.stop()
        region.close()
        for p in procs:
            p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def summary(result: dict) -> list[dict]:
    rows = []
    for name, runs in result["runs"].items():
        rows.append({"variant": name, **{f"lag_{q}_ms": statistics.median(r["lag_ms"][q] for r in runs)
                                          for q in ("p50", "p99", "max")},
                     "mb_per_s": statistics.median(r["mb_per_s"] for r in runs)})
    for variant, base in (("thread", "main"), ("thread+1ms", "main"), ("region", "main"), ("ahead", "main"),
                          ("ahead", "region")):
        pairs = list(zip(result["runs"][base], result["runs"][variant], strict=True))
        rows.append({"variant": f"{variant}/{base}", **{
            f"lag_{q}_ms": statistics.median(t["lag_ms"][q] / max(m["lag_ms"][q], 1e-6) for m, t in pairs)
            for q in ("p50", "p99", "max")},
            "mb_per_s": statistics.median(t["mb_per_s"] / m["mb_per_s"] for m, t in pairs)})
    return rows


def print_table(result: dict, rows: list[dict]) -> None:
    i = result["idle"]["lag_ms"]
    print(f"\nmain-loop lag of a 1 ms sleeper while {result['senders']} x {result['image']} {result['model']} "
          f"embeddings ({result['mbytes_per_image']:.1f} MB each) arrive at once; medians of {result['rounds']} "
          f"rounds (idle: p50 {i['p50']:.2f}, p99 {i['p99']:.2f}, max {i['max']:.2f} ms)")
    header = f"{'receiver on':16} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'MB/s':>8}"
    print(header, "-" * len(header), sep="\n")
    for r in rows:
        ratio = "/" in r["variant"]
        fmt = "{:>8.2f}" if ratio else "{:>8.1f}"
        print(f"{r['variant']:16} " + " ".join(fmt.format(r[k]) for k in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms"))
              + (f" {r['mb_per_s']:>8.2f}" if ratio else f" {r['mb_per_s']:>8.0f}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--senders", type=int, default=8, help="sender processes (encoders), one embedding each")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--image", choices=sorted(SIZES), default="4K")
    p.add_argument("--model", choices=sorted(HIDDEN), default="72B")
    p.add_argument("--sender-nice", type=int, default=0,
                   help="niceness of the sender processes (19: the receiving node's threads first, as on a node "
                        "whose encoders are other machines)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = asyncio.run(measure(args))
    rows = summary(result)
    print_table(result, rows)
    if args.json:
        args.json.write_text(json.dumps({**result, "summary": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
