"""Reference broker throughput and recovery, as ratios measured in one run.

Run: .venv/bin/python benchmarks/broker.py [--messages N] [--no-rabbitmq]

1. Persistent STOMP sends of 1 KiB with a receipt each, pipelined (at most --window
   unconfirmed), from raw stomp.py: the replicated pair (live + synchronized backup) against
   the same live without a backup (live-only, degraded). Target: replicated >= 0.5 x live-only.
2. The same workload against RabbitMQ (Debian's rabbitmq-server with rabbitmq_stomp, started
   by scripts/rabbitmq.sh) on this machine. Target: the pair >= 0.5 x RabbitMQ.
3. Recovery: the time to open a journal holding 100,000 persistent 1 KiB messages and rebuild
   the engine from it, as a node does when it takes over. Target: under 2 seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import stomp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reference_broker.engine import Engine  # noqa: E402
from reference_broker.journal import Journal, SyncPolicy  # noqa: E402
from reference_broker.pair import BrokerPair  # noqa: E402
from reference_broker.records import decode  # noqa: E402

BODY = b"x" * 1024


class Receipts(stomp.ConnectionListener):
    def __init__(self) -> None:
        self.count = 0
        self.condition = threading.Condition()

    def on_receipt(self, frame: stomp.utils.Frame) -> None:
        with self.condition:
            self.count += 1
            self.condition.notify_all()


def stomp_rate(
    port: int, user: str, password: str, messages: int, window: int, vhost: str | None = None
) -> float:
    """Confirmed persistent sends per second through one raw stomp.py connection."""
    connection = stomp.Connection12([("127.0.0.1", port)], heartbeats=(0, 0), vhost=vhost)
    listener = Receipts()
    connection.set_listener("bench", listener)
    connection.connect(user, password, wait=True)
    destination = f"/queue/bench-{time.monotonic_ns()}"
    start = time.perf_counter()
    for i in range(messages):
        with listener.condition:
            while i - listener.count >= window:
                listener.condition.wait(5)
        connection.send(destination, BODY, headers={"persistent": "true", "receipt": str(i)})
    with listener.condition:
        while listener.count < messages:
            if not listener.condition.wait(30):
                raise TimeoutError(f"only {listener.count} of {messages} confirmed")
    elapsed = time.perf_counter() - start
    connection.disconnect()
    return messages / elapsed


def pair_rates(messages: int, window: int) -> tuple[float, float]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        BrokerPair(Path(tmp) / "pair", log_level="WARNING") as pair,
    ):
        replicated = stomp_rate(pair.live.stomp_port, "admin", "admin", messages, window)
        pair.kill(pair.backup)
        deadline = time.monotonic() + 10
        while not pair.live.status().get("degraded") and time.monotonic() < deadline:
            time.sleep(0.01)
        live_only = stomp_rate(pair.live.stomp_port, "admin", "admin", messages, window)
    return replicated, live_only


def rabbitmq_rate(messages: int, window: int) -> float:
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "rabbitmq.sh"), "ensure"],
        check=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    return stomp_rate(61613, "guest", "guest", messages, window, vhost="/")


def recovery_seconds(count: int) -> float:
    """Write a journal of ``count`` persistent messages with the engine, then recover it."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "journal"
        engine = Engine()
        with Journal.open(directory, sync=SyncPolicy.never()) as journal:
            batch: list[tuple[int, bytes]] = []
            for i in range(count):
                engine.send("queue://recovery", BODY, persistent=True, duplicate_id=f"d{i}")
                batch.extend(r.encode() for r in engine.drain_records())
                if len(batch) >= 1000:
                    journal.append_many(batch)
                    batch = []
            if batch:
                journal.append_many(batch)
            journal.sync()
        start = time.perf_counter()
        with Journal.open(directory, sync=SyncPolicy.never()) as journal:
            recovered = Engine.recover(decode(r.type, r.payload) for r in journal.replay())
        elapsed = time.perf_counter() - start
        stats = recovered.stats()
        assert stats.messages == count, stats
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--recovery-messages", type=int, default=100_000)
    parser.add_argument("--no-rabbitmq", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    replicated, live_only = pair_rates(args.messages, args.window)
    figures: dict[str, float | bool | None] = {
        "replicated_msgs_per_s": replicated,
        "live_only_msgs_per_s": live_only,
        "replicated_vs_live_only": replicated / live_only,
    }
    if not args.no_rabbitmq:
        rabbit = rabbitmq_rate(args.messages, args.window)
        figures["rabbitmq_msgs_per_s"] = rabbit
        figures["pair_vs_rabbitmq"] = replicated / rabbit
    recovery = recovery_seconds(args.recovery_messages)
    figures["recovery_seconds"] = recovery
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(
        f"persistent STOMP sends, 1 KiB, receipt each, window {args.window}, {args.messages} msgs"
    )
    print(f"  replicated pair   {replicated:10,.0f} msg/s")
    print(f"  live-only         {live_only:10,.0f} msg/s")
    print(f"  replicated / live-only = {replicated / live_only:.2f}  (target >= 0.5)")
    if "rabbitmq_msgs_per_s" in figures:
        rabbit = float(figures["rabbitmq_msgs_per_s"] or 0)
        print(f"  RabbitMQ          {rabbit:10,.0f} msg/s")
        print(f"  pair / RabbitMQ = {replicated / rabbit:.2f}  (target >= 0.5)")
    print(f"recovery of {args.recovery_messages:,} messages: {recovery:.2f} s  (target < 2 s)")


if __name__ == "__main__":
    main()
