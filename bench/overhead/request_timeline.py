"""Where one request's time goes: the median start and end of every span, from its traces.

One encoder node and one LLM node on a tiny checkpoint (made for the run unless --model), both
exporting traces to an OTLP receiver on loopback (tests/otlp_receiver.py); --requests one-image
Generate calls, one at a time (concurrency 1), each with a new image (no cache hit), after
--warmup more. Per span name (the LLM node's encdis.*, the encoder's encdis.encoder.*, vLLM's
llm_request), the median of its start and end in milliseconds after its request's
encdis.generate began. The gaps between them are what no span covers: the coordinator's hops
between threads, gRPC calls starting and ending, the handoff to vLLM.

    python -m bench.overhead.request_timeline [--model DIR] [--requests 12] [--warmup 3] [--image 224]

Measured (`python -m bench.overhead.request_timeline --requests 16`: gRPC door, 224x224 PNG, 4
tokens, the node's default --handoff region): the span table is in bench/README.md (Overhead).

The encoder's queue span is the image's wait in the batcher (0.04 ms here); its decoding (0.7
ms) and the image processor's resize and normalisation are the preprocess span (2.4 ms in all,
work `vllm serve` does too), which the node's time split reports as preprocess, apart from
queue. Beyond those and the forward: 0.86 ms before the coordinator starts (prompt rendering and
checks in a worker thread, the hop to the coordinator's thread), 1.3 ms from the call's start to
the encoder's handler, 1.5 ms from the forward's result to the embedding in hand (the encoder's
loop, its frames, the wire, the checks), 0.44 ms to the coordinator's answer and 0.69 ms from
there to vLLM's request starting: 4.8 ms in all. An earlier run of the same command, before the
coordinator stopped waiting for each call's end (its trailers, which came 0.9 ms after the last
image and are now read in the background, client/encoder_client.py) and the region's handoff
stopped taking a thread hop for links alone, gave 0.86, 1.36, 1.63, 0.90 and 0.63 ms: 5.4 ms;
just after that change 4.5 ms (run-to-run spread on this machine is about 0.3 ms). The encoder's
Encode and send spans end after vLLM's request starts: its last frame's send completes once the
core it shares with vLLM's prefill is free, which no request waits for.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.overhead.tracing import checkpoint, png  # noqa: E402

ROOT_SPAN = "encdis.generate"
EXPORT_WAIT_SECONDS = 6.0  # the nodes' batch span processors export within this


def timeline(spans: list, root_name: str = ROOT_SPAN) -> list[tuple[str, str, float, float, int]]:
    """(service, span, median start ms, median end ms, count) relative to each trace's root span."""
    by_trace = collections.defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    rel = collections.defaultdict(list)
    for trace_spans in by_trace.values():
        roots = [s for s in trace_spans if s.name == root_name]
        if not roots:
            continue
        t0 = roots[0].start_ns
        for s in trace_spans:
            rel[(s.service, s.name)].append(((s.start_ns - t0) / 1e6, (s.end_ns - t0) / 1e6))
    rows = [(service, name, statistics.median(a for a, _ in v), statistics.median(b for _, b in v), len(v))
            for (service, name), v in rel.items()]
    return sorted(rows, key=lambda r: (r[2], r[3]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint directory (default: a tiny one made for the run)")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--image", type=int, default=224, help="side of the square PNG, pixels")
    args = p.parse_args()

    from encdis.client import GenerateClient
    from encdis.launcher import NodeProcess
    from tests.otlp_receiver import OtlpReceiver

    with tempfile.TemporaryDirectory() as tmp, OtlpReceiver() as rx:
        model = checkpoint(args.model, tmp)
        tracing = ["--otlp-traces-endpoint", rx.address]
        enc = NodeProcess(["encoder", "--model", str(model), "--host", "127.0.0.1", "--port", "0", *tracing])
        llm = None
        try:
            enc.wait_ready(300)
            llm = NodeProcess(["llm", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                               "--encoders", enc.address, *tracing])
            llm.wait_ready(900)
            with GenerateClient(llm.address, timeout=600) as client:
                for i in range(args.warmup):
                    client.generate("Describe the picture.", [png(args.image, args.image, 900 + i)], max_tokens=4,
                                    ignore_eos=True)
                time.sleep(EXPORT_WAIT_SECONDS)
                first = len(rx.spans)
                for i in range(args.requests):
                    client.generate("Describe the picture.", [png(args.image, args.image, 1000 + i)], max_tokens=4,
                                    ignore_eos=True)
            time.sleep(EXPORT_WAIT_SECONDS)
            rows = timeline(rx.spans[first:])
        finally:
            if llm is not None:
                llm.stop()
            enc.stop()
    print(f"{'service':13} {'span':45} {'start':>7} {'end':>7}   (ms, medians of {args.requests})")
    for service, name, start, end, _ in rows:
        print(f"{service[:12]:13} {name:45} {start:7.2f} {end:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
