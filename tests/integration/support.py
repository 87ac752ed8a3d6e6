"""Shared helpers of the integration tests: URLs for the bundled pair, draining a queue, and
a TCP proxy whose connections a test can cut (a dropped connection while the broker lives)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator

import hafailover
from hafailover import (
    AckMode,
    AcknowledgeFailedError,
    Message,
    StaleAcknowledgeError,
    UnblockedError,
)
from reference_broker import BrokerPair

# How many messages the acking consumer takes before one acknowledge.
ACK_BATCH = 10

# Fast detection and retries so that each failover takes about a second.
FAST = {"heartbeat": "250ms", "retry_interval": "50ms", "max_retry_interval": "500ms"}
# For tests that read "no failover" as "nothing was refused": a heart-beat a loaded machine
# cannot outlast by accident. With FAST's 250 ms a reader held up for half a second fails
# over, as that setting asks; loss detection itself is tested elsewhere (tests/adapters,
# test_failover_rules.py).
STEADY_HEARTBEAT = "1s"


def url_for(pair: BrokerPair, protocol: str, **options: object) -> str:
    base = pair.stomp_url if protocol == "stomp" else pair.amqp_url
    merged = {**FAST, **{k: str(v) for k, v in options.items()}}
    query = "&".join(f"{k}={v}" for k, v in merged.items())
    return f"{base}{'&' if '?' in base else '?'}{query}"


def single_url(protocol: str, host: str, port: int, pair: BrokerPair, **options: object) -> str:
    merged = {**FAST, **{k: str(v) for k, v in options.items()}}
    query = "&".join(f"{k}={v}" for k, v in merged.items())
    return f"{protocol}://{pair.user}:{pair.password}@{host}:{port}?{query}"


# How long a drain that still misses expected messages waits for the next one.
EXPECTING_IDLE = 15.0


class QuietSpell:
    """When a drain may call its queue empty: after ``idle`` seconds without a message (5 s
    for the first one: it may take a while on a loaded machine), or, while any of the
    ``expect``ed ``seq`` properties is still missing, after ``EXPECTING_IDLE``. On a loaded
    machine a second without a message is not an empty queue (messages a closed consumer
    held come back only once the broker has seen it go), and a message a drain gave up on
    too soon would be reported lost. Shared by every loss checker's final drain."""

    def __init__(self, idle: float, expect: Collection[int] = ()) -> None:
        self.idle = idle
        self.missing = {int(seq) for seq in expect}
        self._received = False

    def wait(self) -> float:
        """How long to wait for the next message before calling the queue empty."""
        wait = self.idle if self._received else max(self.idle, 5.0)
        return max(wait, EXPECTING_IDLE) if self.missing else wait

    def received(self, message: Message) -> None:
        self._received = True
        if self.missing:
            self.missing.discard(int(str(message.properties.get("seq", -1))))


def drain(
    url: str,
    queue: str,
    *,
    idle: float = 1.0,
    limit: float = 60.0,
    expect: Collection[int] = (),
) -> list[Message]:
    """Everything waiting on ``queue`` (consumed), through a fresh connection; it ends after
    a quiet spell (``QuietSpell``: longer while an ``expect``ed seq is missing)."""
    spell = QuietSpell(idle, expect)
    received: list[Message] = []
    # After a failover the first broker of the URL may be the dead one (F12: the first
    # connection only tries further brokers when initial_connect_attempts allows it).
    url = f"{url}{'&' if '?' in url else '?'}initial_connect_attempts=4"
    with hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.DUPS_OK)
        consumer = session.create_consumer(queue, prefetch=500)
        connection.start()
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            message = consumer.receive(spell.wait())
            if message is None:
                break
            received.append(message)
            spell.received(message)
    return received


# The acknowledged drain's first connection: with the tests' retry intervals (50 ms growing
# to 250 or 500 ms) about ten seconds of attempts (after a takeover the first broker of the
# URL may be the fenced one, and a failback hand-over still under way leaves neither node
# listening for a moment).
DRAIN_CONNECT_ATTEMPTS = 40
# How many messages the acknowledged drain takes before one acknowledge.
DRAIN_ACK_BATCH = 100


def drain_acknowledged(
    url: str,
    queue: str,
    *,
    idle: float = 1.0,
    limit: float = 900.0,
    expect: Collection[int] = (),
    on_message: Callable[[Message], None] | None = None,
) -> tuple[list[int], list[int]]:
    """A loss checker's drain: everything on ``queue``, through a fresh connection, as
    (seqs whose acknowledge the broker confirmed, seqs whose acknowledge is in doubt).

    It counts only what it acknowledged, as the checked consumers do. A drain connection
    that fails over gets again every message whose acknowledge was not confirmed (F8: that
    acknowledge raises StaleAcknowledgeError, and the batch is not counted), so a
    redelivery is never a second copy; a DUPS_OK drain, whose acknowledges are never
    confirmed (F7), counted the messages it had taken before a failover twice. After a
    failover it looks once more before it calls the queue empty; while a seq of ``expect``
    is missing it waits longer (``QuietSpell``). It fails loudly past ``limit`` seconds
    rather than count the rest as lost. Give ``url`` a heart-beat that a loaded machine
    keeps (2 s): the drain takes hundreds of messages at once. ``on_message`` sees each
    message as it is received (a test's hook)."""
    spell = QuietSpell(idle, expect)
    expected = set(spell.missing)
    acknowledged: list[int] = []
    in_doubt: list[int] = []
    deadline = time.monotonic() + limit
    url = f"{url}{'&' if '?' in url else '?'}initial_connect_attempts={DRAIN_CONNECT_ATTEMPTS}"
    with hafailover.connect(url) as connection:
        session = connection.create_session(AckMode.CLIENT)
        consumer = session.create_consumer(queue, prefetch=500)
        connection.start()
        pending: list[int] = []
        failovers = 0
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"{queue} not drained after {limit}s")
            message = consumer.receive(spell.wait())
            if message is not None:
                spell.received(message)
                pending.append(int(str(message.properties["seq"])))
                if on_message is not None:
                    on_message(message)
                if len(pending) < DRAIN_ACK_BATCH:
                    continue
            if pending:
                try:
                    session.acknowledge()
                    acknowledged += pending
                except StaleAcknowledgeError:
                    spell.missing |= expected.intersection(pending)  # they come again
                except (UnblockedError, AcknowledgeFailedError):
                    in_doubt += pending
                pending = []
                continue
            now = connection.statistics().failovers
            if now == failovers:
                break  # empty, with no failover since the last look
            failovers = now
    return acknowledged, in_doubt


