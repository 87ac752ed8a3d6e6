"""What applications do, each path against the raw client doing the same, in one run.

Run: .venv/bin/python benchmarks/paths.py [--quick] [--json]

benchmarks/client.py measures the fastest path (pipelined sends). Applications mostly call
``send()`` and wait, commit small transactions and consume; each of those is measured here
against a bundled pair (live + synchronized backup, persistent 1 KiB messages), alternated
with the raw client doing the same thing, best of --repeats:

1. Synchronous confirmed send, one at a time: ``producer.send()`` and
   ``send_async().result()`` vs stomp.py sending each with a receipt and waiting for it, and
   vs proton's event-driven sender sending the next message when the last is accepted.
2. Pipelined confirmed sends: ``send_async`` + ``flush`` vs stomp.py with a receipt per send
   (counted as they come), and vs proton's event-driven sender (unsettled, as far as credit
   allows, counting accepted outcomes).
3. Transactions of 1, 10 and 100 sends: commit latency and messages per second vs stomp.py
   BEGIN / SEND... / COMMIT with a receipt on the COMMIT, and vs proton's transactional
   sender (declare, the batch sent in the transaction, commit, settled by the broker).
4. Receives of N queued messages in AUTO, CLIENT (acknowledge every 100) and DUPS_OK, with
   prefetch 100 and 1000, vs a stomp.py listener acknowledging each (client-individual) and
   vs proton's event-driven receiver accepting each.

Latencies are p50 and p99 in milliseconds; ratios are ours / raw (higher is better for
rates, lower for latencies).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import proton
import stomp
from proton.handlers import MessagingHandler, TransactionHandler
from proton.reactor import Container

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from hafailover import AckMode  # noqa: E402
from hafailover.tools.paths import (  # noqa: E402
    PathResult,
    fill,
    receive,
    send_one_at_a_time,
    send_pipelined,
    subscribe_one_at_a_time,
    subscriptions_per_run,
    transactions,
)
from reference_broker.pair import BrokerPair  # noqa: E402

BODY = b"x" * 1024  # as hafailover.tools.paths sends
PERSISTENT = {"persistent": "true"}


def queue_name() -> str:
    return f"paths-{time.monotonic_ns()}"


def best(repeats: int, runs: dict[str, Callable[[], PathResult]]) -> dict[str, PathResult]:
    """Each contender ``repeats`` times, alternated; the run with the best rate kept."""
    results: dict[str, list[PathResult]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            results[name].append(run())
    return {name: max(rs, key=lambda r: r.rate) for name, rs in results.items()}


# --- raw stomp.py ----------------------------------------------------------------------------


class StompCounter(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.receipts: set[str] = set()
        self.messages = 0
        self.condition = threading.Condition()
        self.connection: Any = None
        self.ack_each = False

    def on_receipt(self, frame: Any) -> None:
        with self.condition:
            self.receipts.add(frame.headers["receipt-id"])
            self.condition.notify_all()

    def on_message(self, frame: Any) -> None:
        if self.ack_each:
            self.connection.ack(frame.headers["ack"])
        with self.condition:
            self.messages += 1
            self.condition.notify_all()

    def wait(self, done: Callable[[], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with self.condition:
            while not done():
                if not self.condition.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError("the raw stomp.py client got no answer in time")


def raw_stomp_connection(port: int) -> tuple[Any, StompCounter]:
    connection = stomp.Connection12([("127.0.0.1", port)], heartbeats=(0, 0), auto_decode=False)
    listener = StompCounter()
    listener.connection = connection
    connection.set_listener("bench", listener)
    connection.connect("admin", "admin", wait=True)
    # The stronger anchor: stock stomp.py leaves Nagle's algorithm on, which costs it about
    # 40 ms on every COMMIT after SENDs (docs/benchmarks.md); here it has TCP_NODELAY too.
    connection.transport.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection, listener


def stomp_sync(port: int, count: int) -> PathResult:
    connection, listener = raw_stomp_connection(port)
    queue = f"/queue/{queue_name()}"
    latencies = []
    start = time.perf_counter()
    for i in range(count):
        sent = time.perf_counter()
        receipt = f"r{i}"
        connection.send(queue, BODY, headers={**PERSISTENT, "receipt": receipt})
        listener.wait(lambda r=receipt: r in listener.receipts)
        latencies.append(time.perf_counter() - sent)
    result = PathResult(count, time.perf_counter() - start, tuple(latencies))
    connection.disconnect()
    return result


def stomp_subscribe(port: int, count: int) -> PathResult:
    """SUBSCRIBE with a receipt, waited for, then UNSUBSCRIBE, one at a time."""
    connection, listener = raw_stomp_connection(port)
    latencies = []
    start = time.perf_counter()
    for i in range(count):
        began = time.perf_counter()
        receipt = f"s{i}"
        connection.subscribe(
            f"/queue/{queue_name()}", id=f"sub{i}", ack="client", headers={"receipt": receipt}
        )
        listener.wait(lambda r=receipt: r in listener.receipts)
        latencies.append(time.perf_counter() - began)
        connection.unsubscribe(id=f"sub{i}")
    result = PathResult(count, time.perf_counter() - start, tuple(latencies))
    connection.disconnect()
    return result


def stomp_pipelined(port: int, count: int) -> PathResult:
    connection, listener = raw_stomp_connection(port)
    queue = f"/queue/{queue_name()}"
    start = time.perf_counter()
    for i in range(count):
        connection.send(queue, BODY, headers={**PERSISTENT, "receipt": f"r{i}"})
    listener.wait(lambda: len(listener.receipts) >= count)
    result = PathResult(count, time.perf_counter() - start)
    connection.disconnect()
    return result


def stomp_transactions(port: int, batches: int, size: int) -> PathResult:
    connection, listener = raw_stomp_connection(port)
    queue = f"/queue/{queue_name()}"
    latencies = []
    start = time.perf_counter()
    for b in range(batches):
        tx = connection.begin()
        for _ in range(size):
            connection.send(queue, BODY, headers=PERSISTENT, transaction=tx)
        committed = time.perf_counter()
        connection.commit(tx, headers={"receipt": f"c{b}"})
        listener.wait(lambda r=f"c{b}": r in listener.receipts)
        latencies.append(time.perf_counter() - committed)
    result = PathResult(batches * size, time.perf_counter() - start, tuple(latencies))
    connection.disconnect()
    return result


def stomp_receive(port: int, queue: str, count: int, prefetch: int) -> PathResult:
    connection, listener = raw_stomp_connection(port)
    listener.ack_each = True
    start = time.perf_counter()
    connection.subscribe(
        f"/queue/{queue}",
        id="s",
        ack="client-individual",
        headers={"prefetch-count": str(prefetch)},
    )
    listener.wait(lambda: listener.messages >= count)
    result = PathResult(count, time.perf_counter() - start)
    connection.disconnect()
    return result


# --- raw proton (event-driven) ---------------------------------------------------------------


def proton_connect(event: Any, url: str) -> Any:
    return event.container.connect(
        url, user="admin", password="admin", allowed_mechs="PLAIN", allow_insecure_mechs=True
    )


class ProtonSender(MessagingHandler):  # type: ignore[misc]
    def __init__(self, url: str, address: str, count: int, pipelined: bool) -> None:
        super().__init__()
        self.url, self.address, self.count, self.pipelined = url, address, count, pipelined
        self.sent = self.accepted = 0
        self.sent_at: dict[int, float] = {}
        self.latencies: list[float] = []

    def on_start(self, event: Any) -> None:
        event.container.create_sender(proton_connect(event, self.url), self.address)

    def on_sendable(self, event: Any) -> None:
        self._send(event.sender)

    def _send(self, sender: Any) -> None:
        while sender.credit and self.sent < self.count:
            if not self.pipelined and self.sent > self.accepted:
                return  # one at a time: the next goes when this one is accepted
            delivery = sender.send(proton.Message(body=BODY, durable=True))
            self.sent_at[id(delivery)] = time.perf_counter()
            self.sent += 1

    def on_accepted(self, event: Any) -> None:
        self.accepted += 1
        sent = self.sent_at.pop(id(event.delivery), None)
        if sent is not None:
            self.latencies.append(time.perf_counter() - sent)
        if self.accepted >= self.count:
            event.connection.close()
        elif not self.pipelined:
            self._send(event.sender)


class ProtonTransactional(MessagingHandler, TransactionHandler):  # type: ignore[misc]
    """proton's transactional sender: declare, send a batch in the transaction, commit,
    and again; latencies are from the commit to the broker's settlement of it."""

    def __init__(self, url: str, address: str, batches: int, size: int) -> None:
        super().__init__()
        self.url, self.address, self.batches, self.size = url, address, batches, size
        self.committed = self.in_batch = 0
        self.transaction: Any = None
        self.committing = False
        self.commit_at = 0.0
        self.latencies: list[float] = []

    def on_start(self, event: Any) -> None:
        self.container = event.container
        self.connection = proton_connect(event, self.url)
        self.sender = event.container.create_sender(self.connection, self.address)
        self.container.declare_transaction(self.connection, handler=self)

    def on_transaction_declared(self, event: Any) -> None:
        self.transaction = event.transaction
        self._send_batch()

    def on_sendable(self, event: Any) -> None:
        self._send_batch()

    def _send_batch(self) -> None:
        if self.transaction is None or self.committing:
            return
        while self.sender.credit and self.in_batch < self.size:
            self.transaction.send(self.sender, proton.Message(body=BODY, durable=True))
            self.in_batch += 1
        if self.in_batch == self.size:
            self.committing = True
            self.commit_at = time.perf_counter()
            self.transaction.commit()

    def on_transaction_committed(self, event: Any) -> None:
        self.latencies.append(time.perf_counter() - self.commit_at)
        self.committed += 1
        if self.committed >= self.batches:
            self.connection.close()
            return
        self.transaction, self.in_batch, self.committing = None, 0, False
        self.container.declare_transaction(self.connection, handler=self)

    def on_transaction_commit_failed(self, event: Any) -> None:
        raise RuntimeError("the broker refused a commit of the raw transactional sender")


