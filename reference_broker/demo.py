"""The live failover demo (`make demo`, `hafailover demo`): a real pair, real clients, a
real SIGKILL.

It starts the bundled pair in a temporary directory, runs a producer and a consumer through
the hafailover library (the same code as `hafailover producer` / `consumer`) on STOMP, and
with ``--amqp`` on AMQP 1.0 as well, SIGKILLs the live half-way, and prints what happened:
how long the backup took to serve, the time from the kill to the first confirmed send, what
the library replayed, resent or rolled back and retried, and a total-queue check of every
seq: sent = received, nothing lost, nothing duplicated. The exit status is 0 only then.

Every process it starts is stopped when it ends, on Ctrl-C and on SIGTERM too.
"""

from __future__ import annotations

import argparse
import collections
import logging
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import attrs

from hafailover import AckMode, Connection, ConnectionEvent, FailoverCompleted, Message
from hafailover.tools import (
    ConsumerOptions,
    ProducerOptions,
    Progress,
    run_consumer,
    run_producer,
    seq_of,
)
from reference_broker.pair import BrokerPair

__all__ = ["main"]

CLIENT_OPTIONS = (
    "heartbeat=250ms&max_retry_interval=500ms&initial_connect_attempts=5&call_failover_timeout=30s"
)


@attrs.define
class Flow:
    """One protocol's producer and consumer, and what they saw."""

    protocol: str
    url: str
    producer: ProducerOptions
    consumer: ConsumerOptions
    stop_consumer: threading.Event = attrs.field(factory=threading.Event)
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    outcomes: dict[int, str] = attrs.field(factory=dict)
    confirmed_at: list[float] = attrs.field(factory=list)
    received: collections.Counter[Any] = attrs.field(factory=collections.Counter)
    producer_summary: dict[str, Any] = attrs.field(factory=dict)
    consumer_summary: dict[str, Any] = attrs.field(factory=dict)
    producer_failed_over_at: list[float] = attrs.field(factory=list)
    threads: list[threading.Thread] = attrs.field(factory=list)

    def on_outcome(self, seq: int, outcome: str) -> None:
        with self.lock:
            self.outcomes[seq] = outcome
            if outcome == "confirmed":
                self.confirmed_at.append(time.monotonic())

    def on_producer_connected(self, connection: Connection) -> None:
        def on_event(event: ConnectionEvent) -> None:
            if isinstance(event, FailoverCompleted):
                self.producer_failed_over_at.append(time.monotonic())

        connection.add_event_listener(on_event)

    def on_consumed(self, message: Message) -> None:
        with self.lock:
            self.received[seq_of(message)] += 1

    @property
    def confirmed(self) -> set[int]:
        with self.lock:
            return {seq for seq, outcome in self.outcomes.items() if outcome == "confirmed"}

    def start(self) -> None:
        def produce() -> None:
            result = run_producer(
                self.producer,
                on_outcome=self.on_outcome,
                progress=Progress(enabled=False),
                on_connected=self.on_producer_connected,
            )
            self.producer_summary = result.summary

        def consume() -> None:
            result = run_consumer(
                self.consumer,
                stop=self.stop_consumer,
                on_consumed=self.on_consumed,
                progress=Progress(enabled=False),
            )
            self.consumer_summary = result.summary

        for name, target in (("producer", produce), ("consumer", consume)):
            thread = threading.Thread(target=target, name=f"{self.protocol}-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def producer_done(self) -> bool:
        return not self.threads[0].is_alive()

    def all_received(self) -> bool:
        confirmed = self.confirmed
        with self.lock:
            return confirmed.issubset(self.received)


def _flows(pair: BrokerPair, *, amqp: bool, count: int) -> list[Flow]:
    flows = []
    # STOMP: transacted batches both ways, the hardest case for failover (F9, F13).
    url = f"{pair.stomp_url}?{CLIENT_OPTIONS}"
    flows.append(
        Flow(
            "STOMP",
            url,
            ProducerOptions(
                url=url,
                destination="queue://demo.stomp",
                count=count,
                tx_batch=10,
                ack_mode=AckMode.SESSION_TRANSACTED,
                sleep=0.002,
            ),
            ConsumerOptions(
                url=url,
                destination="queue://demo.stomp",
                ack_mode=AckMode.SESSION_TRANSACTED,
                batch=10,
            ),
        )
    )
    if amqp:
        # AMQP: pipelined confirmed sends, and a transacted consumer.
        url = f"{pair.amqp_url}?{CLIENT_OPTIONS}"
        flows.append(
            Flow(
                "AMQP",
                url,
                ProducerOptions(
                    url=url,
                    destination="queue://demo.amqp",
                    count=count,
                    pipeline=20,
                    sleep=0.002,
                ),
                ConsumerOptions(
                    url=url,
                    destination="queue://demo.amqp",
                    ack_mode=AckMode.SESSION_TRANSACTED,
                    batch=10,
                ),
            )
        )
    return flows


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _report(flow: Flow, killed_at: float, out: Callable[[str], None]) -> bool:
    name = f"{flow.protocol:7}"
    with flow.lock:
        # A confirmation the dying live sent before it died does not count: the first one
        # after the producer's failover does.
        since = flow.producer_failed_over_at[0] if flow.producer_failed_over_at else killed_at
        after = [t for t in flow.confirmed_at if t >= since]
        outcomes = collections.Counter(flow.outcomes.values())
        received = collections.Counter(flow.received)
    if after:
        out(
            f"{name}first confirmed send after failover {after[0] - killed_at:.2f} s after the kill"
        )
    p, c = flow.producer_summary, flow.consumer_summary
    for role, summary in (("producer", p), ("consumer", c)):
        reports = [f"{s:.2f} s" for s in summary.get("failover_seconds", [])]
        out(
            f"{name}{role}: {summary.get('failovers', 0)} failover(s) "
            f"({', '.join(reports) or '-'} from loss detected to reconnected); "
            f"replayed {summary.get('replayed', 0)}, resent {summary.get('resent', 0)}, "
            f"released in doubt {summary.get('in_doubt_released', 0)}, transactions made "
            f"rollback-only {summary.get('transactions_rolled_back_by_failover', 0)}"
        )
    if "transactions_rolled_back" in p:
        out(
            f"{name}producer transactions: {p['commits']} committed, "
            f"{p['transactions_rolled_back']} rolled back by failover and retried with the "
            f"same duplicate ids, {p['commit_outcome_unknown']} with unknown outcome"
        )
    if "transactions_rolled_back" in c:
        out(
            f"{name}consumer transactions: {c['commits']} committed, "
            f"{c['transactions_rolled_back']} rolled back by failover "
            f"({c['discarded_and_redelivered']} messages redelivered), "
            f"{c['commit_outcome_unknown']} with unknown outcome"
        )
    for summary in (p, c):
        if "error" in summary:
            out(f"{name}{summary['command']} error: {summary['error']}")
    confirmed = {seq for seq, outcome in flow.outcomes.items() if outcome == "confirmed"}
    sent = len(flow.outcomes)
    lost = confirmed - set(received)
    duplicated = sum(1 for n in received.values() if n > 1)
    unexpected = set(received) - set(flow.outcomes)
    in_doubt = outcomes["in-doubt"]
    delivered = sum(1 for seq in flow.outcomes if seq in received)
    ok = (
        not lost
        and not duplicated
        and not unexpected
        and sent == flow.producer.count
        and len(confirmed) == sent
        and delivered == sent
    )
    out(
        f"{name}sent {sent}, confirmed {len(confirmed)}, in doubt {in_doubt}, "
        f"received {sum(received.values())}: lost {len(lost)}, duplicated {duplicated}, "
        f"unexpected {len(unexpected)}  {'OK' if ok else 'FAILED'}"
    )
    return ok


def run(*, amqp: bool, count: int, out: Callable[[str], None]) -> bool:
    logging.basicConfig(format="  log    %(message)s", level=logging.WARNING)
    logging.getLogger("stomp.py").setLevel(logging.CRITICAL)  # its own reconnect chatter
    with (
        tempfile.TemporaryDirectory(prefix="hafailover-demo-") as tmp,
        BrokerPair(
            Path(tmp), user="demo", password=secrets.token_hex(8), heartbeat_timeout=0.5
        ) as pair,
    ):
        live, backup = pair.live, pair.backup
        out(
            f"pair    live pid {live.pid} (stomp :{live.stomp_port}, amqp :{live.amqp_port}), "
            f"backup pid {backup.pid} (stomp :{backup.stomp_port}, amqp :{backup.amqp_port}), "
            "synchronized"
        )
        flows = _flows(pair, amqp=amqp, count=count)
        for flow in flows:
            kind = "transacted batches of 10" if flow.producer.tx_batch else "pipelined sends"
            out(
                f"{flow.protocol:7}{count} messages to {flow.producer.destination}: producer "
                f"with {kind}, transacted consumer, duplicate detection on"
            )
            flow.start()
        half = count // 2
        if not _wait(lambda: any(len(f.confirmed) >= half for f in flows), 60):
            out("kill    the producers did not reach half-way in time")
        # A confirmation is also the end of a transacted batch: wait into the next one, so
        # the kill finds a transaction with work in it (F9).
        time.sleep(0.012)
        killed = pair.live
        done = ", ".join(f"{f.protocol} {len(f.confirmed)}" for f in flows)
        out(f"SIGKILL live (pid {killed.pid}) with confirmed sends: {done}")
        killed_at = time.monotonic()
        pair.kill(killed)
        pair.wait_active(30)
        out(f"backup  serving as live {time.monotonic() - killed_at:.2f} s after the kill")
        _wait(lambda: all(f.producer_done() for f in flows), 60)
        _wait(lambda: all(f.all_received() for f in flows), 15)
        for flow in flows:
            flow.stop_consumer.set()
        for flow in flows:
            for thread in flow.threads:
                thread.join(15)
        ok = True
        for flow in flows:
            ok = _report(flow, killed_at, out) and ok
    out("pair    stopped; " + ("nothing lost, nothing duplicated" if ok else "CHECK FAILED"))
    return ok


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through BrokerPair.__exit__: nodes stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hafailover demo", description="Kill the live broker under real traffic."
    )
    parser.add_argument("--amqp", action="store_true", help="run AMQP 1.0 clients as well")
    parser.add_argument("--count", type=int, default=2000, help="messages per producer")
    args = parser.parse_args(argv)
    if args.count < 20:
        parser.error("--count must be at least 20")
    signal.signal(signal.SIGTERM, _terminate)

    def out(line: str) -> None:
        print(line, flush=True)

    try:
        ok = run(amqp=args.amqp, count=args.count, out=out)
    except KeyboardInterrupt:
        print("interrupted; pair stopped", file=sys.stderr)
        return 130
    return 0 if ok else 1
