"""Embedding data plane over gRPC at real sizes: encdis's send + receive path vs raw TCP and bare gRPC.

    python -m bench.data_plane.transport [--rounds 9] [--chunk-bytes 1048576] [--json out.json]
                              [--lag-images 8] [--lag-chunk-bytes 262144,1048576,4194304] [--no-lag]

Three ways to move one image's BF16 embedding (hidden 3584 = 7B, 8192 = 72B; rows of 448x448,
1920x1080, 3840x2160 after Qwen2.5-VL's smart_resize, patches.py) from a sender process to this
one over 127.0.0.1, into memory the receiver can hand on:

  tcp    raw TCP: one socket, sendall() of the bytes, recv_into() a preallocated buffer;
  bare   the gRPC ceiling: one grpc.aio server stream of pre-made byte chunks, copied into a
         preallocated buffer; nothing of encdis;
  encdis the project's path: the encoder servicer's send code minus the tower
         (servicer.reply_frames from a pre-made tensor, registered by add_encoder_service, the
         encoder node's server options) and the coordinator's receiver (an EncoderHandle's
         channel and AsyncEncoderClient.encode_iter with per-image expectations, then
         records.embedding_tensor: the torch tensor handed to the engine).

The sender runs in its own process (`--serve`), as an encoder node does. Modes alternate within
each round (load drifts within seconds); a cell is the median MB/s per mode and the median of
the per-round ratios, after one uncounted warm-up round.

Event-loop lag: a probe task on the receiving loop sleeps 1 ms and records how late it wakes
(wall) and how much CPU the loop's thread spent meanwhile (the work on the loop), while
--lag-images 4K 72B embeddings (173 MB each) arrive at once, one Encode call each; for the
encdis receive path and for bare streams (copied inline), per chunk size; full garbage
collections during a row are listed (the process's own pauses, not the receive path's).

Measured (`python -m bench.data_plane.transport --rounds 9`, 1 MiB chunks, the coordinator's): the
table of MB/s is in bench/README.md (Data plane); encdis moves 0.85-0.98x the bare gRPC stream,
and raw TCP itself moves only 1.3-2.7 GB/s on this machine (an earlier 9-round run: encdis/bare
0.78-1.03, encdis/tcp 0.19-0.84, bare/tcp 0.22-0.97). Event-loop lag, the same day:

    lag, 8 x 4K 72B at once: wall p50/p99/max | loop CPU p50/p99/max, ms; MB/s; loop CPU ms/100MB
    idle                 0.16  0.69    2.3 | 0.09  0.24   0.9
    encdis  256 KiB      0.44  8.07   13.4 | 0.82  3.69  10.4    690   65.6
    bare    256 KiB      1.33 10.16   16.6 | 1.13  5.25  14.1    835   60.9
    encdis  1 MiB        0.17  9.77   43.5 | 0.10  4.19  19.7    446   53.8
    bare    1 MiB        4.73 30.68   36.2 | 3.20 30.35  37.2   1195   54.6
    encdis  4 MiB        0.16 29.89  243.1 | 0.09 11.31  82.3    502   57.3
    bare    4 MiB        0.23 45.00   59.5 | 0.11 28.11  43.1   1005   54.3
    (no full GC in any row; other runs of the encdis 1 MiB row: wall p99 5.3-19 ms, loop CPU
    p99 2.4-8 ms, 290-1200 MB/s, and now and then a stall of 50-540 ms wall, 20-160 ms of loop
    CPU, at every chunk size)

Against the goals: encdis is 0.85-0.98x the bare ceiling (under 0.9 for the smallest
embeddings, where a call's fixed cost counts). 0.8x raw TCP is missed wherever gRPC's own
ceiling is below it, here every cell but the largest (bare/tcp 0.22-0.91): a gRPC stream
spends its CPU on HTTP/2 framing and flow control, reads into slices, and its Python layer
joining each message's slices into one bytes object (three copies, on the receiving loop);
raw TCP's bytes go from the kernel straight into the buffer. Event-loop lag p99 is 5-10 ms at
1 MiB, not under 5 ms: the loop's work is gRPC's per-message delivery (about 0.4 ms of loop
CPU per MiB, as in the bare rows), and with the sender on the same two cores it also waits
for a core.

Levers, each measured (with this bench or a variant of it) and kept only when it helped:
- pre-serialised frames on the sender (wire.embedding_frames: one join per chunk, served by a
  pass-through serializer) instead of protobuf messages: the protobuf send alone (bytes per
  chunk, message objects, serialise) ran at 0.56-0.71 GB/s, the frames at 3.7-6.7 GB/s; kept;
- chunk data found in place in the received bytes (no deserializer), one copy into a buffer
  sized from the header, on a worker thread: the protobuf receive alone (parse, field copy,
  bytearray growth, bytes()) ran at 0.29-0.31 GB/s; kept; copying inline on the loop instead
  put the buffer's page faults on the loop (the bare rows: loop CPU p99 up to 30-50 ms);
- chunk 0 in the header's message (EncodeResponse.first_chunk): a separate small message
  first cost a 4 MB bare stream 1.3-2.9 ms (8.5 vs 5.6 ms at 1 MiB chunks); kept;
- chunk size: 1 MiB and 4 MiB moved the same within the noise on one stream; with eight
  streams 4 MiB made the loop's longest callbacks 2-3x longer and 256 KiB cost 1.2-2.5x the
  loop CPU per byte and moved less; 1 MiB kept (client.encoder_client.RECEIVE_CHUNK_BYTES);
- several streams for one embedding (4 streams, on one or four connections) and 2 or 4
  connections per encoder for eight concurrent embeddings: 0.3-1.2x of one connection, no
  gain beyond the noise on this CPU-bound machine; one connection kept, no protocol change to
  split an image over calls;
- HTTP/2 window options (BDP probing off, 64 MiB lookahead, 16 MiB frames) and TCP read-size
  options (tcp_min/max_read_chunk_size): within the noise; gRPC's defaults kept;
- receiving with gRPC's blocking API on a thread (a prototype): the loop's own CPU p99 fell
  to 0.6-0.8 ms, but wall lag stayed 12-22 ms (GIL and cores shared) and it moved 350-520
  against 600-1080 MB/s; not kept;
- 1 or 2 copy threads: the same within the noise; 1 kept.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from encdis.client.encoder_client import RECEIVE_CHUNK_BYTES

MiB = 1024 * 1024
SIZES = {"448x448": (448, 448), "1080p": (1920, 1080), "4K": (3840, 2160)}
HIDDEN = {"7B": 3584, "72B": 8192}
# Qwen2.5-VL's processor defaults (preprocessor_config.json of the released checkpoints).
MIN_PIXELS, MAX_PIXELS, MERGE = 3136, 12845056, 2
BARE_METHOD = "/bench.Bare/Stream"
MAX_CHUNK = 16 * MiB


def rows_for(width: int, height: int) -> int:
    from encdis.llm_node.coordinator.patches import grid_for_image

    t, h, w = grid_for_image(width, height, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return t * h * w // MERGE**2


# ---- the sender process ------------------------------------------------------------------


def serve() -> None:
    """Raw TCP sender, bare gRPC stream and the encoder's send path; ports on stdout; exits with stdin."""
    import torch

    from encdis.client.pb import encoder_pb2_grpc
    from encdis.encoder_node.server import server_options
    from encdis.encoder_node.servicer import add_encoder_service, reply_frames
    from encdis.encoder_node.settings import EncoderSettings

    largest = max(rows_for(*s) for s in SIZES.values()) * max(HIDDEN.values()) * 2
    payload = memoryview(np.random.default_rng(0).integers(0, 256, largest, dtype=np.uint8))
    tensors: dict[tuple[int, int], torch.Tensor] = {}
    premade: dict[tuple[int, int], list[bytes]] = {}

    class TowerlessEncoder(encoder_pb2_grpc.EncoderServiceServicer):
        """The encoder's send path from a pre-made embedding; images[i] names its shape: b"rows,hidden"."""

        async def Encode(self, request, context):
            for i, spec in enumerate(request.images):
                rows, hidden = map(int, bytes(spec).split(b","))
                if (rows, hidden) not in tensors:
                    data = bytearray(payload[:rows * hidden * 2])
                    tensors[rows, hidden] = torch.frombuffer(data, dtype=torch.bfloat16).view(rows, hidden)
                for frame in reply_frames(i, (1, 2, 2 * rows), "", tensors[rows, hidden], "BF16",
                                          request.max_chunk_bytes):
                    yield frame

    async def bare(request: bytes, context):
        total, chunk = struct.unpack("<QQ", request)
        if (total, chunk) not in premade:
            premade[total, chunk] = [bytes(payload[i:min(i + chunk, total)]) for i in range(0, total, chunk)]
        for c in premade[total, chunk]:
            yield c

    listener = socket.create_server(("127.0.0.1", 0))

    def tcp_sender(conn: socket.socket) -> None:
        with conn:
            while (head := conn.recv(8, socket.MSG_WAITALL)) and len(head) == 8:
                conn.sendall(payload[:struct.unpack("<Q", head)[0]])

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=tcp_sender, args=(conn,), daemon=True).start()

    async def run() -> None:
        server = grpc.aio.server(options=server_options(EncoderSettings(model=Path("."), max_chunk_bytes=MAX_CHUNK)))
        add_encoder_service(TowerlessEncoder(), server)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Bare", {"Stream": grpc.unary_stream_rpc_method_handler(bare)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        threading.Thread(target=accept, daemon=True).start()
        print(listener.getsockname()[1], port, flush=True)
        await asyncio.to_thread(sys.stdin.read)  # the parent closed our stdin: stop
        await server.stop(None)

    asyncio.run(run())


