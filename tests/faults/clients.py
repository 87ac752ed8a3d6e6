"""The fault scenarios' application clients and the total-queue check of what they left.

One harness for every scenario in this directory. Each client is a thread (inside a client
namespace when given one: netns.entered) that records what the application saw: every
send attempted and confirmed, every message acknowledged, the longest single call (the
stall), every exception a call raised and the client handled, every exception-listener and
event-listener call with its time, and the failovers its connection counted.

- ConfirmedProducer: persistent sends, each waiting for its confirmation; a send that raises
  is sent again as the same Message (its duplicate id makes a second copy harmless on the
  bundled pair) until it is confirmed. TransactedProducer: batches per transaction, a
  rolled-back or unknown one retried whole with the same Messages.
- AckConsumer: CLIENT acknowledge one message at a time, dropping a seq it acknowledged
  before (the application's duplicate suppression). The loss checker's batch-acknowledging
  consumer (tests/integration/support.AckingConsumer) is checked the same way.

``check`` then drains the queue (CLIENT acknowledge, through a fresh connection, waiting
longer while a confirmed message is still missing) and counts,
as Jepsen's total-queue checker and tests/integration/test_loss_checker.py do:

- lost = confirmed and never received (acknowledged, in doubt, or drained);
- unexpected = received (or handed to a consumer) and never attempted;
- duplicates = seqs received (acknowledged or drained) more than once.

An acknowledge that failed in a failover is *in doubt*: the broker may or may not have taken
it, so its messages count as received for losses and are not duplicates if they come again.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

import attrs

import hafailover
from hafailover import (
    AckMode,
    HaFailoverError,
    Message,
    StaleAcknowledgeError,
)
from reference_broker import BrokerPair
from reference_broker.engine import DEFAULT_DEAD_LETTER_QUEUE
from tests.integration.support import drain_acknowledged

from .netns import entered

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


def base_url(pair: BrokerPair, protocol: str) -> str:
    """The pair's failover URL for ``protocol``, without options (``check`` adds its own)."""
    return pair.stomp_url if protocol == "stomp" else pair.amqp_url


def with_options(url: str, **options: object) -> str:
    merged = {**FAST, **{k: str(v) for k, v in options.items()}}
    query = "&".join(f"{k}={v}" for k, v in merged.items())
    return f"{url}{'&' if '?' in url else '?'}{query}"


@contextlib.contextmanager
def _inside(netns: str | None) -> Iterator[None]:
    if netns is None:
        yield
    else:
        with entered(netns):
            yield


@attrs.define
class Event:
    at: float  # time.monotonic()
    code: str
    text: str
    error: HaFailoverError | None = None  # what a call raised, for the calls a client handled


