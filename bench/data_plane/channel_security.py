"""What TLS and API keys cost the embedding stream: plaintext vs TLS vs key vs TLS + key, side by side.

    python -m bench.data_plane.channel_security [--rounds 7] [--mb 173] [--chunk-bytes 4194304] [--json out.json]

A sender process (`--serve`, as an encoder node is) streams one embedding-sized payload
(default 173 MB: a 4K image's 72B BF16 embedding) as --chunk-bytes messages from one
grpc.aio server stream method under `/encdis.` from two servers, one without and one with the
nodes' API-key interceptor, each on a plaintext and a TLS port (encdis.tls, a certificate made
for the run). This process
receives it over 127.0.0.1 through encdis.client.channels (the channels the SDK and the
coordinator open), joined into one preallocated buffer, in four modes:

  plain      plaintext, no key (the baseline)
  key        plaintext, `authorization: Bearer` added by the client interceptor, checked by the server's
  tls        TLS (server certificate verified against the CA)
  tls+key    both

Modes alternate within each round (load on a shared machine drifts); the table gives each
mode's median MB/s and the median of its per-round ratio to plain. One warm-up round is
not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

MiB = 1024 * 1024
METHOD = "/encdis.bench.Bench/Stream"
KEY = "bench-key"
MODES = ("plain", "key", "tls", "tls+key")


def _identity(b: bytes) -> bytes:
    return b


async def serve(work: Path, total: int, chunk: int) -> None:
    from encdis.auth import ApiKeyInterceptor, ApiKeys
    from encdis.tls import ServerTLS, add_port

    payload = [os.urandom(min(chunk, total - off)) for off in range(0, total, chunk)]

    async def stream(request: bytes, context):
        for part in payload:
            yield part

    handler = grpc.method_handlers_generic_handler("encdis.bench.Bench", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream, _identity, _identity)})
    tls = ServerTLS(work / "server.pem", work / "server-key.pem")
    ports, servers = {}, []
    for keyed in (False, True):
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(ApiKeys([KEY]))] if keyed else [],
                                 options=[("grpc.max_send_message_length", chunk + MiB)])
        server.add_generic_rpc_handlers([handler])
        suffix = "+key" if keyed else ""
        ports["key" if keyed else "plain"] = add_port(server, "127.0.0.1:0", None)
        ports["tls" + suffix] = add_port(server, "127.0.0.1:0", tls)
        await server.start()
        servers.append(server)
    print(json.dumps(ports), flush=True)
    await servers[0].wait_for_termination()


async def receive(channel: grpc.aio.Channel, buf: bytearray) -> int:
    call = channel.unary_stream(METHOD, request_serializer=_identity, response_deserializer=_identity)(b"")
    view, off = memoryview(buf), 0
    async for part in call:
        view[off:off + len(part)] = part
        off += len(part)
    return off


async def run(args: argparse.Namespace, ports: dict, ca: bytes) -> dict:
    from encdis.client.channels import ChannelSecurity, open_aio_channel

    total = args.mb * 1_000_000
    opts = [("grpc.max_receive_message_length", args.chunk_bytes + MiB)]
    securities = {
        "plain": None,
        "key": ChannelSecurity(api_key=KEY),
        "tls": ChannelSecurity(root_certificates=ca),
        "tls+key": ChannelSecurity(root_certificates=ca, api_key=KEY),
    }
    channels = {m: open_aio_channel(f"127.0.0.1:{ports[m]}", opts, sec) for m, sec in securities.items()}
    buf = bytearray(total)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds + 1):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            t0 = time.perf_counter()
            got = await receive(channels[mode], buf)
            dt = time.perf_counter() - t0
            assert got == total, (mode, got)
            if r > 0:  # round 0 warms up connections and handshakes
                rates[mode].append(total / dt / 1e6)
    for ch in channels.values():
        await ch.close()
    table = {}
    for mode in MODES:
        ratios = [a / b for a, b in zip(rates[mode], rates["plain"], strict=True)]
        table[mode] = {"mb_per_s": statistics.median(rates[mode]), "ratio_to_plain": statistics.median(ratios),
                       "rounds": rates[mode]}
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--mb", type=int, default=173, help="payload per call, MB")
    p.add_argument("--chunk-bytes", type=int, default=4 * MiB)
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the sender process, given its work dir
    args = p.parse_args()
    if args.serve is not None:
        asyncio.run(serve(args.serve, args.mb * 1_000_000, args.chunk_bytes))
        return 0

    from tests.certificates import TestPKI

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pki = TestPKI(work)
        pki.issue("server", ips=["127.0.0.1"])
        sender = subprocess.Popen([sys.executable, __file__, "--serve", str(work), "--mb", str(args.mb),
                                   "--chunk-bytes", str(args.chunk_bytes)], stdout=subprocess.PIPE, text=True)
        try:
            ports = json.loads(sender.stdout.readline())
            table = asyncio.run(run(args, ports, pki.ca_pem))
        finally:
            sender.kill()
            sender.wait()
    print(f"{args.mb} MB per call in {args.chunk_bytes // MiB} MiB messages, {args.rounds} rounds, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, grpcio {grpc.__version__}")
    print(f"{'mode':<10} {'MB/s':>8} {'x plain':>8}")
    for mode, row in table.items():
        print(f"{mode:<10} {row['mb_per_s']:>8.0f} {row['ratio_to_plain']:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"mb": args.mb, "chunk_bytes": args.chunk_bytes, "modes": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
