"""`encdis generate`: send a prompt with images to an LLM node and print the completion.

    encdis generate --server 127.0.0.1:50050 --prompt "Describe the picture." --image cat.jpg --max-tokens 32
    encdis generate ... --json     # one JSON object: text, token_ids, finish_reason, usage, timing

The text streams to stdout as it is generated (greedy unless --temperature is given).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, help="LLM node address host:port")
    p.add_argument("--prompt", required=True, help="the text, after the images, in one user message")
    p.add_argument("--image", action="append", default=[], type=Path, help="an image file (repeat, in order)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and token_ids")


def run(args: argparse.Namespace) -> int:
    from encdis.client.errors import EncdisError
    from encdis.client.generate_client import GenerateClient, GenerateResult

    try:
        images = [path.read_bytes() for path in args.image]
    except OSError as e:
        print(f"encdis generate: {e}", file=sys.stderr)
        return 2
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                  ignore_eos=args.ignore_eos)
    result = GenerateResult()
    try:
        with GenerateClient(args.server, timeout=args.timeout) as client:
            for chunk in client.generate_stream(args.prompt, images, **params):
                result.add(chunk)
                if not args.json:
                    print(chunk.text, end="", flush=True)
    except EncdisError as e:
        print(f"\nencdis generate: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "request_id": result.request_id,
            "usage": asdict(result.usage) if result.usage else None,
            "timing": asdict(result.timing) if result.timing else None,
        }))
    else:
        print()
    return 0
