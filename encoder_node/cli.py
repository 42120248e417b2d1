"""`encdis encoder`: run an encoder node.

    encdis encoder --model DIR --port 50051 [--host H] [--device cpu|cuda:N] [--dtype auto]
                   [--metrics-port 9400] [--max-batch-patches 16384] ...

Every flag also reads ENCDIS_<FLAG> from the environment (see encoder_node/settings.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from encdis.encoder_node import settings as settings_mod


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_mod.add_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_mod.from_args(args)
    except ValueError as e:
        print(f"encdis encoder: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Until the event loop takes over SIGTERM/SIGINT (after the heavy imports below), a stop
    # request simply ends the process cleanly: nothing is loaded or in flight yet.
    signal.signal(signal.SIGTERM, _exit_now)
    import asyncio

    from encdis.encoder_node.server import serve

    return asyncio.run(serve(settings))


def _exit_now(signum: int, frame: object) -> None:
    raise SystemExit(0)