# ---- the receiving side (this process) ---------------------------------------------------


def tcp_receive(sock: socket.socket, nbytes: int) -> float:
    buf = memoryview(np.empty(nbytes, dtype=np.uint8))
    t0 = time.perf_counter()
    sock.sendall(struct.pack("<Q", nbytes))
    got = 0
    while got < nbytes:
        got += sock.recv_into(buf[got:], nbytes - got)
    return time.perf_counter() - t0


async def bare_receive(channel: grpc.aio.Channel, nbytes: int, chunk: int, keep: list | None = None) -> float:
    buf = np.empty(nbytes, dtype=np.uint8)
    if keep is not None:
        keep.append(buf)
    t0 = time.perf_counter()
    off = 0
    async for m in channel.unary_stream(BARE_METHOD)(struct.pack("<QQ", nbytes, chunk)):
        buf[off:off + len(m)] = np.frombuffer(m, dtype=np.uint8)
        off += len(m)
    assert off == nbytes
    return time.perf_counter() - t0


async def encdis_receive(handle, rows: int, hidden: int, chunk: int, keep: list | None = None, allocate=None) -> float:
    from encdis.client.wire import ExpectedEmbedding
    from encdis.llm_node.coordinator.records import embedding_tensor

    expected = [ExpectedEmbedding(rows, hidden, "BF16", 4 * rows)]
    t0 = time.perf_counter()
    async for emb in handle.client.encode_iter([f"{rows},{hidden}".encode()], max_chunk_bytes=chunk,
                                               expected=expected, allocate=allocate):
        tensor = embedding_tensor(emb)
    seconds = time.perf_counter() - t0
    assert tensor.shape == (rows, hidden)
    if keep is not None:
        keep.append(tensor)  # handed on, not freed here (unmapping 173 MB takes the loop tens of ms)
    return seconds


