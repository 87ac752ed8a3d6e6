"""Traffic for the fault scenarios, and the total-queue check of what it left behind.

A confirmed producer (each persistent send waits for its confirmation; a send whose outcome
is unknown is sent again as the same Message, so its duplicate id makes the retry harmless)
and a CLIENT-acknowledge consumer run on their own threads while a test breaks the pair.
They record every send attempted and confirmed, every message acknowledged, and the longest
time one application call took (the stall the application saw). ``check`` drains the queue
afterwards and counts, as tests/integration/test_loss_checker.py does:

- lost = confirmed and never received (acknowledged, in doubt, or drained);
- unexpected = received and never attempted;
- duplicates = seqs received (acknowledged or drained) more than once.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from typing import Protocol

import attrs

import hafailover
from hafailover import (
    AckMode,
    AcknowledgeFailedError,
    HaFailoverError,
    Message,
    StaleAcknowledgeError,
    UnblockedError,
)
from reference_broker import BrokerPair
from tests.integration.support import AckingConsumer, url_for


class ConfirmedProducer(threading.Thread):
    """Persistent sends, one confirmed at a time, each retried as the same Message until the
    broker confirms it; ``refusals`` keeps what the broker refused (the text of each error)."""

    def __init__(self, url: str, queue: str, *, pace: float = 0.0, body: bytes = b"") -> None:
        super().__init__(name="confirmed-producer", daemon=True)
        self.url = url
        self.queue = queue
        self.pace = pace
        self.body = body
        self.stop = threading.Event()
        self.attempted: set[int] = set()
        self.confirmed: list[int] = []
        self.confirmed_at: list[float] = []
        self.started_at: list[float] = []  # when the attempt that was confirmed began
        self.refusals: list[tuple[float, HaFailoverError]] = []
        self.longest_stall = 0.0
        self.failovers = 0
        self.error: str | None = None
        self.connection: hafailover.Connection | None = None

    def run(self) -> None:
        try:
            with hafailover.connect(self.url) as connection:
                self.connection = connection
                producer = connection.create_session().create_producer(self.queue)
                seq = 0
                while not self.stop.is_set():
                    message = Message(body=self.body or f"m{seq}", properties={"seq": seq})
                    self.attempted.add(seq)
                    while True:
                        started = time.monotonic()
                        try:
                            producer.send(message)
                        except HaFailoverError as exc:
                            self._stalled(started)
                            self.refusals.append((time.monotonic(), exc))
                            if self.stop.is_set():
                                break  # in doubt: attempted, never counted as confirmed
                            time.sleep(0.05)
                            continue
                        self._stalled(started)
                        self.confirmed.append(seq)
                        self.confirmed_at.append(time.monotonic())
                        self.started_at.append(started)
                        break
                    seq += 1
                    if self.pace:
                        time.sleep(self.pace)
                self.failovers = connection.statistics().failovers
        except BaseException:  # noqa: BLE001 - reported by the test
            self.error = traceback.format_exc()

    def _stalled(self, started: float) -> None:
        self.longest_stall = max(self.longest_stall, time.monotonic() - started)


@attrs.frozen
class Outcome:
    """What the total-queue check found."""

    attempted: int
    confirmed: int
    received: int
    lost: list[int]
    unexpected: list[int]
    duplicates: dict[int, int]
    longest_stall: float
    failovers: int

    def line(self, scenario: str, protocol: str) -> str:
        return (
            f"{scenario} [{protocol}]: attempted={self.attempted} confirmed={self.confirmed} "
            f"received={self.received} lost={len(self.lost)} unexpected={len(self.unexpected)} "
            f"duplicates={len(self.duplicates)} longest stall={self.longest_stall:.2f}s "
            f"failovers={self.failovers}"
        )

    def assert_clean(self) -> None:
        assert self.lost == [], f"lost: {self.lost[:50]}"
        assert self.unexpected == [], f"unexpected: {self.unexpected[:50]}"
        assert self.duplicates == {}, f"duplicates (seq: times): {self.duplicates}"


def stop_all(*threads: ConfirmedProducer | AckingConsumer, timeout: float = 30.0) -> None:
    threads = tuple(thread for thread in threads if thread.ident is not None)  # started ones
    for thread in threads:
        thread.stop.set()
    for thread in threads:
        thread.join(timeout)
    for thread in threads:
        assert not thread.is_alive(), f"{thread.name} did not stop"
        assert thread.error is None, thread.error


class Sender(Protocol):
    """What ``check`` reads of a producer besides ConfirmedProducer."""

    attempted: set[int]
    confirmed: list[int]
    failovers: int


def drain_acknowledged(
    pair: BrokerPair, protocol: str, queue: str, *, idle: float = 2.0
) -> tuple[list[int], list[int]]:
    """Consume everything on ``queue``: (seqs acknowledged, seqs whose acknowledge is in
    doubt). Like the consumer, it counts only what it acknowledged: a drain that fails over
    gets its unacknowledged messages again (a DUPS_OK drain counted them twice: 11
    duplicates seen once, none of them the broker's), and after a failover it waits longer
    before it calls the queue empty (the wait after a reconnect once ended a drain early:
    700 confirmed messages reported lost that were all there). Its heart-beat is 2 s.
    """
    url = url_for(pair, protocol, heartbeat="2s", initial_connect_attempts=4)
    acknowledged: list[int] = []
    in_doubt: list[int] = []
    with hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.CLIENT)
        consumer = session.create_consumer(queue, prefetch=500)
        connection.start()
        pending: list[int] = []
        failovers = 0
        while True:
            message = consumer.receive(idle if acknowledged or pending else 5.0)
            if message is not None:
                pending.append(int(str(message.properties["seq"])))
                if len(pending) < 100:
                    continue
            if pending:
                try:
                    session.acknowledge()
                    acknowledged += pending
                except StaleAcknowledgeError:
                    pass  # they come again
                except (UnblockedError, AcknowledgeFailedError):
                    in_doubt += pending
                pending = []
                continue
            now = connection.statistics().failovers
            if now == failovers:
                break  # empty, with no failover since the last look
            failovers = now
    return acknowledged, in_doubt


def check(
    pair: BrokerPair,
    protocol: str,
    queue: str,
    producer: ConfirmedProducer,
    consumer: AckingConsumer | None = None,
    *,
    others: tuple[Sender, ...] = (),
) -> Outcome:
    """Drain the queue and count lost, unexpected and duplicate messages (threads stopped).
    ``others``: more producers on the same queue, with seqs of their own."""
    drained, drained_in_doubt = drain_acknowledged(pair, protocol, queue)
    acknowledged = consumer.acknowledged if consumer is not None else []
    in_doubt = (consumer.in_doubt if consumer is not None else []) + drained_in_doubt
    handed = consumer.handed if consumer is not None else []
    received = acknowledged + drained
    counts = collections.Counter(received)
    stalls = [producer.longest_stall] + ([consumer.longest_stall] if consumer else [])
    attempted = set(producer.attempted).union(*(other.attempted for other in others))
    confirmed = list(producer.confirmed)
    for other in others:
        confirmed += other.confirmed
    return Outcome(
        attempted=len(attempted),
        confirmed=len(confirmed),
        received=len(received),
        lost=sorted(set(confirmed) - set(received) - set(in_doubt)),
        unexpected=sorted(set(received + handed) - attempted),
        duplicates={seq: n for seq, n in counts.items() if n > 1},
        longest_stall=max(stalls),
        failovers=producer.failovers
        + (consumer.failovers if consumer else 0)
        + sum(other.failovers for other in others),
    )
