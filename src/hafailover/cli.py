"""The `hafailover` command line.

Commands: ``demo`` (the walk-through run by `make demo`), ``url`` (check a
connection URL and print it normalized), and ``pair`` / ``broker``, which run the
bundled reference broker (``pair up``, ``broker run``, ``broker user add``). Exit
status 2 means bad input, with a message naming what was wrong.

hafailover never imports the reference broker: ``pair`` and ``broker`` hand the
process over to ``python -m reference_broker``.
"""

from __future__ import annotations

import argparse
import json
import os
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
    commands.add_parser("pair", help="run the bundled broker pair: pair up [--json]")
    commands.add_parser("broker", help="run one broker node: broker run ...; broker user add ...")
    return parser


def _run_reference_broker(argv: Sequence[str]) -> int:
    """Replace this process with ``python -m reference_broker ARGS``."""
    os.execv(sys.executable, [sys.executable, "-m", "reference_broker", *argv])  # noqa: S606


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pair"]:
        return _run_reference_broker(argv)
    if argv[:1] == ["broker"]:
        return _run_reference_broker(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ConfigurationError as exc:
        print(f"hafailover: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
