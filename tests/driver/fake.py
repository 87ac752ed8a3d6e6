"""A scripted in-memory broker and the links that reach it, for testing the driver.

``FakeBroker`` is one server that keeps what a real one keeps: queues, a duplicate-id
cache, sessions that outlive a connection (for reattach), transactions and deliveries.
``FakeLink`` implements the driver's ``Link`` protocol over it, numbering frames in the
confirmation window as a windowed STOMP link does. Nothing happens by itself: frames a link
writes wait "on the wire" until the test lets the broker read them (``deliver``), answers
wait until the test sends them (``answer``), and a lost connection is noticed the way the
test says: by the reader, by the next write on an application's thread, by a heartbeat, or
by several at once. The broker records every violation it sees (an acknowledge of a
delivery this connection never got, a message stored twice) in ``violations``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from hafailover.core.subscriptions import NamedSubscription
from hafailover.core.window import ConfirmationWindow, command_flags
from hafailover.destination import Destination
from hafailover.errors import IllegalStateError, NotConnectedError
from hafailover.message import Message, stamps_duplicate_id
from hafailover.protocols.base import LinkEvents, Opened
from hafailover.url import BrokerAddress, FailoverPolicy

_SERIALS = itertools.count(1000)

# A pair of fake brokers, with failure detection and retries fast enough for tests.
FAST_URL = (
    "failover:(stomp://app:pw@live:61613,stomp://app:pw@backup:61613)"
    "?heartbeat=250ms&retry_interval=5ms&max_retry_interval=20ms&call_timeout=5s"
)


@attrs.define
class Frame:
    command: str
    token: int | None = None
    message: Message | None = None
    destination: str = ""
    tx: object = None
    tag: str = ""
    subscription: str = ""
    command_id: int = -1
    stamped: bool = False  # a SEND that carries its duplicate id (F13)


@attrs.define
class ServerSession:
    """What the broker keeps of a client's session between connections."""

    session_id: str
    last_received: int = -1
    transactions: dict[object, list[Frame]] = attrs.field(factory=dict)
    unacked: dict[str, tuple[str, Message]] = attrs.field(factory=dict)  # tag -> queue, msg
    delivered: set[str] = attrs.field(factory=set)  # every tag this session was given
    subscriptions: dict[str, str] = attrs.field(factory=dict)  # id -> queue


