"""`python -m reference_broker`: run a node, run a pair, manage users.

    python -m reference_broker run --node-id live --role live ...   one node (see node.py)
    python -m reference_broker pair up [--data-dir DIR] [--tls] [--json] ...   a live and a backup
        (no --password and no $HAFAILOVER_PASSWORD: a random one, written to DIR/password 0600;
        the printed URLs carry no credentials, docs/cli.md)
    python -m reference_broker user add --users FILE NAME          add or change a user
    python -m reference_broker demo [--amqp]                       the live failover demo

`hafailover broker ...` and `hafailover pair ...` run these same commands.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import secrets
import signal
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import quote

from reference_broker import node
from reference_broker._files import PRIVATE_DIRECTORY, replace_atomically
from reference_broker.pair import BrokerPair
from reference_broker.tls import make_certificates
from reference_broker.users import UsersFile, UsersFileError


def _pair_up(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hafailover pair up", description="Run a broker pair.")
    parser.add_argument("--data-dir", type=Path, help="where the nodes keep their data")
    parser.add_argument("--user", default="admin")
    parser.add_argument(
        "--password",
        default=os.environ.get("HAFAILOVER_PASSWORD"),
        help="the user's password (default: $HAFAILOVER_PASSWORD, else a random one written "
        "to DATA_DIR/password, readable by you only)",
    )
    parser.add_argument("--ports", help="six ports: live stomp,amqp,replication,backup ...")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print the addresses as JSON")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="TLS listeners, with a throw-away CA and certificates made in the data dir",
    )
    parser.add_argument(
        "--tls-client-auth", action="store_true", help="with --tls: clients must show a certificate"
    )
    limits = (
        "max_message_size",
        "max_connections",
        "max_connections_per_user",
        "max_address_bytes",
        "max_address_messages",
        "address_full_policy",
    )
    for name in limits:
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=str.upper if name == "address_full_policy" else int,
            help="passed to both nodes (docs/broker.md)",
        )
    parser.add_argument("--address-limit", action="append", default=[], help="passed to both nodes")
    # The dead-letter settings, checked here as the node checks them: both nodes must agree,
    # and a bad value is refused by name instead of leaving a pair that never starts.
    dead_letter = ("max_delivery_attempts", "dead_letter_queue")
    parser.add_argument(
        "--max-delivery-attempts",
        type=node.delivery_attempts,
        help="failed deliveries after which a message goes to the dead-letter queue "
        "(default: 10; 0: never); passed to both nodes",
    )
    parser.add_argument(
        "--dead-letter-queue",
        type=node.dead_letter_queue,
        help="where messages go after their last failed delivery or when a client rejects "
        "them (default: queue://DLQ); passed to both nodes",
    )
    args = parser.parse_args(argv)
    node_options = [
        f"--{name.replace('_', '-')}={value}"
        for name in (*limits, *dead_letter)
        if (value := getattr(args, name)) is not None
    ] + [f"--address-limit={value}" for value in args.address_limit]
    if args.tls_client_auth and not args.tls:
        parser.error("--tls-client-auth needs --tls")
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="hafailover-pair-"))
    data_dir.mkdir(mode=PRIVATE_DIRECTORY, parents=True, exist_ok=True)
    password_file: Path | None = None
    password = args.password
    if not password:
        # Never a well-known default: a random password, kept where only this user reads it.
        password = secrets.token_urlsafe(18)
        password_file = data_dir / "password"
        replace_atomically(password_file, (password + "\n").encode(), durable=False)
    tls = make_certificates(data_dir / "tls") if args.tls else None
    ports = None
    if args.ports:
        values = [int(p) for p in args.ports.split(",")]
        if len(values) != 6:
            parser.error("--ports takes six comma-separated ports")
        ports = (values[0], values[1], values[2], values[3], values[4], values[5])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with BrokerPair(
        data_dir,
        user=args.user,
        password=password,
        ports=ports,
        heartbeat_timeout=args.heartbeat_timeout,
        tls=tls,
        tls_client_auth=args.tls_client_auth,
        node_options=node_options,
    ) as pair:
        # The URLs carry no credentials: printed output ends up in terminals, logs and tickets.
        credentials = f"{quote(args.user, safe='')}:{quote(password, safe='')}@"
        description = pair.describe()
        for key in ("stomp_url", "amqp_url"):
            description[key] = description[key].replace(credentials, "")
        description["user"] = args.user
        description["password_file"] = str(password_file) if password_file else None
        if args.json:
            print(json.dumps(description), flush=True)
        else:
            for entry in description["nodes"]:
                print(
                    f"{entry['name']:7} {entry['role']:7} pid {entry['pid']:<7} "
                    f"stomp {entry['stomp']}  amqp {entry['amqp']}"
                )
            print(f"STOMP failover URL: {description['stomp_url']}")
            print(f"AMQP failover URL:  {description['amqp_url']}")
            if password_file is not None:
                print(
                    f"user {args.user}; its password is in {password_file} (readable by you "
                    f'only): export HAFAILOVER_PASSWORD="$(cat {password_file})"'
                )
            else:
                print(f"user {args.user}, with the password you gave")
            if tls is not None:
                print(f"TLS: the CA that signed the nodes' certificates is {tls.ca}")
            print(f"data and logs in {data_dir}; Ctrl-C stops both nodes", flush=True)
        stop.wait()
    if not args.json:
        print("pair stopped")
    return 0


def _user_add(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hafailover broker user add")
    parser.add_argument("--users", type=Path, required=True)
    parser.add_argument("name")
    parser.add_argument("--password", help="default: prompt (or HAFAILOVER_PASSWORD)")
    args = parser.parse_args(argv)
    password = args.password or os.environ.get("HAFAILOVER_PASSWORD") or getpass.getpass()
    try:
        users = UsersFile.load(args.users) if args.users.exists() else UsersFile()
        users.add(args.name, password)
    except UsersFileError as exc:
        print(f"hafailover: {exc}", file=sys.stderr)
        return 2
    users.save(args.users)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m reference_broker {run ...|pair up ...|user add ...|demo ...}"
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        return node.main(rest)
    if command == "pair" and rest[:1] == ["up"]:
        return _pair_up(rest[1:])
    if command == "user" and rest[:1] == ["add"]:
        return _user_add(rest[1:])
    if command == "demo":
        from reference_broker import demo  # imports the client library: only when asked

        return demo.main(rest)
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
