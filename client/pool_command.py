"""`encdis pool`: the LLM node's encoder pool as its coordinator sees it, in the terminal.

    encdis pool --server 127.0.0.1:50050            # one table
    encdis pool --server 127.0.0.1:50050 --watch 2  # redrawn every 2 seconds until Ctrl-C
    encdis pool --server 127.0.0.1:50050 --json     # one JSON object per poll, for scripts

One row per encoder: state and why (quarantined, slow, refused, ...), backlog (patches and
predicted seconds), measured speed, images and patches assigned, consecutive faults, and its
back-off (length and time left before it is probed again), and its last ORCA load report as the
coordinator holds it (queued patches, the encoder's own drain prediction, busy fraction, age).
Reads ListEncoders only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from encdis.client.channel_flags import add_channel_flags, channel_security
from encdis.client.errors import EncdisError
from encdis.client.generate_client import EncoderInfo, GenerateClient

COLUMNS = ("ENCODER", "STATE", "QUEUE", "PATCHES/S", "IMAGES", "FAULTS", "BACK-OFF", "LAST REPORT", "REASON")
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, help="LLM node address HOST:PORT (its gRPC front door)")
    p.add_argument("--watch", type=float, metavar="SECONDS", default=None,
                   help="redraw every SECONDS until interrupted (default: print once)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (one line per poll)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds before a poll is abandoned (default 10)")
    add_channel_flags(p)


def run(args: argparse.Namespace) -> int:
    if args.watch is not None and not args.watch > 0:
        print(f"encdis pool: --watch must be a positive number of seconds, got {args.watch}", file=sys.stderr)
        return 2
    try:
        security = channel_security(args)
    except ValueError as e:
        print(f"encdis pool: {e}", file=sys.stderr)
        return 2
    with GenerateClient(args.server, timeout=args.timeout, **dataclasses.asdict(security)) as client:
        while True:
            try:
                encoders = client.list_encoders()
            except EncdisError as e:
                print(f"encdis pool: {args.server}: {e}", file=sys.stderr)
                if args.watch is None:
                    return 1
                encoders = None
            if encoders is not None:
                out = as_json(encoders) if args.json else render_table(encoders)
                if args.watch is not None and not args.json and sys.stdout.isatty():
                    out = CLEAR_SCREEN + f"encdis pool --server {args.server}  {time.strftime('%H:%M:%S')}\n" + out
                print(out, flush=True)
            if args.watch is None:
                return 0
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 0


def as_json(encoders: Sequence[EncoderInfo]) -> str:
    return json.dumps({"time": time.time(), "encoders": [dataclasses.asdict(e) for e in encoders]})


def _back_off(e: EncoderInfo) -> str:
    if e.backoff_seconds <= 0:
        return "-"
    left = f"{e.backoff_remaining_seconds:.1f}s left" if e.backoff_remaining_seconds > 0 else "probing"
    return f"{e.backoff_seconds:g}s ({left})"


def _report(e: EncoderInfo) -> str:
    if e.report is None:
        return "-"
    r = e.report
    return (f"{r['queued_patches']:.0f}p {r['drain_seconds']:.2f}s {r['utilization']:.0%} "
            f"({e.report_age_seconds:.1f}s ago)")


def table_rows(encoders: Sequence[EncoderInfo]) -> list[tuple[str, ...]]:
    return [(
        e.address if e.name in ("", e.address) else f"{e.address} ({e.name})",
        e.state,
        f"{e.backlog_patches} ({e.backlog_seconds:.2f}s)",
        f"{e.patches_per_second:.0f}",
        str(e.assigned_images),
        str(e.faults),
        _back_off(e),
        _report(e),
        e.reason or "-",
    ) for e in encoders]


def render_table(encoders: Sequence[EncoderInfo]) -> str:
    """Columns padded to their widest cell; the reason last, unpadded, as it can be long."""
    if not encoders:
        return "no encoders in the pool"
    rows = [COLUMNS, *table_rows(encoders)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]).rstrip() for r in rows]
    return "\n".join(lines)