class ProtonReceiver(MessagingHandler):  # type: ignore[misc]
    def __init__(self, url: str, address: str, count: int, prefetch: int) -> None:
        super().__init__(prefetch=prefetch, auto_accept=True)
        self.url, self.address, self.count = url, address, count
        self.received = 0

    def on_start(self, event: Any) -> None:
        event.container.create_receiver(proton_connect(event, self.url), self.address)

    def on_message(self, event: Any) -> None:
        self.received += 1
        if self.received >= self.count:
            event.connection.close()


class ProtonSubscriber(MessagingHandler):  # type: ignore[misc]
    """Attach a receiver to a fresh queue, wait for the broker's attach, detach; again."""

    def __init__(self, url: str, count: int) -> None:
        super().__init__(prefetch=0)
        self.url, self.count = url, count
        self.latencies: list[float] = []
        self.began = 0.0
        self.receiver: Any = None
        self.connection: Any = None
        self.started = self.ended = 0.0

    def on_start(self, event: Any) -> None:
        self.connection = proton_connect(event, self.url)

    def on_connection_opened(self, event: Any) -> None:
        self._next(event)  # timed from the first attach on an open connection, as ours

    def _next(self, event: Any) -> None:
        if len(self.latencies) >= self.count:
            self.ended = time.perf_counter()
            self.connection.close()
            return
        self.began = time.perf_counter()
        if not self.started:
            self.started = self.began
        self.receiver = event.container.create_receiver(self.connection, f"queue://{queue_name()}")

    def on_link_opened(self, event: Any) -> None:
        if event.receiver is not None and event.receiver == self.receiver:
            self.latencies.append(time.perf_counter() - self.began)
            event.receiver.close()
            self._next(event)


