"""The `encdis` command: one entry point, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int` and keeps
heavy imports (torch, vLLM) inside `run`, so `encdis --help` and the light client's
commands work without them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny-checkpoint": ("encdis.tiny_checkpoint", "build a tiny random Qwen2.5-VL checkpoint"),
    "encoder": ("encdis.encoder_node.cli", "run an encoder node (gRPC EncoderService)"),
    "encode": ("encdis.client.encode_command", "encode images on an encoder node into a .safetensors file"),
    "llm": ("encdis.llm_node.cli", "run the LLM node (vLLM + coordinator + GenerateService)"),
    "generate": ("encdis.client.generate_command", "send a prompt with images to the LLM node"),
    "pool": ("encdis.client.pool_command", "show an LLM node's encoder pool (state, queue, faults, back-off)"),
    "demo": ("encdis.llm_node.demo", "run encdis end to end on the tiny checkpoint"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encdis", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # an extra is not installed: say which
            p.set_defaults(_missing=f"'encdis {name}' is unavailable: {e}")
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
