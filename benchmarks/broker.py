"""Reference broker throughput and recovery, as ratios measured in one run.

Run: .venv/bin/python benchmarks/broker.py [--messages N] [--no-rabbitmq]

1. Persistent STOMP sends of 1 KiB with a receipt each, pipelined (at most --window
   unconfirmed), from raw stomp.py: the replicated pair (live + synchronized backup) against
   the same live without a backup (live-only, degraded). Target: replicated >= 0.5 x live-only.
2. The same workload against RabbitMQ (Debian's rabbitmq-server with rabbitmq_stomp, started
   by scripts/rabbitmq.sh) on this machine. Target: the pair >= 0.5 x RabbitMQ.
3. Recovery: the time to open a journal holding 100,000 persistent 1 KiB messages and rebuild
   the engine from it, as a node does when it takes over. Target: under 2 seconds.
4. A garbage flood (--flood-connections, 1,000): that many connections to the live's STOMP
   and AMQP ports each trickle garbage (a few bytes every 100 ms; a connection the broker
   closes is opened again) while a well-behaved client runs workload 1 on the pair. Target:
   under the flood >= 0.5 x without it. --only-flood runs this one alone.
5. A consumer that never acknowledges (--never-ack N, 1,000,000; --only-never-ack runs it
   alone): a client-acknowledge STOMP subscriber takes its prefetch and acknowledges nothing
   while N non-persistent 100-byte messages are sent; the live's RSS growth, in all and per
   message. There is no paging: waiting messages stay in memory, so the bound is per message.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
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


class GarbageFlood:
    """``count`` connections trickling garbage at the live until stopped; reopens the ones
    the broker closes. Half go to STOMP (a CONNECT line, then header junk, then random
    bytes), half to AMQP (a protocol header, then random bytes)."""

    def __init__(self, stomp_port: int, amqp_port: int, count: int) -> None:
        self.ports = [stomp_port if i % 2 == 0 else amqp_port for i in range(count)]
        self.stop = threading.Event()
        self.reopened = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, i: int) -> tuple[socket.socket, bytes]:
        sock = socket.create_connection(("127.0.0.1", self.ports[i]), timeout=5)
        sock.setblocking(False)
        prefix = b"CONNECT\nlogin:" if self.ports[i] == self.ports[0] else b"AMQP\x03\x01\x00\x00"
        return sock, prefix + os.urandom(4096)

    @staticmethod
    def _trickle(sock: socket.socket, rest: bytes) -> tuple[socket.socket, bytes] | None:
        """Send the next few bytes; None once the broker has closed the connection."""
        sock.send(rest[:4])
        with contextlib.suppress(BlockingIOError):
            if sock.recv(65536) == b"":
                return None
        return sock, rest[4:] or os.urandom(4096)

    def _run(self) -> None:
        conns: list[tuple[socket.socket, bytes] | None] = []
        for i in range(len(self.ports)):
            try:
                conns.append(self._open(i))
            except OSError:
                conns.append(None)
        while not self.stop.wait(0.1):
            for i, entry in enumerate(conns):
                trickled = None
                if entry is not None:
                    try:
                        trickled = self._trickle(*entry)
                    except OSError:
                        trickled = None
                    if trickled is None:
                        entry[0].close()
                if trickled is None:
                    self.reopened += 1
                    try:
                        trickled = self._open(i)
                    except OSError:
                        trickled = None
                conns[i] = trickled
        for entry in conns:
            if entry is not None:
                entry[0].close()

    def __enter__(self) -> GarbageFlood:
        self.thread.start()
        time.sleep(2.0)  # all connected and trickling before the measurement
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def flood_rates(messages: int, window: int, connections: int) -> tuple[float, float, int]:
    """Workload 1 on the pair without, then under, a garbage flood; and the reopen count."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        BrokerPair(Path(tmp) / "pair", log_level="WARNING") as pair,
    ):
        pair.wait_synchronized(30)
        live = pair.live
        calm = stomp_rate(live.stomp_port, "admin", "admin", messages, window)
        with GarbageFlood(live.stomp_port, live.amqp_port, connections) as flood:
            flooded = stomp_rate(live.stomp_port, "admin", "admin", messages, window)
        assert pair.live is live, "the live lost its role under the flood"
    return calm, flooded, flood.reopened


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def never_ack_growth(count: int) -> tuple[int, int, float]:
    """(RSS before, RSS peak, seconds) of a live while ``count`` messages reach a consumer
    that never acknowledges."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        BrokerPair(Path(tmp) / "pair", log_level="WARNING", start_backup=False) as pair,
    ):
        live = pair.live
        destination = f"/queue/never-ack-{time.monotonic_ns()}"
        consumer = stomp.Connection12([("127.0.0.1", live.stomp_port)], heartbeats=(0, 0))
        consumer.connect("admin", "admin", wait=True)
        consumer.subscribe(destination, id="s", ack="client-individual")
        before = _rss(live.pid)
        peak = before
        producer = stomp.Connection12([("127.0.0.1", live.stomp_port)], heartbeats=(0, 0))
        listener = Receipts()
        producer.set_listener("p", listener)
        producer.connect("admin", "admin", wait=True)
        body = b"m" * 100
        start = time.perf_counter()
        for i in range(count):
            producer.send(destination, body)
            if i % 10_000 == 9_999:
                producer.send(destination, body, headers={"receipt": str(i)})
                with listener.condition:  # keep the producer within a batch of the broker
                    while listener.count < (i + 1) // 10_000:
                        listener.condition.wait(30)
                peak = max(peak, _rss(live.pid))
        elapsed = time.perf_counter() - start
        peak = max(peak, _rss(live.pid))
        producer.disconnect()
        consumer.disconnect()
    return before, peak, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--recovery-messages", type=int, default=100_000)
    parser.add_argument("--no-rabbitmq", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--flood-connections", type=int, default=1000)
    parser.add_argument("--only-flood", action="store_true")
    parser.add_argument("--never-ack", type=int, default=1_000_000)
    parser.add_argument("--only-never-ack", action="store_true")
    args = parser.parse_args()

    if args.only_never_ack:
        before, peak, seconds = never_ack_growth(args.never_ack)
        print(
            f"never-acknowledging consumer, {args.never_ack:,} messages of 100 B"
            f" in {seconds:.0f} s: live RSS {before / 2**20:.0f} -> {peak / 2**20:.0f} MiB,"
            f" {(peak - before) / args.never_ack:.0f} bytes per waiting message"
        )
        return

    calm, flooded, reopened = flood_rates(args.messages, args.window, args.flood_connections)
    flood_figures = {
        "calm_msgs_per_s": calm,
        "flooded_msgs_per_s": flooded,
        "flooded_vs_calm": flooded / calm,
        "flood_connections": args.flood_connections,
        "flood_reopened": reopened,
    }
    if args.only_flood:
        if args.json:
            print(json.dumps(flood_figures, indent=2))
            return
        print_flood(flood_figures, args)
        return

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
    figures.update(flood_figures)
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
    print_flood(flood_figures, args)


def print_flood(figures: dict[str, float], args: argparse.Namespace) -> None:
    print(
        f"under a garbage flood of {args.flood_connections} slow connections "
        f"({figures['flood_reopened']:.0f} reopened after the broker closed them)"
    )
    print(f"  calm              {figures['calm_msgs_per_s']:10,.0f} msg/s")
    print(f"  flooded           {figures['flooded_msgs_per_s']:10,.0f} msg/s")
    print(f"  flooded / calm = {figures['flooded_vs_calm']:.2f}  (target >= 0.5)")


if __name__ == "__main__":
    main()
