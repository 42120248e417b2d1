"""Encode latency of one 448x448 image on the tiny checkpoint: a cache miss (forward) vs a hit.

    python -m bench.overhead.encoder_cache [--repeats 20] [--out encoder_cache.json]

Misses send a distinct image each time (fresh digest), hits resend one cached image; both on one
in-process encoder node over loopback gRPC. Prints medians and the miss/hit ratio, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from encdis.client import EncoderClient
from encdis.encoder_node.settings import EncoderSettings
from encdis.tiny_checkpoint import make_tiny_checkpoint
from tests import encoder_images as images
from tests.encoder_inproc import InProcessEncoder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="encoder_cache.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ckpt = make_tiny_checkpoint(f"{d}/tiny")
        settings = EncoderSettings(model=ckpt, host="127.0.0.1", port=0, cache_bytes=256 * 1024 * 1024)
        with InProcessEncoder(settings) as n, EncoderClient(n.address, timeout=120) as c:
            distinct = [images.rgb_jpeg(448, 448, seed=1000 + i) for i in range(args.repeats + 1)]
            c.encode([distinct[-1]])  # warm-up, and the image the hits resend
            miss, hit = [], []
            for i in range(args.repeats):
                t0 = time.perf_counter()
                (e,) = c.encode([distinct[i]])
                miss.append(time.perf_counter() - t0)
                assert not e.cached
                t0 = time.perf_counter()
                (e,) = c.encode([distinct[-1]])
                hit.append(time.perf_counter() - t0)
                assert e.cached
    result = {"image": "448x448 JPEG", "repeats": args.repeats, "miss_median_s": statistics.median(miss),
              "hit_median_s": statistics.median(hit)}
    result["miss_over_hit"] = result["miss_median_s"] / result["hit_median_s"]
    print(f"{'':6}{'median ms':>10}\nmiss  {result['miss_median_s'] * 1e3:10.2f}\nhit   "
          f"{result['hit_median_s'] * 1e3:10.2f}\nmiss/hit {result['miss_over_hit']:.1f}x")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