def seqs(messages: list[Message]) -> list[int]:
    return [int(str(m.properties["seq"])) for m in messages]


def wait_until(
    predicate: object, timeout: float, what: str, detail: Callable[[], str] | None = None
) -> None:
    """Poll ``predicate`` until it holds; past ``timeout``, fail naming ``what`` and, when
    given, what ``detail`` says of the state then (so a rare failure explains itself)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.02)
    message = f"timed out after {timeout}s waiting for {what}"
    if detail is not None:
        try:
            message += f"; {detail()}"
        except Exception as exc:  # noqa: BLE001 - the timeout is what the test reports
            message += f"; (its detail failed: {exc!r})"
    raise AssertionError(message)


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target; ``cut()`` drops every connection at once;
    ``mute()`` drops what the broker says from then on (it still gets and does everything
    the client writes) and refuses new connections: an answer lost with its network."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._muted = threading.Event()
        self.refusing = False  # set: new connections are closed at once (the broker is away)
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self._muted.is_set() or self.refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
                self.connections += 1
            for a, b, muted in ((client, upstream, None), (upstream, client, self._muted)):
                threading.Thread(target=self._pump, args=(a, b, muted), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, muted: threading.Event | None) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if muted is None or not muted.is_set():
                    sink.sendall(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Drop every open connection (both directions), as a network failure would."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                # Linger 0: close sends a reset, as a dead network path would look.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                s.close()

    def mute(self) -> None:
        self._muted.set()

    def unmute(self) -> None:
        self._muted.clear()

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self.cut()


@contextlib.contextmanager
def proxy(target_port: int) -> Iterator[TcpProxy]:
    p = TcpProxy(target_port)
    try:
        yield p
    finally:
        p.close()


def delay_loss_notices(monkeypatch: object, delay: float) -> None:
    """Make the transports report a lost connection (reader, heart-beat) only ``delay``
    seconds late, so that a write on an application's thread notices the loss first."""
    from hafailover.protocols.amqp import link as amqp_link
    from hafailover.protocols.stomp import link as stomp_link

    for events in (stomp_link._StompEvents, amqp_link._AmqpEvents):
        original = events.on_lost

        def late(self: object, reason: str, original: object = original) -> None:
            threading.Timer(delay, original, args=(self, reason)).start()  # type: ignore[arg-type]

        monkeypatch.setattr(events, "on_lost", late)  # type: ignore[attr-defined]


class AckingConsumer(threading.Thread):
    """CLIENT acknowledge every ACK_BATCH messages. A stale acknowledge (the session failed
    over holding them) means the batch comes again, so it is not counted; an acknowledge
    caught by a failover (F3: released with UNBLOCKED) leaves the batch in doubt: the broker
    may or may not have taken it, so those are neither lost nor duplicates."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(name="acking-consumer", daemon=True)
        self.url = url
        self.queue = queue
        self.stop = threading.Event()
        self.handed: list[int] = []
        self.acknowledged: list[int] = []
        self.in_doubt: list[int] = []
        self.stale = 0
        self.longest_stall = 0.0
        self.failovers = 0
        # Failovers that made a new session (not a reattach): each one counts the deliveries
        # the consumer held as failed attempts on the pair (the dead-letter rule).
        self.reconnects = 0
        self.error: str | None = None

    def run(self) -> None:
        try:
            with hafailover.connect(self.url) as connection:
                session = connection.create_session(AckMode.CLIENT)
                consumer = session.create_consumer(self.queue)
                connection.start()
                pending: list[int] = []
                while not self.stop.is_set():
                    started = time.monotonic()
                    message = consumer.receive(0.2)
                    # receive waits up to 0.2 s by design: only what is beyond it is a stall.
                    self._stalled(started, 0.2)
                    if message is not None:
                        seq = int(str(message.properties["seq"]))
                        self.handed.append(seq)
                        pending.append(seq)
                    if len(pending) >= ACK_BATCH or (message is None and pending):
                        self._acknowledge(session, pending)
                        pending = []
                if pending:
                    self._acknowledge(session, pending)
                statistics = connection.statistics()
                self.failovers = statistics.failovers
                self.reconnects = statistics.failovers - statistics.reattached
        except BaseException:  # noqa: BLE001 - reported by the test
            self.error = traceback.format_exc()

    def _acknowledge(self, session: hafailover.Session, pending: list[int]) -> None:
        started = time.monotonic()
        try:
            session.acknowledge()
        except StaleAcknowledgeError:
            self.stale += 1
            return
        except (UnblockedError, AcknowledgeFailedError):
            self.in_doubt.extend(pending)
            return
        finally:
            self._stalled(started)
        self.acknowledged.extend(pending)

    def _stalled(self, started: float, expected: float = 0.0) -> None:
        self.longest_stall = max(self.longest_stall, time.monotonic() - started - expected)
