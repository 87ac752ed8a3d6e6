"""The `hafailover` command line.

Commands: ``demo`` (the walk-through run by `make demo`) and ``url`` (check a
connection URL and print it normalized). Exit status 2 means bad input, with a
message naming what was wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hafailover.errors import ConfigurationError
from hafailover.url import parse_url

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from hafailover import demo

    demo.run()
    return 0


def _cmd_url(args: argparse.Namespace) -> int:
    policy = parse_url(args.url)
    if args.json:
        summary = {
            "url": policy.redacted(),
            "protocol": policy.protocol.value,
            "brokers": [b.redacted() for b in policy.brokers],
            "options": policy.options(),
        }
        print(json.dumps(summary, indent=2))
    else:
        print(policy.redacted())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hafailover", description="Client-side failover for STOMP and AMQP 1.0."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="walk through a failover")
    demo.set_defaults(run=_cmd_demo)
    url = commands.add_parser("url", help="check a connection URL and print it normalized")
    url.add_argument("url")
    url.add_argument("--json", action="store_true", help="print a JSON summary")
    url.set_defaults(run=_cmd_url)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ConfigurationError as exc:
        print(f"hafailover: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
