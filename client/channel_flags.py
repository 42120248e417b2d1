"""Client-side TLS and API key flags shared by the `encdis` commands that call a node.

    add_channel_flags(parser)
    security = channel_security(args)   # ChannelSecurity; ValueError naming the bad flag or file

--tls (the system's roots), --ca FILE (implies TLS), --cert FILE / --key FILE (mTLS),
--server-name NAME, --api-key-file FILE. The key is read from a file, never from a flag, so it
does not show in the process list or the shell history.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from encdis.client.channels import ChannelSecurity


def add_channel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection security")
    g.add_argument("--tls", action="store_true", help="use TLS with the system's root certificates")
    g.add_argument("--ca", type=Path, help="PEM root certificates to verify the server (implies --tls)")
    g.add_argument("--cert", type=Path, help="PEM client certificate, for servers that require mTLS")
    g.add_argument("--key", type=Path, help="PEM private key of --cert")
    g.add_argument("--server-name", help="verify the server's certificate against this name")
    g.add_argument("--api-key-file", type=Path, help="file whose first non-empty line is the API key")


def channel_security(args: argparse.Namespace) -> ChannelSecurity:
    """What the flags ask for; ValueError naming what was wrong."""
    if (args.cert is None) != (args.key is None):
        raise ValueError("--cert and --key go together (the client certificate and its private key)")
    return ChannelSecurity.from_files(ca=args.ca, cert=args.cert, key=args.key, api_key_file=args.api_key_file,
                                      tls=args.tls, server_name=args.server_name)
