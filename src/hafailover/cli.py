"""The `hafailover` command line.

Commands, modelled on the Artemis CLI (docs/cli.md):

- ``producer``, ``consumer``, ``browser``: messaging clients through the library, with a
  per-message ``--record`` file and a ``--json`` summary;
- ``perf producer`` / ``perf consumer``: throughput and latency;
- ``url``: check a connection URL and print it normalized;
- ``demo``: the live failover demo run by `make demo` (``--walkthrough``: the pure core's
  scripted walk-through, no network);
- ``pair`` / ``broker``: run the bundled reference broker.

Exit status: 0 done, 1 the run failed (something not confirmed, lost or refused), 2 bad
input, with a message naming the option.

hafailover never imports the reference broker: ``demo``, ``pair`` and ``broker`` hand the
process over to ``python -m reference_broker``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from hafailover.errors import ConfigurationError
from hafailover.url import parse_url

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.walkthrough:
        from hafailover import demo

        demo.run()
        return 0
    extra = ["--amqp"] if args.amqp else []
    return _run_reference_broker(["demo", *extra])


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


# --- messaging clients (hafailover.tools, imported when a client command runs) -----------

ACK_MODE_NAMES = ("auto", "dups-ok", "client", "client-individual", "transacted")


def _whole(minimum: int) -> Any:
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, not {text!r}")
        return value

    return check


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, not {text!r}")
    return value


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        required=True,
        help="connection URL, e.g. 'failover:(stomp://h1:61613,stomp://h2:61613)?heartbeat=1s'",
    )
    parser.add_argument("--user", help="user for brokers whose URL names none")
    parser.add_argument(
        "--password",
        default=os.environ.get("HAFAILOVER_PASSWORD"),
        help="password (default: $HAFAILOVER_PASSWORD)",
    )


def _producer_options(parser: argparse.ArgumentParser, *, perf: bool) -> None:
    _connection_options(parser)
    parser.add_argument("--destination", default="queue://TEST", help="default: queue://TEST")
    parser.add_argument(
        "--count", type=_whole(1), help=f"messages to send (default: {10000 if perf else 1000})"
    )
    if perf:
        parser.add_argument(
            "--duration", type=_seconds, help="send for this many seconds instead of --count"
        )
    parser.add_argument("--message-size", type=_whole(0), help="body bytes (default: a text)")
    parser.add_argument(
        "--tx-batch", type=_whole(0), default=0, help="transacted: commit every K messages"
    )
    parser.add_argument(
        "--ack-mode",
        choices=ACK_MODE_NAMES,
        help="the session's mode (default: auto; transacted when --tx-batch is given)",
    )
    parser.add_argument("--non-persistent", action="store_true", help="send non-persistent")
    parser.add_argument(
        "--no-confirm", action="store_true", help="do not wait for the broker's confirmations"
    )
    parser.add_argument(
        "--pipeline",
        type=_whole(1),
        default=1000 if perf else 1,
        help="sends in flight before waiting for a confirmation (default: %(default)s)",
    )
    parser.add_argument("--sleep", type=_whole(0), default=0, help="milliseconds between messages")
    if not perf:
        parser.add_argument("--record", help="write one JSON line per message to this file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _consumer_options(parser: argparse.ArgumentParser, *, perf: bool) -> None:
    _connection_options(parser)
    parser.add_argument("--destination", default="queue://TEST", help="default: queue://TEST")
    stop = parser.add_mutually_exclusive_group()
    stop.add_argument("--count", type=_whole(1), help="stop after this many messages")
    stop.add_argument(
        "--idle-timeout", type=_seconds, help="stop after this many seconds without a message"
    )
    if perf:
        stop.add_argument("--duration", type=_seconds, help="stop after this many seconds")
    parser.add_argument("--ack-mode", choices=ACK_MODE_NAMES, default="auto")
    parser.add_argument(
        "--batch",
        type=_whole(1),
        default=1,
        help="client: acknowledge every K messages; transacted: commit every K",
    )
    parser.add_argument("--prefetch", type=_whole(1), default=100)
    if not perf:
        parser.add_argument("--record", help="write one JSON line per message to this file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _print_summary(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    for key, value in summary.items():
        if key == "messages":
            continue
        text = json.dumps(value) if isinstance(value, dict | list) else str(value)
        print(f"{key.replace('_', ' ')}: {text}")


def _cmd_producer(args: argparse.Namespace) -> int:
    from hafailover.tools import ACK_MODES, OptionError, ProducerOptions, run_producer

    perf = args.command == "perf"
    mode = ACK_MODES[args.ack_mode or ("transacted" if args.tx_batch else "auto")]
    transacted = mode is ACK_MODES["transacted"]
    if args.tx_batch and not transacted:
        raise OptionError(
            "--tx-batch", f"needs a transacted session, not --ack-mode {args.ack_mode}"
        )
    duration = getattr(args, "duration", None)
    count = (
        args.count if args.count is not None else (None if duration else 10000 if perf else 1000)
    )
    if duration is not None and args.count is not None:
        raise OptionError("--duration", "give either --count or --duration, not both")
    options = ProducerOptions(
        url=args.url,
        destination=args.destination,
        count=count,
        duration=duration,
        message_size=args.message_size,
        tx_batch=(args.tx_batch or 10) if transacted else 0,
        ack_mode=mode,
        persistent=not args.non_persistent,
        confirm=not args.no_confirm,
        pipeline=args.pipeline,
        sleep=args.sleep / 1000,
        user=args.user,
        password=args.password,
        record=getattr(args, "record", None),
    )
    result = run_producer(options)
    if perf:
        result.summary["command"] = "perf producer"
    _print_summary(result.summary, args.json)
    return 0 if result.ok else 1


def _cmd_consumer(args: argparse.Namespace) -> int:
    from hafailover.tools import ACK_MODES, ConsumerOptions, run_consumer

    perf = args.command == "perf"
    duration = getattr(args, "duration", None)
    idle = args.idle_timeout
    if perf and args.count is None and duration is None and idle is None:
        idle = 5.0  # perf measures what is there, then stops
    options = ConsumerOptions(
        url=args.url,
        destination=args.destination,
        count=args.count,
        idle_timeout=idle,
        duration=duration,
        ack_mode=ACK_MODES[args.ack_mode],
        batch=args.batch,
        prefetch=args.prefetch,
        user=args.user,
        password=args.password,
        record=getattr(args, "record", None),
    )
    result = run_consumer(options)
    if perf:
        result.summary["command"] = "perf consumer"
    _print_summary(result.summary, args.json)
    return 0 if result.ok else 1


def _cmd_paths(args: argparse.Namespace) -> int:
    from hafailover.tools._common import check_url
    from hafailover.tools.paths import run_paths

    policy = check_url(args.url)
    if args.user is not None or args.password is not None:
        # As connect() does: for the brokers whose URL names no user.
        policy = attrs.evolve(
            policy,
            brokers=tuple(
                b if b.user is not None else attrs.evolve(b, user=args.user, password=args.password)
                for b in policy.brokers
            ),
        )
    rows = run_paths(policy, quick=args.quick)
    if args.json:
        print(json.dumps(rows), flush=True)
        return 0
    for entry in rows:
        latency = (
            f"  p50 {entry['p50_ms']:.2f} ms  p99 {entry['p99_ms']:.2f} ms"
            if "p50_ms" in entry
            else ""
        )
        print(f"{entry['path']:40} {entry['rate']:>10,.0f} msg/s{latency}")
    return 0


def _cmd_browser(args: argparse.Namespace) -> int:
    from hafailover.tools import BrowserOptions, run_browser

    def show(entry: dict[str, Any]) -> None:
        print(
            f"seq {entry['seq']}  id {entry['message_id']}  {entry['size']} bytes"
            + ("  redelivered" if entry["redelivered"] else ""),
            flush=True,
        )

    options = BrowserOptions(
        url=args.url, destination=args.destination, user=args.user, password=args.password
    )
    result = run_browser(options, on_message=None if args.json else show)
    if args.json:
        print(json.dumps(result.summary), flush=True)
    else:
        print(f"{result.summary['count']} message(s) on {result.summary['destination']}")
        if "error" in result.summary:
            print(f"error: {result.summary['error']}", file=sys.stderr)
    return 0 if result.ok else 1


def _add_client_commands(commands: Any) -> None:
    producer = commands.add_parser("producer", help="send messages, each with a seq header")
    _producer_options(producer, perf=False)
    producer.set_defaults(run=_cmd_producer)
    consumer = commands.add_parser("consumer", help="receive messages")
    _consumer_options(consumer, perf=False)
    consumer.set_defaults(run=_cmd_consumer)
    browser = commands.add_parser("browser", help="list a queue's messages without consuming")
    _connection_options(browser)
    browser.add_argument("--destination", default="queue://TEST", help="default: queue://TEST")
    browser.add_argument("--json", action="store_true", help="print the result as JSON")
    browser.set_defaults(run=_cmd_browser)
    perf = commands.add_parser(
        "perf", help="throughput: perf producer | perf consumer | perf paths"
    )
    kinds = perf.add_subparsers(dest="perf_command", required=True)
    perf_producer = kinds.add_parser("producer", help="send as fast as confirmations allow")
    _producer_options(perf_producer, perf=True)
    perf_producer.set_defaults(run=_cmd_producer)
    perf_consumer = kinds.add_parser("consumer", help="receive as fast as the broker delivers")
    _consumer_options(perf_consumer, perf=True)
    perf_consumer.set_defaults(run=_cmd_consumer)
    paths = kinds.add_parser(
        "paths",
        help="every path applications use: send() one at a time, pipelined, commits, receives",
    )
    _connection_options(paths)
    paths.add_argument("--quick", action="store_true", help="fewer messages")
    paths.add_argument("--json", action="store_true", help="print the rows as JSON")
    paths.set_defaults(run=_cmd_paths)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hafailover", description="Client-side failover for STOMP and AMQP 1.0."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="live failover demo: a broker pair, traffic, SIGKILL of the live"
    )
    demo.add_argument("--amqp", action="store_true", help="run the AMQP clients as well")
    demo.add_argument(
        "--walkthrough",
        action="store_true",
        help="instead: the failover core's scripted walk-through, no network",
    )
    demo.set_defaults(run=_cmd_demo)
    _add_client_commands(commands)
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
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or bad input (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.run(args))
    except ConfigurationError as exc:
        print(f"hafailover: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