def proton_subscribe(port: int, count: int) -> PathResult:
    handler = ProtonSubscriber(f"amqp://127.0.0.1:{port}", count)
    Container(handler).run()
    return PathResult(count, handler.ended - handler.started, tuple(handler.latencies))


def proton_send(port: int, count: int, *, pipelined: bool) -> PathResult:
    address = f"queue://{queue_name()}"
    handler = ProtonSender(f"amqp://127.0.0.1:{port}", address, count, pipelined)
    start = time.perf_counter()
    Container(handler).run()
    return PathResult(count, time.perf_counter() - start, tuple(handler.latencies))


def proton_transactions(port: int, batches: int, size: int) -> PathResult:
    address = f"queue://{queue_name()}"
    handler = ProtonTransactional(f"amqp://127.0.0.1:{port}", address, batches, size)
    start = time.perf_counter()
    Container(handler).run()
    return PathResult(batches * size, time.perf_counter() - start, tuple(handler.latencies))


def proton_receive(port: int, queue: str, count: int, prefetch: int) -> PathResult:
    handler = ProtonReceiver(f"amqp://127.0.0.1:{port}", f"queue://{queue}", count, prefetch)
    start = time.perf_counter()
    Container(handler).run()
    return PathResult(count, time.perf_counter() - start)


