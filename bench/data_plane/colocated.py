"""Co-located transport vs gRPC: one image's BF16 embedding from a sender process to this one.

    python -m bench.data_plane.colocated [--rounds 5] [--model 72B]

Both modes use the project's code end to end, minus the tower: the sender is the encoder's
send path over a pre-made tensor (servicer.reply_frames for gRPC; encoder_node/colocated.py's
header + pair send for co-located), the receiver an EncoderHandle's encode_iter with
per-image expectations, then records.embedding_tensor. `colocated` is a gloo pair (this
machine has no GPU), opened once (colocated_link.open_link) and reused, as the coordinator
does. Modes alternate within each round; a cell is the median MB/s (1e6 bytes/s) after one
uncounted warm-up round.

Measured (`--rounds 9`, 72B): co-located/gRPC 0.98x at 4 MB, 1.2-1.8x at 44 MB, 1.5-2x at 173 MB;
the table is in bench/README.md (Data plane).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SIZES = {"448x448": (448, 448), "1080p": (1920, 1080), "4K": (3840, 2160)}
HIDDEN = {"7B": 3584, "72B": 8192}


def serve() -> None:
    """The sender: Encode (gRPC or co-located by the request) and OpenColocated; port on stdout."""
    import grpc
    import torch

    from encdis.client.pb import encoder_pb2, encoder_pb2_grpc
    from encdis.encoder_node.colocated import ColocatedSessions
    from encdis.encoder_node.server import server_options
    from encdis.encoder_node.servicer import add_encoder_service, reply_frames
    from encdis.encoder_node.settings import EncoderSettings

    sessions = ColocatedSessions()
    tensors: dict[tuple[int, int], torch.Tensor] = {}

    class TowerlessEncoder(encoder_pb2_grpc.EncoderServiceServicer):
        async def Encode(self, request, context):
            session = sessions.get(request.colocated_session)
            for i, spec in enumerate(request.images):
                rows, hidden = map(int, bytes(spec).split(b","))
                if (rows, hidden) not in tensors:
                    tensors[rows, hidden] = torch.randn(rows, hidden).to(torch.bfloat16)
                t = tensors[rows, hidden]
                if session is not None:
                    async for f in sessions.frames(session, i, (1, 2, 2 * rows), "", t, "BF16",
                                                   request.colocated_tag_base + i, batch=None, queue_seconds=0.0):
                        yield f
                else:
                    for f in reply_frames(i, (1, 2, 2 * rows), "", t, "BF16", request.max_chunk_bytes):
                        yield f

        async def OpenColocated(self, request, context):
            return await sessions.open(request)

        async def CloseColocated(self, request, context):
            sessions.close(request.session_id)
            return encoder_pb2.CloseColocatedResponse()

    async def run() -> None:
        from pathlib import Path

        server = grpc.aio.server(options=server_options(EncoderSettings(model=Path("."))))
        add_encoder_service(TowerlessEncoder(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await server.stop(None)

    asyncio.run(run())


async def receive(handle, rows: int, hidden: int, receiver=None) -> float:
    from encdis.client.wire import ExpectedEmbedding
    from encdis.llm_node.coordinator.records import embedding_tensor

    t0 = time.perf_counter()
    async for emb in handle.client.encode_iter([f"{rows},{hidden}".encode()],
                                               expected=[ExpectedEmbedding(rows, hidden, "BF16", 4 * rows)],
                                               colocated=receiver() if receiver else None):
        tensor = embedding_tensor(emb)
    seconds = time.perf_counter() - t0
    assert tensor.shape == (rows, hidden)
    return seconds


async def measure(args: argparse.Namespace) -> None:
    from encdis.llm_node.coordinator.colocated_link import open_link
    from encdis.llm_node.coordinator.handle import EncoderHandle
    from encdis.llm_node.coordinator.patches import grid_for_image
    from encdis.pair_group import read_boot_id

    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    port = int(proc.stdout.readline())
    handle = EncoderHandle(f"127.0.0.1:{port}", "bench", None)
    link = await open_link(handle.address, handle.channel, backend="gloo", boot_id=read_boot_id(), timeout=30,
                           threads=ThreadPoolExecutor(4), on_failure=lambda *a: None,
                           on_receiving=lambda n: None, on_received=lambda: None)
    hidden = HIDDEN[args.model]
    print(f"{'image':9} {'rows':>6} {'MB':>6} {'grpc MB/s':>10} {'colocated MB/s':>15} {'ratio':>6}")
    for name, (w, h) in SIZES.items():
        t, gh, gw = grid_for_image(w, h, min_pixels=3136, max_pixels=12845056)
        rows = t * gh * gw // 4
        nbytes = rows * hidden * 2
        times: dict[str, list[float]] = {"grpc": [], "colocated": []}
        for r in range(args.rounds + 1):
            g = await receive(handle, rows, hidden)
            c = await receive(handle, rows, hidden, link.call_receiver)
            if r:
                times["grpc"].append(g)
                times["colocated"].append(c)
        mbs = {k: nbytes / statistics.median(v) / 1e6 for k, v in times.items()}
        print(f"{name:9} {rows:>6} {nbytes / 1e6:>6.1f} {mbs['grpc']:>10.0f} {mbs['colocated']:>15.0f} "
              f"{mbs['colocated'] / mbs['grpc']:>6.2f}", flush=True)
    link.close()
    await handle.client.close()
    proc.stdin.close()
    proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", choices=sorted(HIDDEN), default="72B")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve()
        return 0
    asyncio.run(measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