class FakeBroker:
    """One scripted server. Thread-safe: the driver's threads and the test call it."""

    def __init__(self, *, windowed: bool = True, duplicate_detection: bool = True) -> None:
        self.lock = threading.RLock()
        self.windowed = windowed
        self.duplicate_detection = duplicate_detection
        self.queues: dict[str, collections.deque[Message]] = collections.defaultdict(
            collections.deque
        )
        self.stored_ids: collections.Counter[str] = collections.Counter()
        self.arrived_ids: collections.Counter[str] = collections.Counter()
        self.sessions: dict[str, ServerSession] = {}
        self.links: list[FakeLink] = []
        # How the next connection attempts are answered: "reattach" (if the session is
        # held), "fresh" (a new session: the old one is dropped), "refuse", "illegal" (the
        # attempt meets a local error, as amqp_io's reader-thread guard raises one), and
        # "reattach, then reported lost" / "fresh, then reported lost": opens, then dies
        # and its reader reports it before open() returns, i.e. before the driver has
        # made it the connection's. ``refuse_until`` (a time.monotonic() value): every
        # attempt before it is refused, as a backup that has not taken over yet refuses,
        # whatever ``answers`` holds.
        self.answers: collections.deque[str] = collections.deque()
        self.refuse_until = 0.0
        self.refused = 0  # attempts refused so far
        self.topology: tuple[tuple[str, int], ...] = ()  # the failover list each open announces
        self.violations: list[str] = []
        self.dead_letters: list[Message] = []  # what consumers rejected (poison messages)
        self._session_ids = itertools.count(1)
        self._tags = itertools.count(1)
        self.opened = threading.Condition(self.lock)
        # The broker's own pace: a thread that reads what the current link wrote and
        # answers, as a live server does, unless the test holds it (``paused``).
        self._running = False
        self._hold = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- running by itself --------------------------------------------------------------

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="fake-broker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(5)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is read or answered by itself inside: the test steps the broker."""
        with self._hold:
            yield

    def _serve(self) -> None:
        while self._running:
            with self._hold:
                with self.lock:
                    link = self.links[-1] if self.links else None
                if link is not None and not link.dead:
                    link.deliver()
                    link.answer()
                    self.push(link)
            time.sleep(0.001)

    # --- what a link asks -------------------------------------------------------------

    def open(self, link: FakeLink, resume: str | None) -> Opened:
        with self.lock:
            if time.monotonic() < self.refuse_until:
                self.refused += 1
                raise NotConnectedError("[Errno 111] Connection refused (not active yet)")
            answer = self.answers.popleft() if self.answers else "reattach"
            if answer == "fresh, then lost":
                # Opens, then dies before the driver has restored its sessions on it.
                answer = "fresh"
                link.dies_after_open = True
            elif answer.endswith(", then reported lost"):
                answer = answer.split(",")[0]
                link.reported_lost_after_open = True
            if answer == "refuse":
                self.refused += 1
                raise NotConnectedError("the fake broker refused the connection")
            if answer == "illegal":
                raise IllegalStateError(
                    "a call that waits for the broker, made on the thread that reads its "
                    "answers, would never end"
                )
            held = self.sessions.get(resume) if resume is not None else None
            if answer == "fresh" and held is not None:
                self._drop_session(held)
                held = None
            if held is not None and self.windowed:
                link.session = held
                resumed, last = True, held.last_received
                # As the bundled broker does: what the session had not had acknowledged
                # goes out again at once, under the same tags.
                for tag, (queue, message) in held.unacked.items():
                    for subscription, subscribed in held.subscriptions.items():
                        if subscribed == queue:
                            again = self._delivered(message, redelivered=True)
                            link.deliveries.append((subscription, tag, again))
                            break
            else:
                link.session = ServerSession(f"s{next(self._session_ids)}")
                self.sessions[link.session.session_id] = link.session
                resumed, last = False, -1
            self.links.append(link)
            self.opened.notify_all()
            return Opened(
                broker=link.broker,
                session_id=link.session.session_id if self.windowed else None,
                resumed=resumed,
                last_received=last,
                topology=self.topology,
                detects_duplicates=self.duplicate_detection,
            )

    def _drop_session(self, session: ServerSession) -> None:
        """A session gone for good: its transactions roll back, its deliveries go back."""
        for tag, (queue, message) in list(session.unacked.items()):
            self.queues[queue].appendleft(message)
            del session.unacked[tag]
        session.transactions.clear()
        self.sessions.pop(session.session_id, None)

    def read(self, link: FakeLink, frame: Frame) -> None:
        """The broker processes one frame of ``link`` (in order)."""
        with self.lock:
            session = link.session
            assert session is not None
            if frame.command_id >= 0:
                session.last_received = frame.command_id
            command = frame.command
            if command == "SEND":
                if frame.tx is not None:
                    session.transactions.setdefault(frame.tx, []).append(frame)
                else:
                    self._store(frame)
            elif command == "BEGIN":
                session.transactions.setdefault(frame.tx, [])
            elif command in ("COMMIT", "ABORT"):
                work = session.transactions.pop(frame.tx, [])
                if command == "COMMIT":
                    for item in work:
                        if item.command == "SEND":
                            self._store(item)
                        else:
                            self._ack(link, item)
            elif command == "ACK":
                if frame.tx is not None:
                    session.transactions.setdefault(frame.tx, []).append(frame)
                else:
                    self._ack(link, frame)
            elif command == "NACK":
                entry = session.unacked.pop(frame.tag, None)
                if entry is not None:
                    self.queues[entry[0]].appendleft(entry[1])
            elif command == "REJECT":
                entry = session.unacked.pop(frame.tag, None)
                if entry is not None:
                    self.dead_letters.append(entry[1])
            elif command == "SUBSCRIBE":
                session.subscriptions[frame.subscription] = frame.destination
            elif command == "UNSUBSCRIBE":
                session.subscriptions.pop(frame.subscription, None)
            if frame.token is not None:
                link.answers.append(frame.token)

    def _store(self, frame: Frame) -> None:
        message = frame.message
        assert message is not None
        message_id = message.message_id or ""
        self.arrived_ids[message_id] += 1  # every copy that reached the broker
        if self.duplicate_detection and frame.stamped and self.stored_ids[message_id]:
            return  # a copy it already has (F13); only a duplicate id tells it so
        self.stored_ids[message_id] += 1
        self.queues[frame.destination].append(message)

    def _ack(self, link: FakeLink, frame: Frame) -> None:
        session = link.session
        assert session is not None
        if frame.tag not in session.delivered:
            self.violations.append(
                f"session {session.session_id} acknowledged {frame.tag}, a delivery of "
                "another connection"
            )
            return
        session.unacked.pop(frame.tag, None)

    def push(self, link: FakeLink, limit: int = 1000) -> int:
        """Deliver waiting messages to the link's subscriptions; how many."""
        with self.lock:
            session = link.session
            if session is None or link.dead:
                return 0
            pushed = 0
            for subscription, queue in list(session.subscriptions.items()):
                waiting = self.queues[queue]
                while waiting and pushed < limit:
                    message = waiting.popleft()
                    tag = f"{link.serial}-{next(self._tags)}"
                    session.unacked[tag] = (queue, message)
                    session.delivered.add(tag)
                    delivered = self._delivered(message)
                    link.deliveries.append((subscription, tag, delivered))
                    pushed += 1
        link.flush_deliveries()
        return pushed

    @staticmethod
    def _delivered(message: Message, *, redelivered: bool = False) -> Message:
        return attrs.evolve(
            message,
            delivery=None,
            acknowledger=None,
            redelivered=redelivered,
            sender_id=message.message_id is not None,
        )

    def current(self) -> FakeLink:
        with self.lock:
            return self.links[-1]

    def stored(self, queue: str) -> list[Message]:
        with self.lock:
            return list(self.queues[queue])