def _quantiles(xs: list[float]) -> dict[str, float]:
    ms = sorted(x * 1e3 for x in xs)
    return {"p50": ms[len(ms) // 2], "p99": ms[int(len(ms) * 0.99)], "max": ms[-1]}


async def loop_lag(receives, nbytes: int) -> dict:
    """How late a 1 ms sleeper on this loop wakes while the `receives` coroutines run at once.

    Besides the wall-clock lag, each wake-up records the CPU time this (the loop's) thread
    spent while the probe slept: the work other callbacks did on the loop. On a machine
    whose cores are all busy the wall lag also holds the time the loop waited for a core;
    the loop's CPU is what the receive path itself puts on the loop.
    """
    lags: list[float] = []
    busy: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            t, c = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)
            busy.append(time.thread_time() - c)

    marks: list[float] = []  # starts and stops of full garbage collections: the process's pauses

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            marks.append(time.perf_counter())

    task = asyncio.create_task(probe())
    gc.callbacks.append(on_gc)
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        await asyncio.gather(*receives)
    finally:
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        gc.callbacks.remove(on_gc)
        stop.set()
        await task
    return {"mb_per_s": nbytes / wall / 1e6, "loop_cpu_ms_per_100mb": cpu * 1e3 / (nbytes / 1e8),
            "lag_ms": _quantiles(lags), "loop_busy_ms": _quantiles(busy), "samples": len(lags),
            "gc_pauses_ms": [round((b - a) * 1e3, 1) for a, b in zip(marks[::2], marks[1::2], strict=False)]}


async def idle_lag(seconds: float = 1.0) -> dict:
    """The same probe with nothing arriving: the machine's own noise."""
    return await loop_lag([asyncio.sleep(seconds)], 1)


async def measure(args: argparse.Namespace) -> dict:
    from encdis.llm_node.coordinator.handle import EncoderHandle

    sender = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        tcp_port, grpc_port = map(int, sender.stdout.readline().split())
        address = f"127.0.0.1:{grpc_port}"
        handle = EncoderHandle(address, "bench", cost_model=None)
        # The bare stream gets its own connection, with only the message limit raised.
        bare = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_CHUNK + MiB)])
        sock = socket.create_connection(("127.0.0.1", tcp_port))
        cells = [(s, m, rows_for(*SIZES[s]), HIDDEN[m]) for m in HIDDEN for s in SIZES]
        samples: dict[tuple[str, str, str], list[float]] = {}
        for r in range(args.rounds + 1):
            for size, model, rows, hidden in cells:
                n = rows * hidden * 2
                runs = {
                    "tcp": lambda n=n: asyncio.to_thread(tcp_receive, sock, n),
                    "bare": lambda n=n: bare_receive(bare, n, args.chunk_bytes),
                    "encdis": lambda rows=rows, hidden=hidden: encdis_receive(handle, rows, hidden, args.chunk_bytes),
                }
                for mode, run in runs.items():
                    seconds = await run()
                    if r > 0:  # round 0 warms connections, windows and buffers
                        samples.setdefault((size, model, mode), []).append(n / seconds / 1e6)
        rows_out = []
        for size, model, rows, hidden in cells if args.rounds else []:
            mb = {mode: samples[size, model, mode] for mode in ("tcp", "bare", "encdis")}
            rows_out.append({
                "image": size, "model": model, "rows": rows, "hidden": hidden, "mbytes": rows * hidden * 2 / 1e6,
                **{f"{mode}_mb_per_s": statistics.median(v) for mode, v in mb.items()},
                **{f"{a}_vs_{b}": statistics.median(x / y for x, y in zip(mb[a], mb[b], strict=True))
                   for a, b in (("encdis", "tcp"), ("bare", "tcp"), ("encdis", "bare"))},
            })
        lag = []
        if not args.no_lag:
            rows, hidden, k = rows_for(*SIZES["4K"]), HIDDEN["72B"], args.lag_images
            lag.append({"mode": "idle", "chunk_bytes": 0, **await idle_lag()})
            # Warm the channel for concurrent streams first (windows, buffers): the first such burst is slower.
            await asyncio.gather(*(encdis_receive(handle, rows, hidden, args.chunk_bytes) for _ in range(k)))
            for chunk in args.lag_chunk_bytes:
                for mode in ("encdis", "bare"):
                    keep: list = []
                    receives = [encdis_receive(handle, rows, hidden, chunk, keep) if mode == "encdis" else
                                bare_receive(bare, rows * hidden * 2, chunk, keep) for _ in range(k)]
                    lag.append({"mode": mode, "chunk_bytes": chunk, **await loop_lag(receives, k * rows * hidden * 2)})
                    keep.clear()
        sock.close()
        await bare.close()
        await handle.channel.close()
        return {"cells": rows_out, "lag": lag, "lag_images": args.lag_images}
    finally:
        sender.stdin.close()
        try:
            sender.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sender.kill()
            sender.wait()


