"""Application clients inside namespaces for the network-fault scenarios, and the checker.

Each client runs on a thread inside a client namespace (netns.NetnsThread) and records what
the application saw: every call's duration (the longest stall), every exception a call
raised, every exception-listener event with its time, and the failovers its connection
counted. At the end ``check`` drains the queue through a fresh connection and counts, as
Jepsen's total-queue checker does:

- lost = confirmed and never received (acknowledged, or drained after the consumer stopped);
- unexpected = received and never attempted;
- duplicates = seqs received more than once (acknowledged or drained).

An acknowledge that failed in a failover is *in doubt*: the broker may or may not have taken
it, so its message counts as received for losses and is not a duplicate if it comes again.
A send or commit released without an answer (UNBLOCKED, a call_failover_timeout, an unknown
outcome) is retried with the same Message objects: their duplicate ids make a second copy
harmless on the bundled pair.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import attrs

import hafailover
from hafailover import (
    AckMode,
    CallTimeoutError,
    HaFailoverError,
    Message,
    StaleAcknowledgeError,
)

from .netns import NetnsThread, entered

# Fast detection and retries: a silent broker is dead after two heart-beats.
HEARTBEAT = 0.25
FAST = {
    "heartbeat": f"{int(HEARTBEAT * 1000)}ms",
    "retry_interval": "50ms",
    "max_retry_interval": "250ms",
    "reconnect_attempts": "-1",
}
DRAIN_LIMIT = 900.0  # seconds
# How long a call blocked by a failover may wait before it is released.
CALL_FAILOVER_TIMEOUT = 2.0


def with_options(url: str, **options: object) -> str:
    merged = {**FAST, **{k: str(v) for k, v in options.items()}}
    query = "&".join(f"{k}={v}" for k, v in merged.items())
    return f"{url}{'&' if '?' in url else '?'}{query}"


@attrs.define
class Event:
    at: float  # time.monotonic()
    code: str
    text: str


class Client:
    """What one application thread saw."""

    def __init__(self, name: str, netns: str, url: str) -> None:
        self.name = name
        self.netns = netns
        self.url = url
        self.stop = threading.Event()
        self.events: list[Event] = []  # exception-listener calls
        self.lifecycle: list[Event] = []  # event-listener calls: FailureDetected, ...
        self.raised: list[Event] = []  # exceptions calls raised (and the client handled)
        self.longest_call = 0.0
        self.longest_call_at = 0.0
        self.failovers = 0
        self.lock = threading.Lock()
        self.thread = NetnsThread(netns, self._run, name=name)
        self.connection: hafailover.Connection | None = None

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float = 60.0) -> None:
        self.stop.set()
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"{self.name} did not stop within {timeout}s")
        if self.thread.error is not None:
            raise AssertionError(f"{self.name} failed: {self.thread.error!r}") from (
                self.thread.error
            )

    def _listener(self, error: HaFailoverError) -> None:
        with self.lock:
            self.events.append(Event(time.monotonic(), error.code.name, str(error)))

    def _lifecycle(self, event: object) -> None:
        with self.lock:
            self.lifecycle.append(Event(time.monotonic(), type(event).__name__, repr(event)))

    def detected(self, since: float) -> list[float]:
        """When the connection noticed a loss (FailureDetected), in seconds after ``since``."""
        with self.lock:
            return [
                e.at - since
                for e in self.lifecycle
                if e.code == "FailureDetected" and e.at >= since
            ]

    @contextmanager
    def timed(self, allowance: float = 0.0) -> Iterator[None]:
        """Time one application call; ``allowance``: the time it may wait by design."""
        started = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - started - allowance
            if took > self.longest_call:
                self.longest_call, self.longest_call_at = took, started

    def _handled(self, exc: HaFailoverError) -> None:
        with self.lock:
            self.raised.append(Event(time.monotonic(), exc.code.name, str(exc)))

    def _run(self) -> None:
        with hafailover.connect(self.url, exception_listener=self._listener) as connection:
            self.connection = connection
            connection.add_event_listener(self._lifecycle)
            try:
                self.work(connection)
            finally:
                self.failovers = connection.statistics().failovers

    def work(self, connection: hafailover.Connection) -> None:
        raise NotImplementedError

    def codes(self, since: float = 0.0) -> list[str]:
        with self.lock:
            return [e.code for e in self.events if e.at >= since]


class ConfirmedProducer(Client):
    """Persistent sends, each waiting for its confirmation; a send released without one is
    sent again (the same Message: the same duplicate id) until it is confirmed."""

    def __init__(self, name: str, netns: str, url: str, queue: str, first: int = 0) -> None:
        super().__init__(name, netns, url)
        self.queue = queue
        self.next_seq = first
        self.attempted: set[int] = set()
        self.confirmed: list[tuple[float, int]] = []  # (when, seq)
        # (when, the broker connected to right after the confirmation): who confirmed it
        self.confirmed_by: list[tuple[float, str]] = []

    def work(self, connection: hafailover.Connection) -> None:
        producer = connection.create_session(AckMode.AUTO).create_producer(self.queue)
        while not self.stop.is_set():
            seq = self.next_seq
            self.next_seq += 1
            message = Message(body=f"m{seq}", properties={"seq": seq})
            while True:
                self.attempted.add(seq)
                try:
                    with self.timed():
                        producer.send(message)
                except (CallTimeoutError, hafailover.UnblockedError) as exc:
                    self._handled(exc)
                    continue
                break
            at = time.monotonic()
            with self.lock:
                self.confirmed.append((at, seq))
                self.confirmed_by.append((at, connection.broker or ""))
            time.sleep(0.005)

    def confirmed_seqs(self) -> list[int]:
        with self.lock:
            return [seq for _, seq in self.confirmed]

    def confirmations_from(self, address: str) -> list[float]:
        """When sends were confirmed while connected to the node at ``address``."""
        with self.lock:
            return [at for at, broker in self.confirmed_by if f"@{address}:" in broker]

    def confirmed_between(self, start: float, end: float) -> list[int]:
        with self.lock:
            return [seq for at, seq in self.confirmed if start <= at < end]


class TransactedProducer(ConfirmedProducer):
    """Batches of ``batch`` sends per transaction, retried with the same Messages."""

    def __init__(
        self, name: str, netns: str, url: str, queue: str, first: int = 0, batch: int = 5
    ) -> None:
        super().__init__(name, netns, url, queue, first)
        self.batch = batch

    def work(self, connection: hafailover.Connection) -> None:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer(self.queue)
        while not self.stop.is_set():
            seqs = range(self.next_seq, self.next_seq + self.batch)
            self.next_seq += self.batch
            messages = [Message(body=f"m{s}", properties={"seq": s}) for s in seqs]
            while True:
                self.attempted.update(seqs)
                try:
                    with self.timed():
                        for message in messages:
                            producer.send(message)
                        session.commit()
                except (
                    CallTimeoutError,
                    hafailover.UnblockedError,
                    hafailover.TransactionRolledBackError,
                    hafailover.TransactionOutcomeUnknownError,
                ) as exc:
                    self._handled(exc)
                    # A rolled-back (or unknown) transaction: start it again, whole.
                    with self.timed():
                        _quietly(session.rollback)
                    continue
                break
            now = time.monotonic()
            with self.lock:
                self.confirmed.extend((now, s) for s in seqs)
            time.sleep(0.005)


def _quietly(call: Callable[[], Any]) -> None:
    with suppress(HaFailoverError):
        call()


class AckConsumer(Client):
    """CLIENT acknowledge, one message at a time, dropping a seq it acknowledged before
    (the application's own duplicate suppression)."""

    RECEIVE_TIMEOUT = 0.2

    def __init__(self, name: str, netns: str, url: str, queue: str) -> None:
        super().__init__(name, netns, url)
        self.queue = queue
        self.handed: list[int] = []
        self.acknowledged: list[int] = []
        self.in_doubt: list[int] = []
        self.suppressed = 0
        # (when, seq, broker, redelivered) of every acknowledge that returned
        self.log: list[tuple[float, int, str, bool]] = []

    def work(self, connection: hafailover.Connection) -> None:
        session = connection.create_session(AckMode.CLIENT)
        consumer = session.create_consumer(self.queue)
        connection.start()
        done: set[int] = set()
        while not self.stop.is_set():
            try:
                with self.timed(self.RECEIVE_TIMEOUT):
                    message = consumer.receive(self.RECEIVE_TIMEOUT)
            except HaFailoverError as exc:
                self._handled(exc)
                continue
            if message is None:
                continue
            seq = int(str(message.properties["seq"]))
            with self.lock:
                self.handed.append(seq)
            if seq in done:
                self.suppressed += 1
            try:
                with self.timed():
                    message.acknowledge()
            except StaleAcknowledgeError as exc:
                self._handled(exc)  # it comes again
                continue
            except HaFailoverError as exc:
                self._handled(exc)
                with self.lock:
                    self.in_doubt.append(seq)
                continue
            done.add(seq)  # a second one is counted: a duplicate the broker handed out
            with self.lock:
                self.acknowledged.append(seq)
                self.log.append(
                    (time.monotonic(), seq, connection.broker or "", message.redelivered)
                )


@attrs.frozen
class Verdict:
    confirmed: int
    received: int
    drained: int
    lost: list[int]
    unexpected: list[int]
    duplicates: dict[int, int]

    def line(self) -> str:
        return (
            f"confirmed={self.confirmed} received={self.received} drained={self.drained} "
            f"lost={len(self.lost)} unexpected={len(self.unexpected)} "
            f"duplicates={len(self.duplicates)}"
        )

    def assert_clean(self) -> None:
        assert self.lost == [], f"lost: {self.lost[:50]}"
        assert self.unexpected == [], f"unexpected: {self.unexpected[:50]}"
        assert self.duplicates == {}, f"duplicates (seq: times): {self.duplicates}"


def drain(netns: str, url: str, queue: str, *, idle: float = 1.0) -> list[int]:
    """Every seq still on ``queue``, consumed through a fresh connection in ``netns``."""
    received: list[int] = []
    # After a takeover the first broker of the URL may be the fenced one (F12: a first
    # connection tries further brokers only as initial_connect_attempts allows).
    url = with_options(url, initial_connect_attempts=4)
    with entered(netns), hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.DUPS_OK)
        consumer = session.create_consumer(queue, prefetch=500)
        connection.start()
        # A long chaos run leaves tens of thousands: drain until idle, however long that is,
        # but never stop early in silence (that would count the rest as lost).
        deadline = time.monotonic() + DRAIN_LIMIT
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"{queue} not drained after {DRAIN_LIMIT}s")
            message = consumer.receive(idle if received else max(idle, 1.5))
            if message is None:
                break
            received.append(int(str(message.properties["seq"])))
    return received


def check(
    producers: list[ConfirmedProducer],
    consumers: list[AckConsumer],
    drained: list[int],
) -> Verdict:
    confirmed = {seq for p in producers for seq in p.confirmed_seqs()}
    attempted = {seq for p in producers for seq in p.attempted}
    acknowledged = [seq for c in consumers for seq in c.acknowledged]
    in_doubt = {seq for c in consumers for seq in c.in_doubt}
    handed = {seq for c in consumers for seq in c.handed}
    received = acknowledged + drained
    duplicates = {s: n for s, n in collections.Counter(received).items() if n > 1}
    return Verdict(
        confirmed=len(confirmed),
        received=len(set(received)),
        drained=len(drained),
        lost=sorted(confirmed - set(received) - in_doubt),
        unexpected=sorted((set(received) | handed) - attempted),
        duplicates=duplicates,
    )