class Client(threading.Thread):
    """What one application thread saw; ``work`` is the application."""

    def __init__(self, url: str, *, name: str, netns: str | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self.url = url
        self.netns = netns
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.events: list[Event] = []  # exception-listener calls
        self.lifecycle: list[Event] = []  # event-listener calls: FailureDetected, ...
        self.raised: list[Event] = []  # exceptions calls raised and the client handled
        self.longest_stall = 0.0
        self.longest_stall_at = 0.0
        self.failovers = 0
        # Failovers that made a new session (not a reattach): each one counts a consumer's
        # held deliveries as failed attempts on the pair (the dead-letter rule).
        self.reconnects = 0
        self.error: str | None = None  # the traceback that ended the thread
        self.connection: hafailover.Connection | None = None

    def run(self) -> None:
        try:
            with (
                _inside(self.netns),
                hafailover.connect(self.url, exception_listener=self._listener) as connection,
            ):
                self.connection = connection
                connection.add_event_listener(self._lifecycle)
                try:
                    self.work(connection)
                finally:
                    statistics = connection.statistics()
                    self.failovers = statistics.failovers
                    self.reconnects = statistics.failovers - statistics.reattached
        except BaseException:  # noqa: BLE001 - reported by stop_all
            self.error = traceback.format_exc()

    def work(self, connection: hafailover.Connection) -> None:
        raise NotImplementedError

    def _listener(self, error: HaFailoverError) -> None:
        with self.lock:
            self.events.append(Event(time.monotonic(), error.code.name, str(error)))

    def _lifecycle(self, event: object) -> None:
        with self.lock:
            self.lifecycle.append(Event(time.monotonic(), type(event).__name__, repr(event)))

    def _handled(self, exc: HaFailoverError) -> None:
        with self.lock:
            self.raised.append(Event(time.monotonic(), exc.code.name, str(exc), exc))

    @contextlib.contextmanager
    def timed(self, allowance: float = 0.0) -> Iterator[None]:
        """Time one application call; ``allowance``: the time it may wait by design."""
        started = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - started - allowance
            if took > self.longest_stall:
                self.longest_stall, self.longest_stall_at = took, started

    def detected(self, since: float) -> list[float]:
        """When the connection noticed a loss (FailureDetected), in seconds after ``since``."""
        with self.lock:
            return [
                e.at - since
                for e in self.lifecycle
                if e.code == "FailureDetected" and e.at >= since
            ]

    def codes(self, since: float = 0.0) -> list[str]:
        """The exception listener's codes since ``since``."""
        with self.lock:
            return [e.code for e in self.events if e.at >= since]


class ConfirmedProducer(Client):
    """Persistent sends, one confirmed at a time; a send that raises is sent again (the same
    Message) after a short pause until it is confirmed, or the client stops (then it stays
    attempted and unconfirmed: in doubt)."""

    RETRY_PAUSE = 0.05

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        name: str = "confirmed-producer",
        netns: str | None = None,
        first: int = 0,
        pace: float = 0.0,
        body: bytes = b"",
    ) -> None:
        super().__init__(url, name=name, netns=netns)
        self.queue = queue
        self.next_seq = first
        self.pace = pace
        self.body = body
        self.attempted: set[int] = set()
        self.confirmed: list[int] = []
        self.confirmed_at: list[float] = []
        self.started_at: list[float] = []  # when the attempt that was confirmed began
        self.confirmed_by: list[str] = []  # the broker connected to right after it

    def work(self, connection: hafailover.Connection) -> None:
        producer = connection.create_session(AckMode.AUTO).create_producer(self.queue)
        while not self.stop.is_set():
            seqs = self._next(1)
            message = Message(body=self.body or f"m{seqs[0]}", properties={"seq": seqs[0]})
            self._until_confirmed(connection, seqs, functools.partial(producer.send, message))
            if self.pace:
                time.sleep(self.pace)

    def _next(self, count: int) -> range:
        seqs = range(self.next_seq, self.next_seq + count)
        self.next_seq += count
        return seqs

    def _until_confirmed(
        self,
        connection: hafailover.Connection,
        seqs: range,
        attempt: Callable[[], None],
        undo: Callable[[], None] | None = None,
    ) -> None:
        while True:
            self.attempted.update(seqs)
            started = time.monotonic()
            try:
                with self.timed():
                    attempt()
            except HaFailoverError as exc:
                self._handled(exc)
                if undo is not None:
                    with self.timed(), contextlib.suppress(HaFailoverError):
                        undo()
                if self.stop.is_set():
                    return  # in doubt: attempted, never counted as confirmed
                time.sleep(self.RETRY_PAUSE)
                continue
            at = time.monotonic()
            with self.lock:
                for seq in seqs:
                    self.confirmed.append(seq)
                    self.confirmed_at.append(at)
                    self.started_at.append(started)
                    self.confirmed_by.append(connection.broker or "")
            return

    def confirmed_between(self, start: float, end: float) -> list[int]:
        with self.lock:
            return [
                s
                for s, at in zip(self.confirmed, self.confirmed_at, strict=True)
                if start <= at < end
            ]

    def confirmations_from(self, address: str) -> list[float]:
        """When sends were confirmed while connected to the node at ``address``."""
        with self.lock:
            return [
                at
                for at, broker in zip(self.confirmed_at, self.confirmed_by, strict=True)
                if f"@{address}:" in broker
            ]

    def confirmed_when(self, seq: int) -> list[float]:
        with self.lock:
            return [at for s, at in zip(self.confirmed, self.confirmed_at, strict=True) if s == seq]