def print_table(result: dict, rounds: int, chunk: int) -> None:
    if not result["cells"]:
        return print_lag(result)
    print(f"\n{rounds} rounds, chunks of {chunk} bytes, medians (MB/s = 1e6 bytes/s)")
    header = (f"{'image':9} {'model':5} {'rows':>6} {'MB':>6} {'tcp MB/s':>9} {'bare MB/s':>9} {'encdis MB/s':>11} "
              f"{'encdis/tcp':>10} {'bare/tcp':>8} {'encdis/bare':>11}")
    print(header, "-" * len(header), sep="\n")
    for c in result["cells"]:
        print(f"{c['image']:9} {c['model']:5} {c['rows']:>6} {c['mbytes']:>6.1f} {c['tcp_mb_per_s']:>9.0f} "
              f"{c['bare_mb_per_s']:>9.0f} {c['encdis_mb_per_s']:>11.0f} {c['encdis_vs_tcp']:>10.2f} "
              f"{c['bare_vs_tcp']:>8.2f} {c['encdis_vs_bare']:>11.2f}")
    print_lag(result)


def print_lag(result: dict) -> None:
    if result["lag"]:
        print(f"\nevent-loop lag of a 1 ms sleeper while {result['lag_images']} x 4K 72B embeddings arrive at once "
              "(wall | loop thread's own CPU between wake-ups), ms")
        header = (f"{'path':7} {'chunk':>8} {'p50':>6} {'p99':>6} {'max':>7} | {'p50':>5} {'p99':>5} {'max':>6} "
                  f"{'MB/s':>6} {'loop CPU ms/100MB':>17}  full GCs (ms)")
        print(header, "-" * len(header), sep="\n")
        for g in result["lag"]:
            w, b = g["lag_ms"], g["loop_busy_ms"]
            cpu = f"{g['loop_cpu_ms_per_100mb']:.1f}" if g["mode"] != "idle" else "-"
            print(f"{g['mode']:7} {g['chunk_bytes']:>8} {w['p50']:>6.2f} {w['p99']:>6.2f} {w['max']:>7.2f} | "
                  f"{b['p50']:>5.2f} {b['p99']:>5.2f} {b['max']:>6.2f} "
                  f"{g['mb_per_s'] if g['mode'] != 'idle' else 0:>6.0f} {cpu:>17}  {g['gc_pauses_ms'] or ''}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds of every mode (median reported)")
    p.add_argument("--chunk-bytes", type=int, default=RECEIVE_CHUNK_BYTES,
                   help="chunk size of the bare and encdis streams (default: what the coordinator asks for)")
    p.add_argument("--lag-images", type=int, default=8)
    p.add_argument("--lag-chunk-bytes", default=f"{MiB // 4},{MiB},{4 * MiB}",
                   type=lambda s: [int(x) for x in s.split(",")], help="comma-separated chunk sizes")
    p.add_argument("--no-lag", action="store_true", help="skip the event-loop lag rows")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve()
        return 0
    result = asyncio.run(measure(args))
    print_table(result, args.rounds, args.chunk_bytes)
    if args.json:
        result.update(rounds=args.rounds, chunk_bytes=args.chunk_bytes, python=platform.python_version(),
                      grpcio=grpc.__version__, cpus=os.cpu_count(), machine=platform.machine())
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