class FakeLink:
    """The driver's ``Link`` over a ``FakeBroker``; frames wait on the wire until the test
    lets the broker read them."""

    calls_block = False
    settles_transacted_work = False

    def __init__(
        self,
        broker: FakeBroker,
        events: LinkEvents,
        policy: FailoverPolicy,
        window: ConfirmationWindow[Any],
    ) -> None:
        self.serial = next(_SERIALS)
        self.fake = broker
        self.events = events
        self.policy = policy
        self.window = window
        self.broker: BrokerAddress = policy.brokers[0]
        self.windowed = False
        self.session: ServerSession | None = None
        self.dead = False
        self.dies_after_open = False
        self.reported_lost_after_open = False
        self.wire: collections.deque[Frame] = collections.deque()
        self.answers: collections.deque[int] = collections.deque()
        self.deliveries: collections.deque[tuple[str, str, Message]] = collections.deque()
        self._tx_names = itertools.count(1)
        self.lock = threading.Lock()

    # --- the Link protocol ------------------------------------------------------------

    def open(self, broker: BrokerAddress, *, resume: str | None) -> Opened:
        self.broker = broker
        opened = self.fake.open(self, resume)
        self.windowed = opened.session_id is not None and self.window.enabled
        if self.dies_after_open:
            self.dead = True
        if self.reported_lost_after_open:
            # Its reader sees the socket close before open() has returned to the driver.
            for thread in self.lose(noticed_by=("reader",)):
                thread.join(5)
        return opened

    def _write(self, frame: Frame, *, replayable: bool = True, resendable: bool = False) -> int:
        if self.dead:
            raise NotConnectedError(f"{self.broker.redacted()}: [Errno 9] Bad file descriptor")
        if self.windowed:
            frame.command_id = self.window.record(
                frame, 100, replayable=replayable, resendable=resendable, force=True
            )
        self.wire.append(frame)
        return frame.command_id

    def send(
        self, destination: Destination, message: Message, *, tx: object, token: int | None
    ) -> int:
        message.ensure_message_id()  # as the adapters do when they encode a send
        stamped = stamps_duplicate_id(
            persistent=message.persistent, duplicate_detection=self.policy.duplicate_detection
        )
        frame = Frame("SEND", token, message, destination.name, tx, stamped=stamped)
        replayable, resendable = command_flags(transacted=tx is not None, stamped=stamped)
        return self._write(frame, replayable=replayable, resendable=resendable)

    def subscribe(
        self,
        subscription: str,
        destination: Destination,
        *,
        acknowledged: bool,
        prefetch: int,
        selector: str | None = None,
        token: int | None = None,
        named: NamedSubscription | None = None,
    ) -> None:
        frame = Frame("SUBSCRIBE", token, destination=destination.name, subscription=subscription)
        self._write(frame)

    def remove_subscription(self, name: str, *, token: int) -> None:
        self._write(Frame("UNSUBSCRIBE", token, subscription=name))

    def unsubscribe(self, subscription: str) -> None:
        self._write(Frame("UNSUBSCRIBE", subscription=subscription))

    def browse(self, subscription: str, queue: Destination) -> None:
        self._write(Frame("SUBSCRIBE", destination=queue.name, subscription=subscription))

    def acknowledge(self, subscription: str, tag: str, *, tx: object, token: int | None) -> None:
        replayable, _ = command_flags(transacted=tx is not None, stamped=False)
        self._write(Frame("ACK", token, tx=tx, tag=tag), replayable=replayable)

    def redeliver(self, subscription: str, tag: str) -> None:
        self._write(Frame("NACK", tag=tag))

    def reject(self, subscription: str, tag: str) -> None:
        self._write(Frame("REJECT", tag=tag))

    def begin(self) -> object:
        name = f"tx-{self.serial}-{next(self._tx_names)}"
        self._write(Frame("BEGIN", tx=name), replayable=False)
        return name

    def end(self, tx: object, *, commit: bool, token: int) -> None:
        self._write(Frame("COMMIT" if commit else "ABORT", token, tx=tx), replayable=False)

    def temporary_queue(self, wanted: Destination | None) -> Destination:
        assert wanted is not None, "the fake makes no temporary queues of its own"
        return wanted

    def replay(self, payload: object) -> None:
        if self.dead:
            raise NotConnectedError("replay on a dead link")
        assert isinstance(payload, Frame)
        self.wire.append(payload)

    def sync(self, token: int) -> None:
        name = f"sync-{self.serial}-{next(self._tx_names)}"
        self._write(Frame("BEGIN", tx=name))
        self._write(Frame("ABORT", token, tx=name))

    def resend(self, payload: object) -> int:
        assert isinstance(payload, Frame)
        return self._write(attrs.evolve(payload, command_id=-1), resendable=True)

    def close(self) -> None:
        self.dead = True

    def abort(self) -> None:
        self.dead = True

    # --- what the test does -------------------------------------------------------------

    def deliver(self, count: int | None = None) -> None:
        """The broker reads up to ``count`` frames from the wire (all by default)."""
        while self.wire and (count is None or count > 0):
            self.fake.read(self, self.wire.popleft())
            if count is not None:
                count -= 1

    def answer(self) -> None:
        """The broker's answers (receipts in frame order, window confirmations) arrive."""
        if self.dead:
            return
        while self.answers:
            self.events.link_completed(self, self.answers.popleft(), None)
        session = self.session
        if self.windowed and session is not None and session.last_received >= 0:
            self.events.link_confirmed(self, session.last_received)

    def flush_deliveries(self) -> None:
        while self.deliveries and not self.dead:
            subscription, tag, message = self.deliveries.popleft()
            self.events.link_message(self, subscription, tag, message)

    def lose(self, *, noticed_by: tuple[str, ...]) -> list[threading.Thread]:
        """The connection dies: what is still on the wire never arrives. ``noticed_by``
        any of "reader", "heartbeat" (told from another thread, as a transport's reader
        or heartbeat would) and "writer" (the next write raises)."""
        self.dead = True
        self.wire.clear()
        self.answers.clear()
        threads = []
        for source in noticed_by:
            if source == "writer":
                continue  # nothing to tell: the next write fails with EBADF
            reason = "connection closed" if source == "reader" else "heart-beat timeout"
            thread = threading.Thread(target=self.events.link_lost, args=(self, reason))
            thread.start()
            threads.append(thread)
        return threads


def link_factory(broker: FakeBroker) -> Callable[..., FakeLink]:
    def make(events: LinkEvents, policy: FailoverPolicy, window: ConfirmationWindow[Any]) -> Any:
        return FakeLink(broker, events, policy, window)

    return make