class TransactedProducer(ConfirmedProducer):
    """Batches of ``batch`` sends per transaction; one that raises (rolled back, outcome
    unknown, released) is rolled back and retried whole with the same Messages."""

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        name: str = "transacted-producer",
        netns: str | None = None,
        first: int = 0,
        batch: int = 5,
    ) -> None:
        super().__init__(url, queue, name=name, netns=netns, first=first)
        self.batch = batch

    def work(self, connection: hafailover.Connection) -> None:
        session = connection.create_session(AckMode.SESSION_TRANSACTED)
        producer = session.create_producer(self.queue)
        while not self.stop.is_set():
            seqs = self._next(self.batch)
            messages = [Message(body=f"m{s}", properties={"seq": s}) for s in seqs]

            def commit(messages: list[Message] = messages) -> None:
                for message in messages:
                    producer.send(message)
                session.commit()

            self._until_confirmed(connection, seqs, commit, undo=session.rollback)
            time.sleep(0.005)


class AckConsumer(Client):
    """CLIENT acknowledge, one message at a time, dropping a seq it acknowledged before
    (the application's own duplicate suppression)."""

    RECEIVE_TIMEOUT = 0.2

    def __init__(
        self, url: str, queue: str, *, name: str = "consumer", netns: str | None = None
    ) -> None:
        super().__init__(url, name=name, netns=netns)
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


class Sender(Protocol):
    """What ``check`` reads of a producer."""

    attempted: set[int]
    confirmed: list[int]
    failovers: int
    longest_stall: float


class Receiver(Protocol):
    """What ``check`` reads of a consumer (AckConsumer, or the loss checker's)."""

    handed: list[int]
    acknowledged: list[int]
    in_doubt: list[int]
    failovers: int
    reconnects: int
    longest_stall: float


class Stoppable(Protocol):
    stop: threading.Event
    error: str | None
    name: str

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...

    @property
    def ident(self) -> int | None: ...


def stop_all(*threads: Stoppable, timeout: float = 30.0) -> None:
    """Stop the clients that were started, wait for them, and fail on any client's error."""
    started = [thread for thread in threads if thread.ident is not None]
    for thread in started:
        thread.stop.set()
    for thread in started:
        thread.join(timeout)
    for thread in started:
        assert not thread.is_alive(), f"{thread.name} did not stop within {timeout}s"
        assert thread.error is None, f"{thread.name} failed: {thread.error}"


@attrs.frozen
class Verdict:
    """What the total-queue check found."""

    attempted: int
    confirmed: int
    received: int
    drained: int
    lost: list[int]
    unexpected: list[int]
    duplicates: dict[int, int]
    longest_stall: float
    failovers: int
    # Confirmed, never received, and found on the dead-letter queue: the pair's poison rule
    # moved them there (on AMQP a failover counts the deliveries a consumer held).
    dead_lettered: list[int] = attrs.field(factory=list)

    def line(self, scenario: str, protocol: str) -> str:
        return (
            f"{scenario} [{protocol}]: attempted={self.attempted} confirmed={self.confirmed} "
            f"received={self.received} drained={self.drained} lost={len(self.lost)} "
            f"dead-lettered={len(self.dead_lettered)} "
            f"unexpected={len(self.unexpected)} duplicates={len(self.duplicates)} "
            f"longest stall={self.longest_stall:.2f}s failovers={self.failovers}"
        )

    def assert_clean(self, *, dead_letters_allowed: bool = False) -> None:
        """Nothing lost, unexpected or doubled; nothing dead-lettered either unless
        ``dead_letters_allowed`` (a long schedule whose many failovers make the AMQP
        consumer's held deliveries count, docs/reliability.md)."""
        assert self.lost == [], f"lost: {self.lost[:50]}"
        if not dead_letters_allowed:
            assert self.dead_lettered == [], f"dead-lettered: {self.dead_lettered[:50]}"
        assert self.unexpected == [], f"unexpected: {self.unexpected[:50]}"
        assert self.duplicates == {}, f"duplicates (seq: times): {self.duplicates}"