# --- main ------------------------------------------------------------------------------------

SECTIONS: Final = ("sync", "pipelined", "subscribe", "commit", "receive")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and one run")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--repeats", type=int, help="alternated runs, best kept (3)")
    parser.add_argument(
        "--subscriptions",
        type=int,
        help="consumers created per run in the subscribe section (100 quick, 500 otherwise;"
        " at 20 a run's ratio moved by 0.3 between runs of one tree)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        help="measure only this section (may be given more than once; default: all)",
    )
    args = parser.parse_args()
    if args.subscriptions is not None and args.subscriptions < 1:
        parser.error(f"--subscriptions must be at least 1, not {args.subscriptions}")
    only = set(args.only or SECTIONS)
    repeats = args.repeats or (1 if args.quick else 3)
    sync_count = 200 if args.quick else 1000
    pipelined_count = 2000 if args.quick else 10_000
    receive_count = 2000 if args.quick else 5000
    rows: list[dict[str, Any]] = []

    def row(
        path: str, ours: PathResult, raw: PathResult, anchor: str, latency: bool = False
    ) -> None:
        entry: dict[str, Any] = {
            "path": path,
            "anchor": anchor,
            "ours_rate": round(ours.rate, 1),
            "raw_rate": round(raw.rate, 1),
            "rate_ratio": round(ours.rate / raw.rate, 2),
        }
        if latency:
            entry.update(
                ours_p50_ms=round(ours.p(50), 2),
                ours_p99_ms=round(ours.p(99), 2),
                raw_p50_ms=round(raw.p(50), 2),
                raw_p99_ms=round(raw.p(99), 2),
                p50_ratio=round(ours.p(50) / raw.p(50), 2) if raw.p(50) else None,
            )
        rows.append(entry)

    with (
        tempfile.TemporaryDirectory() as tmp,
        BrokerPair(Path(tmp) / "pair", heartbeat_timeout=60, log_level="WARNING") as pair,
    ):
        pair.wait_synchronized(60)
        live = pair.live
        stomp_url, amqp_url = pair.stomp_url, pair.amqp_url
        sp, ap = live.stomp_port, live.amqp_port
        # 1. synchronous confirmed sends
        protocols = (("stomp", stomp_url), ("amqp", amqp_url))
        for protocol, url in protocols if "sync" in only else ():
            raw: Callable[[], PathResult] = (
                (lambda: stomp_sync(sp, sync_count))
                if protocol == "stomp"
                else (lambda: proton_send(ap, sync_count, pipelined=False))
            )
            anchor = (
                "stomp.py, a receipt per send waited for"
                if protocol == "stomp"
                else "proton event-driven, next send on each acceptance"
            )
            for how in ("send", "send_async().result()"):
                got = best(
                    repeats,
                    {
                        "ours": lambda u=url, h=how: send_one_at_a_time(
                            u, sync_count, wait_on_completion=h != "send"
                        ),
                        "raw": raw,
                    },
                )
                row(f"{protocol} {how}, one at a time", got["ours"], got["raw"], anchor, True)
        # 2. pipelined confirmed sends
        if "pipelined" in only:
            got = best(
                repeats,
                {
                    "ours": lambda: send_pipelined(stomp_url, pipelined_count),
                    "raw": lambda: stomp_pipelined(sp, pipelined_count),
                },
            )
            row("stomp pipelined confirmed", got["ours"], got["raw"], "stomp.py receipts")
            got = best(
                repeats,
                {
                    "ours": lambda: send_pipelined(amqp_url, pipelined_count // 2),
                    "raw": lambda: proton_send(ap, pipelined_count // 2, pipelined=True),
                },
            )
            row("amqp pipelined confirmed", got["ours"], got["raw"], "proton event-driven")
        # 3. subscriptions, one at a time
        subscriptions = args.subscriptions or subscriptions_per_run(args.quick)
        for protocol, url in protocols if "subscribe" in only else ():
            raw_subscribe: Callable[[], PathResult] = (
                (lambda: stomp_subscribe(sp, subscriptions))
                if protocol == "stomp"
                else (lambda: proton_subscribe(ap, subscriptions))
            )
            got = best(
                repeats,
                {
                    "ours": lambda u=url, n=subscriptions: subscribe_one_at_a_time(u, n),
                    "raw": raw_subscribe,
                },
            )
            row(
                f"{protocol} create_consumer(), one at a time",
                got["ours"],
                got["raw"],
                "stomp.py SUBSCRIBE with a receipt, waited"
                if protocol == "stomp"
                else "proton receiver attach, waited for the broker's",
                True,
            )
        # 4. transactions (raw: stomp.py; AMQP measured for hafailover alone)
        for size in (1, 10, 100) if "commit" in only else ():
            batches = max(5, (sync_count // 2) // size)
            got = best(
                repeats,
                {
                    "ours": lambda s=size, b=batches: transactions(stomp_url, b, s),
                    "raw": lambda s=size, b=batches: stomp_transactions(sp, b, s),
                },
            )
            row(
                f"stomp commit of {size}",
                got["ours"],
                got["raw"],
                "stomp.py BEGIN/SEND/COMMIT+receipt",
                True,
            )
            got = best(
                repeats,
                {
                    "ours": lambda s=size, b=batches: transactions(amqp_url, b, s),
                    "raw": lambda s=size, b=batches: proton_transactions(ap, b, s),
                },
            )
            row(
                f"amqp commit of {size}",
                got["ours"],
                got["raw"],
                "proton transactional sender (declare, send, commit)",
                True,
            )
        # 5. receives
        for protocol, url in protocols if "receive" in only else ():
            for prefetch in (100, 1000):
                for mode in (AckMode.AUTO, AckMode.CLIENT, AckMode.DUPS_OK):
                    count = receive_count

                    def ours_run(
                        u: str = url, m: AckMode = mode, c: int = count, f: int = prefetch
                    ) -> PathResult:
                        queue = queue_name()
                        fill(u, queue, c)
                        return receive(u, queue, c, m, f)

                    def raw_run(
                        u: str = url, c: int = count, p: str = protocol, f: int = prefetch
                    ) -> PathResult:
                        queue = queue_name()
                        fill(u, queue, c)
                        if p == "stomp":
                            return stomp_receive(sp, queue, c, f)
                        return proton_receive(ap, queue, c, f)

                    got = best(repeats, {"ours": ours_run, "raw": raw_run})
                    anchor = (
                        "stomp.py listener, client-individual ack each"
                        if protocol == "stomp"
                        else "proton event-driven receiver, accept each"
                    )
                    row(
                        f"{protocol} receive {mode.value}, prefetch {prefetch}",
                        got["ours"],
                        got["raw"],
                        anchor,
                    )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'path':44} {'ours':>10} {'raw':>10} {'ratio':>6}  latency p50/p99 ms (ours | raw)")
    for entry in rows:
        raw_rate = f"{entry['raw_rate']:>10,.0f}" if "raw_rate" in entry else f"{'-':>10}"
        ratio = f"{entry['rate_ratio']:>6.2f}" if "rate_ratio" in entry else f"{'-':>6}"
        latency = ""
        if "ours_p50_ms" in entry:
            latency = f"  {entry['ours_p50_ms']:.2f}/{entry['ours_p99_ms']:.2f}"
            if "raw_p50_ms" in entry:
                latency += f" | {entry['raw_p50_ms']:.2f}/{entry['raw_p99_ms']:.2f}"
        print(f"{entry['path']:44} {entry['ours_rate']:>10,.0f} {raw_rate} {ratio}{latency}")
    print(f"anchors: {sorted({e['anchor'] for e in rows})}")


if __name__ == "__main__":
    main()
