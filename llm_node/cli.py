"""`encdis llm`: run the LLM node (vLLM with the tower not loaded + coordinator + GenerateService).

    encdis llm --model DIR --port 50050 --encoders enc-0:50051,enc-1:50051 [--tp 8] [--metrics-port 9100]

Encoder addresses may be DNS names with a port (e.g. a Kubernetes headless Service);
they are re-resolved every --dns-refresh-seconds. Every flag has an ENCDIS_* variable.
"""

from __future__ import annotations

import argparse
import logging
import sys

from encdis.llm_node import settings as llm_settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    llm_settings.add_arguments(p)
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = llm_settings.from_args(args)
    except ValueError as e:
        print(f"encdis llm: {e}", file=sys.stderr)
        return 2
    from encdis.llm_node.server import run_node

    return run_node(settings)