def drain(
    url: str,
    queue: str,
    *,
    netns: str | None = None,
    idle: float = 2.0,
    expect: Collection[int] = (),
) -> tuple[list[int], list[int]]:
    """Consume everything on ``queue`` through a fresh connection (in ``netns`` if given):
    (seqs acknowledged, seqs whose acknowledge is in doubt), by the integration tests'
    ``drain_acknowledged``, with a heart-beat of 2 s.

    Like the consumers, it counts only what it acknowledged: a drain that fails over gets
    its unacknowledged messages again (a DUPS_OK drain counted them twice: 11 duplicates seen
    once, none of them the broker's), and after a failover it waits longer before it calls
    the queue empty (the wait after a reconnect once ended a drain early: 700 confirmed
    messages reported lost that were all there). A long chaos run leaves tens of thousands:
    it drains until idle however long that is, but fails loudly past DRAIN_LIMIT rather than
    count the rest as lost.
    """
    with _inside(netns):
        return drain_acknowledged(
            with_options(url, heartbeat="2s"), queue, idle=idle, limit=DRAIN_LIMIT, expect=expect
        )


def check(
    url: str,
    queue: str,
    producers: Sequence[Sender],
    consumers: Sequence[Receiver] = (),
    *,
    netns: str | None = None,
) -> Verdict:
    """Drain ``queue`` (the clients stopped) and count lost, unexpected and duplicate
    messages. ``url``: the pair's URL without options; producers number their seqs apart."""
    confirmed = {seq for p in producers for seq in p.confirmed}
    acknowledged = [seq for c in consumers for seq in c.acknowledged]
    consumers_in_doubt = {seq for c in consumers for seq in c.in_doubt}
    expect = confirmed - set(acknowledged) - consumers_in_doubt
    drained, drained_in_doubt = drain(url, queue, netns=netns, expect=expect)
    in_doubt = consumers_in_doubt | set(drained_in_doubt)
    missing = confirmed - set(acknowledged) - set(drained) - in_doubt
    # Not on the queue: the pair's poison rule may have moved them (the node's default
    # dead-letter queue). Read even when nothing is missing: a copy there beside one received
    # is a duplicate, and one never sent is unexpected.
    letters, letters_in_doubt = drain(url, DEFAULT_DEAD_LETTER_QUEUE, netns=netns, idle=1.0)
    dead = missing & (set(letters) | set(letters_in_doubt))
    handed = {seq for c in consumers for seq in c.handed}
    attempted = {seq for p in producers for seq in p.attempted}
    received = acknowledged + drained
    counts = collections.Counter(received + letters)
    clients: list[Any] = [*producers, *consumers]
    return Verdict(
        attempted=len(attempted),
        confirmed=len(confirmed),
        received=len(set(received)),
        drained=len(drained),
        lost=sorted(confirmed - set(received) - in_doubt - dead),
        dead_lettered=sorted(dead),
        unexpected=sorted((set(received) | handed | set(letters)) - attempted),
        duplicates={seq: n for seq, n in counts.items() if n > 1},
        longest_stall=max((c.longest_stall for c in clients), default=0.0),
        failovers=sum(c.failovers for c in clients),
    )
