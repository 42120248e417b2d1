"""`encdis generate`: send a prompt with images to an LLM node and print the completion.

    encdis generate --server 127.0.0.1:50050 --prompt "Describe the picture." --image cat.jpg --max-tokens 32
    encdis generate ... --system "Answer briefly." --repetition-penalty 1.1 --logprobs 2
    encdis generate ... --json     # one JSON object: text, token_ids, finish_reason, usage, timing

The request is the full form (a system turn if given, then one user turn: the images, then the
prompt) with vLLM's sampling parameters; what is not given takes the checkpoint's defaults, as
`vllm serve` applies them, except that it is greedy unless --temperature is given. The text
streams to stdout as it is generated.
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
    p.add_argument("--system", default=None, help="a system message before the user's")
    for name in ("top-p", "min-p", "presence-penalty", "frequency-penalty", "repetition-penalty"):
        p.add_argument(f"--{name}", type=float, default=None, help="as vLLM's sampling parameter of that name")
    p.add_argument("--top-k", type=int, default=None, help="as vLLM's top_k")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each token's logprob and its N most likely alternatives (in --json)")
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
                  ignore_eos=args.ignore_eos, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                  presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                  repetition_penalty=args.repetition_penalty, stop=args.stop or None)
    if args.logprobs is not None:
        params.update(logprobs=True, top_logprobs=args.logprobs)
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages.append({"role": "user", "content": [*images, args.prompt]})
    result = GenerateResult()
    try:
        with GenerateClient(args.server, timeout=args.timeout) as client:
            for chunk in client.chat_stream(messages, **params):
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
            "logprobs": [asdict(t) for t in result.logprobs],
        }))
    else:
        print()
    return 0
