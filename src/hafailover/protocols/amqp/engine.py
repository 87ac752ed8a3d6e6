"""One AMQP 1.0 connection to one broker, as a proton engine with no I/O of its own.

This adapter owns the translation between hafailover's values and proton's: it builds one
connection with one session to a single broker (SASL PLAIN, TLS for ``amqps``), reads the
topology the broker announces (docs/protocol-topology.md), keeps a sender link per address,
a receiver link per subscription and the transaction coordinator link, turns what proton
reports into events for the driver, and maps proton's exceptions and error conditions to
ours in one place (``errors``). It never retries, reconnects or fails over
(the driver decides what a loss means), never waits for a settlement it was not asked to wait
for, and never hands a proton object to its caller.

Addresses are written ``queue://x`` and ``topic://x`` (DESIGN section 3), except on RabbitMQ
(known by the product its Open names), whose AMQP 1.0 plugin wants ``/queue/x`` and
``/topic/x`` and declares a queue as durable as the terminus that names it, so links to
queues there ask for a durable terminus; a temporary queue keeps the address the broker gave
it. Every link lives on the one session: a broker that ends it (RabbitMQ 3.10 does to refuse
an attach: a transaction, a dynamic node, a queue of another durability) has ended the
connection's use, and that is reported as a loss, while the request it refused gets the
broker's refusal (ProtocolError): a request that waits fails with it, a send is settled
with it.

Sans I/O
--------
``AmqpEngine`` is driven the way the reference broker drives its side
(reference_broker/amqp/server.py): proton's ``Transport`` and ``Collector`` with no reactor,
no thread, no socket and no clock. The caller (hafailover.protocols.amqp.transport) owns the socket,
the reader thread and the lock that serializes every call: it pushes what it reads
(``received``), passes the time (``tick``), writes what ``output`` gives, and calls the
events ``take_events`` returns once it has let go of its lock, so an event callback may make
requests of its own. Requests that need the broker's answer (the Open, an attach, a declare,
a discharge) return a ``Pending`` that the engine completes as the answer arrives; the others'
outcome comes as an event. Messages are encoded by the caller, outside its lock.

The engine ends with the connection: after ``close`` and the broker's Close, after ``abort``,
or after a loss, which is reported once through ``on_lost``. Waiting requests are then
released (UnblockedError, TransactionOutcomeUnknownError for a commit, ConnectionClosedError
after close); sends still unsettled are in doubt and get no ``on_settled``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Any, Final, Generic, Protocol, TypeVar

import attrs
import proton
from proton import (
    Condition,
    Connection,
    Delivery,
    Described,
    Endpoint,
    Event,
    Link,
    Receiver,
    Sender,
    Session,
    SSLDomain,
    Terminus,
    symbol,
    ulong,
)

from hafailover.destination import Destination, DestinationKind
from hafailover.errors import (
    ConfigurationError,
    ConnectionClosedError,
    HaFailoverError,
    IllegalStateError,
    NotConnectedError,
    ProtocolError,
    RemoteError,
    TransactionOutcomeUnknownError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.protocols.amqp.codec import (
    ACCEPTED,
    DECLARE,
    DECLARED,
    DISCHARGE,
    LOCAL_TRANSACTIONS,
    MODIFIED,
    OUTCOME_NAMES,
    REJECTED,
    RELEASED,
    SHARED,
    TRANSACTIONAL_STATE,
    decode_message,
)
from hafailover.protocols.amqp.errors import (
    condition_error,
    condition_text,
    map_errors,
    outcome_error,
    refusal,
    refuses_request,
    translate,
)
from hafailover.protocols.base import (
    Opened,
    TlsOptions,
    detects_duplicates,
    parse_failover_server_list,
    parse_redirect,
    parse_topology,
)
from hafailover.url import BrokerAddress

__all__ = [
    "AmqpEngine",
    "AmqpEvents",
    "AmqpTransaction",
    "Outcome",
    "Pending",
]

log = logging.getLogger(__name__)

TOPOLOGY_PROPERTY: Final = symbol("hafailover-topology")
FAILOVER_SERVER_LIST: Final = symbol("failover-server-list")
REDIRECT: Final = "amqp:connection:redirect"
_PRODUCT: Final = symbol("product")

_TEMP_QUEUE_PREFIX: Final = "temp-queue://"

# Delivery tokens are unique in the process, so a stale one never settles another delivery.
_DELIVERY_TOKENS: Final = itertools.count(1)
_TRANSPORT_SERIALS: Final = itertools.count(1)


class Outcome(enum.Enum):
    """How a received message is settled."""

    ACCEPTED = "accepted"  # done with: the broker forgets it
    RELEASED = "released"  # back to the queue, not counted as a failed attempt
    REJECTED = "rejected"  # undeliverable: dead-lettered or dropped, as the broker does
    MODIFIED = "modified"  # modified with delivery-failed: back to the queue, attempt counted


@attrs.frozen
class AmqpTransaction:
    """A transaction declared on one connection (the broker's txn-id)."""

    txn_id: bytes
    transport: int  # serial of the transport that declared it: ids mean nothing elsewhere


class AmqpEvents(Protocol):
    """What the driver hears from one connection (called by whoever drives the engine)."""

    def on_message(self, subscription: str, delivery: int, message: Message) -> None: ...

    def on_settled(self, token: int, error: RemoteError | None) -> None: ...

    def on_error(self, error: ProtocolError) -> None: ...

    def on_lost(self, reason: str) -> None: ...

    def on_browse_end(self, subscription: str) -> None: ...

    def on_redirect(self, host: str, port: int | None) -> None:
        """The broker closed the connection with ``amqp:connection:redirect`` (before the
        loss or the failed open it ends in)."""
        ...


def _client_domain(tls: TlsOptions, broker: BrokerAddress) -> SSLDomain:
    """proton's TLS settings for one amqps connection."""
    domain = SSLDomain(SSLDomain.MODE_CLIENT)
    if tls.ca_file is not None:
        domain.set_trusted_ca_db(tls.ca_file)
    if tls.verify:
        domain.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME, tls.ca_file)
    else:
        log.warning("TLS to %s: the broker's certificate is not verified", broker.redacted())
        domain.set_peer_authentication(SSLDomain.ANONYMOUS_PEER)
    if tls.cert_file is not None and tls.key_file is not None:
        domain.set_credentials(tls.cert_file, tls.key_file, None)
    return domain


# --- a request waiting for the broker's answer -----------------------------------------------

T = TypeVar("T")


class Pending(Generic[T]):
    """A request that waits for the broker's answer: the Open, an attach, a declare, a
    discharge.

    The engine completes it while it processes what the broker sent, and calls ``notify``
    (which whoever waits sets before the request can be answered). A waiter that gives up sets
    ``abandoned``; the engine then learns from ``succeed`` returning False that nobody will
    take what it made, and undoes it. It succeeds while the engine processes the answer (a
    drain's as an event, after the message its credit brought); it fails as an event
    (``take_events``), so that a waiter wakes after the loss that failed it has been
    reported.
    """

    __slots__ = ("_error", "_result", "abandoned", "interrupted", "notify", "what")

    def __init__(self, what: str, interrupted: type[RemoteError] = UnblockedError) -> None:
        self.what = what
        self.interrupted = interrupted  # raised if the connection dies before the answer
        self.abandoned = False
        self.notify: Callable[[], None] | None = None
        self._result: tuple[T] | None = None
        self._error: HaFailoverError | None = None

    @property
    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def succeed(self, value: T) -> bool:
        if self.abandoned or self.done:
            return False
        self._result = (value,)
        self._notify()
        return True

    def fail(self, error: HaFailoverError) -> None:
        if not self.done:
            self._error = error
            self._notify()

    def result(self) -> T:
        """The answer, or the error that ended the wait (only once ``done``)."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise IllegalStateError(f"{self.what}: no answer yet")
        return self._result[0]

    def _notify(self) -> None:
        if self.notify is not None:
            self.notify()


def _succeed(pending: Pending[None]) -> None:
    """Complete ``pending`` as an event (a drain's waiter, after the message it brought)."""
    pending.succeed(None)


class _State(enum.Enum):
    NEW = "new"
    OPENING = "opening"
    OPEN = "open"
    ENDING = "ending"  # closing, aborting or lost: no new requests
    ENDED = "ended"  # proton has said all it will: the socket can go


class _Subscription:
    __slots__ = (
        "attaching",
        "browse",
        "credit",
        "destination",
        "drain_waiter",
        "durable",
        "link",
        "name",
    )

    def __init__(
        self,
        name: str,
        link: Receiver,
        destination: Destination,
        credit: int,
        *,
        durable: bool,
        attaching: Pending[None],
        browse: bool = False,
    ) -> None:
        self.browse = browse  # a queue browser: distribution-mode copy, drained to the end
        self.name = name
        self.link = link
        self.destination = destination
        self.credit = credit  # kept outstanding; 0: a pull subscription (``pull``)
        self.drain_waiter: Pending[None] | None = None  # a pull's credit being taken back
        self.durable = durable
        self.attaching: Pending[None] | None = attaching


class _TemporaryQueue:
    __slots__ = ("attaching", "destination", "link")

    def __init__(self, link: Receiver, attaching: Pending[Destination]) -> None:
        self.link = link
        self.attaching: Pending[Destination] | None = attaching
        self.destination: Destination | None = None


class _Dialect(enum.Enum):
    """How destinations are written as AMQP addresses for the broker at hand."""

    CANONICAL = "canonical"  # queue://x, topic://x (the reference broker, DESIGN section 3)
    RABBITMQ = "rabbitmq"  # /queue/x, /topic/x (RabbitMQ's AMQP 1.0 plugin)


class AmqpEngine:
    """One AMQP 1.0 connection to one broker as a proton engine: bytes and time in, bytes
    and events out.

    ``start`` builds the connection; ``received`` takes the socket's bytes, ``input_closed``
    its end, ``tick`` the time, and ``output`` gives what to write. Requests are method calls
    that return at once: those that need the broker's answer return a ``Pending``, the
    others' outcome arrives later as an event (``on_settled``). What the broker says is
    queued as events, taken with ``take_events`` and called by the caller once it no longer
    serializes the engine, so a callback may make requests of its own. Calls must be
    serialized by the caller; none blocks.
    """

    def __init__(
        self,
        events: AmqpEvents,
        *,
        heartbeat: float = 1.0,
        tls: TlsOptions | None = None,
        container_id: str | None = None,
    ) -> None:
        """``heartbeat``: the broker is declared dead after twice this many seconds of
        silence; the Open asks it to send something at least every ``heartbeat`` seconds
        (0 turns both off). ``tls``: how amqps checks the broker (the system's CAs and its
        host name by default) and shows itself. ``container_id``: the Open's container id
        (the client id; a fresh one when None)."""
        self.events = events
        self.container_id = container_id
        self.heartbeat = heartbeat
        self.tls = tls or TlsOptions()
        self.broker: BrokerAddress | None = None
        self._broker_redacted = "broker"  # named in every error: rendered once
        self.serial = next(_TRANSPORT_SERIALS)
        self.state = _State.NEW
        self._outbox: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._closing = False  # the application asked to close or abort: no on_lost
        self._temporary: dict[Destination, str] = {}
        self._dialect = _Dialect.CANONICAL
        self._connection: Connection | None = None
        self._transport: proton.Transport | None = None
        self._collector: proton.Collector | None = None
        self._sasl: proton.SASL | None = None
        self._armed = True  # the idle timeout is set (held back until the login is done)
        self._session: Session | None = None
        self._opening: Pending[Opened] | None = None
        self._pending: set[Pending[Any]] = set()  # requests waiting for the broker
        self._senders: dict[str, Sender] = {}
        self._sender_addresses: dict[Link, str] = {}
        self._outgoing: dict[Delivery, int] = {}  # unsettled transfer -> its token
        self._subscriptions: dict[str, _Subscription] = {}
        self._temporary_queues: dict[Link, _TemporaryQueue] = {}
        self._link_subscription: dict[Link, _Subscription] = {}
        self._incoming: dict[int, tuple[Delivery, _Subscription]] = {}
        self._confirming: dict[Delivery, int] = {}  # outcome sent, broker's settle awaited
        self._coordinator: Sender | None = None
        # Receivers this side detached or closed, by name, until the broker has answered:
        # proton writes a new link's attach before an old link's detach, so an attach that
        # reuses the name (a durable subscription resumed or removed) waits for the answer.
        self._detaching: dict[str, Link] = {}
        self._held_attaches: dict[str, list[Link]] = {}
        self._control: dict[Delivery, tuple[bool, Pending[Any]]] = {}  # is-declare, request
        self._names = itertools.count(1)
        self._dead = False  # the connection is given up: what comes now is its ending
        self._lost_reported = False

    @property
    def ended(self) -> bool:
        """Whether proton has said all it will: write the last ``output`` and drop the socket."""
        return self.state is _State.ENDED

    # --- bytes and time -----------------------------------------------------------------------

    def start(self, broker: BrokerAddress) -> Pending[Opened]:
        """Build the connection (SASL, TLS for ``amqps``) and ask to open it; the Pending
        completes with the broker's Open, or fails with why there was none."""
        if self.state is not _State.NEW:
            raise IllegalStateError("an AMQP connection opens once; make a new one")
        self.state = _State.OPENING
        self.broker = broker
        self._broker_redacted = broker.redacted()
        opening: Pending[Opened] = Pending(f"open {broker.redacted()}", NotConnectedError)
        self._opening = opening
        try:
            with map_errors(broker.redacted()):
                self._build(broker)
        except HaFailoverError:
            self._opening = None
            self.state = _State.ENDED
            raise
        return opening

    def _build(self, broker: BrokerAddress) -> None:
        connection = Connection()
        # The client id, when there is one, is the container id (Qpid JMS): brokers that
        # qualify a durable subscription by its container find it again after a reconnect.
        connection.container = self.container_id or f"hafailover-{uuid.uuid4()}"
        connection.hostname = broker.host
        collector = proton.Collector()
        connection.collect(collector)
        transport = proton.Transport()
        sasl = transport.sasl()
        # PLAIN sends the password in clear: only TLS makes that safe, and only without TLS
        # must it be allowed explicitly.
        sasl.allow_insecure_mechs = not broker.tls
        sasl.allowed_mechs("PLAIN" if broker.user is not None else "ANONYMOUS")
        if broker.user is not None:
            connection.user = broker.user
            connection.password = broker.password or ""
        transport.bind(connection)
        if broker.tls:
            ssl = proton.SSL(transport, _client_domain(self.tls, broker))
            ssl.peer_hostname = broker.host
        # proton enforces its idle timeout from the first byte, SASL included, but a broker
        # may take its time to refuse a login (RabbitMQ waits 3 s before a failed SASL
        # outcome, to slow password guessing): with a short heart-beat the refusal would read
        # as a dead broker. So the timeout is set once the login is done and before the Open
        # that announces it is written (``_arm``); until then the caller's connect timeout
        # bounds the handshake.
        self._armed = self.heartbeat <= 0
        connection.open()
        self._connection = connection
        self._collector = collector
        self._transport = transport
        self._sasl = sasl

    def received(self, data: bytes, now: float) -> None:
        """Bytes the socket read."""
        transport = self._transport
        if transport is None or self.ended:
            return
        view = memoryview(data)
        try:
            while view:
                capacity = transport.capacity()
                if capacity <= 0:
                    break  # input is closed: the transport is failing or done
                transport.push(bytes(view[:capacity]))
                view = view[capacity:]
        except proton.ProtonException as exc:
            log.info("amqp %s: %s", self._broker_text(), exc)  # the error event follows
        self._process(now)

    def input_closed(self, reason: str, now: float) -> None:
        """The socket ended (the broker closed it, or reading or writing failed)."""
        transport = self._transport
        if transport is not None and not self.ended:
            if transport.condition is None and reason:
                transport.condition = Condition("proton:io", reason)
            with contextlib.suppress(proton.ProtonException):
                transport.close_tail()
            self._process(now)
        if not self._dead:
            self._die(reason or "connection closed", None)
        self._shutdown()

    def tick(self, now: float) -> float:
        """Let proton keep time: a heart-beat sent when due, a silent broker declared dead.
        Returns when to call again (0: only when something happens)."""
        if self._transport is None or self.ended:
            return 0.0
        return self._process(now)

    def output(self) -> bytes:
        """Everything proton has to write, taken from it."""
        transport = self._transport
        if transport is None:
            return b""
        self._arm()
        chunks: list[bytes] = []
        while True:
            try:
                size = transport.pending()
            except proton.ProtonException:
                break
            if size <= 0:
                break
            chunk = transport.peek(size)
            if chunk:
                chunks.append(chunk)
            transport.pop(size)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @property
    def has_events(self) -> bool:
        """Whether events are queued for ``take_events``."""
        return bool(self._outbox)

    def take_events(self) -> list[tuple[Callable[..., None], tuple[Any, ...]]]:
        """The events queued since the last call, oldest first, as (callback, arguments)."""
        events, self._outbox = self._outbox, []
        return events

    def _process(self, now: float) -> float:
        transport = self._transport
        assert transport is not None
        self._handle_events()
        if self.ended:
            return 0.0
        self._arm()
        try:
            deadline = transport.tick(now)
        except proton.ProtonException as exc:
            self._die(f"proton failed: {exc}", None)
            return 0.0
        self._handle_events()  # what the tick did (an idle timeout)
        return deadline

    def _arm(self) -> None:
        if self._armed or self._sasl is None or self._transport is None:
            return
        if self._sasl.outcome == proton.SASL.OK:
            self._armed = True
            self._transport.idle_timeout = 2 * self.heartbeat

    def _handle_events(self) -> None:
        collector = self._collector
        if collector is None:
            return
        while (event := collector.peek()) is not None:
            handler = _HANDLERS.get(event.type)
            if handler is not None:
                try:
                    handler(self, event)
                except (proton.ProtonException, HaFailoverError) as exc:
                    # proton refusing its own state ends this connection, never the process
                    log.warning("amqp %s: handling %s failed: %r", self._broker_text(), event, exc)
                    error = translate(exc, self._broker_text())
                    self._die(
                        f"proton failed: {exc!r}",
                        None,
                        refused=error if isinstance(error, RemoteError) else None,
                    )
            collector.pop()

    # --- requests -----------------------------------------------------------------------------

    def address(self, destination: Destination) -> str:
        """How ``destination`` is written for this broker."""
        raw = self._temporary.get(destination)
        if raw is not None:
            return raw
        if (
            self._dialect is _Dialect.RABBITMQ
            and destination.kind is not DestinationKind.TEMPORARY_QUEUE
        ):
            return destination.stomp
        return destination.amqp

    def durable_node(self, destination: Destination) -> bool:
        """Whether links to ``destination`` ask for a durable terminus.

        RabbitMQ's AMQP 1.0 plugin declares a ``/queue/x`` with the durability of the terminus
        that names it (the target of a sender, the source of a receiver): at "none" the queue
        is not durable and a restart deletes it with its persistent messages, confirmed or
        not. So queues there are asked for durable, by senders and receivers alike: RabbitMQ
        refuses an attach whose durability differs from the queue's ("inequivalent arg
        'durable'"). Elsewhere a queue's durability is the broker's business and the terminus
        stays as it was."""
        return (
            self._dialect is _Dialect.RABBITMQ
            and destination.kind is DestinationKind.QUEUE
            and destination not in self._temporary
        )

    def check_transaction(self, tx: AmqpTransaction | None) -> None:
        if tx is not None and tx.transport != self.serial:
            raise IllegalStateError("the transaction was declared on another connection")

    def transfer(
        self,
        token: int | None,
        address: str,
        durable: bool,
        payload: bytes,
        tx: AmqpTransaction | None,
    ) -> None:
        """Send an encoded message; its outcome arrives as ``on_settled(token, ...)``.

        No token: a send nobody waits for (unconfirmed, outside a transaction). On RabbitMQ
        it goes pre-settled, as an AMQP 0-9-1 publish without confirms does: sent unsettled,
        the AMQP 1.0 plugin confirms it internally and writes a disposition that nobody
        reads, which costs the broker and this connection's reader a frame per message.
        Either way the client keeps nothing of it (an AMQP link has no confirmation window)
        and a loss leaves it in doubt. Elsewhere it stays unsettled: the reference broker
        tops a producer's credit up as its transfers are confirmed (its flow control) and
        can only end the link to refuse a pre-settled one."""
        self._require_open()
        self.check_transaction(tx)
        settled = token is None and tx is None and self._dialect is _Dialect.RABBITMQ
        with map_errors(self._broker_text()):
            sender = self._sender_for(address, durable)
            delivery = sender.delivery(str(next(self._names)))
            if tx is not None:
                # Before the bytes: the transactional state must travel in the transfer itself.
                _set_state(delivery, TRANSACTIONAL_STATE, [tx.txn_id])
            sender.stream(payload)
            sender.advance()
            if settled:
                delivery.settle()  # written settled, once the link has credit
                return
        self._outgoing[delivery] = 0 if token is None else token  # 0: nobody waits for it

    def _sender_for(self, address: str, durable: bool) -> Sender:
        sender = self._senders.get(address)
        if sender is None:
            sender = self._require_session().sender(f"hafailover-sender-{next(self._names)}")
            sender.target.address = address
            if durable:
                _make_durable(sender.target)
            # Mixed on RabbitMQ: sends nobody waits for go settled there (``transfer``).
            sender.snd_settle_mode = (
                Link.SND_MIXED if self._dialect is _Dialect.RABBITMQ else Link.SND_UNSETTLED
            )
            sender.rcv_settle_mode = Link.RCV_FIRST
            sender.open()
            self._senders[address] = sender
            self._sender_addresses[sender] = address
        return sender

    def subscribe(
        self,
        subscription_id: str,
        destination: Destination,
        *,
        credit: int,
        settle_on_delivery: bool,
        durable_name: str | None = None,
        browse: bool = False,
        shared_name: str | None = None,
    ) -> Pending[None]:
        """Attach a receiver; the Pending completes once the broker has, and messages then
        arrive as ``on_message``. ``settle_on_delivery``: the broker settles as it sends (at
        most once); else each delivery waits for ``settle``. ``credit`` is kept outstanding
        (0: none until ``pull``). ``browse``: copy the queue's waiting messages without
        consuming them, then ``on_browse_end`` once the broker has drained the link.
        ``durable_name`` names a durable subscription (the link's name, a durable source);
        ``shared_name`` a shared one (the source's capability ``shared``, the link named
        ``<name>|<subscription id>``), durable too when both are given."""
        if isinstance(credit, bool) or not isinstance(credit, int) or credit < 0:
            raise ConfigurationError(f"credit must be a whole number of at least 0, not {credit!r}")
        self._require_open()
        if subscription_id in self._subscriptions:
            raise IllegalStateError(f"subscription {subscription_id!r} exists already")
        attaching: Pending[None] = Pending(
            f"{self._broker_text()}: subscribe {subscription_id!r} to {destination}"
        )
        with map_errors(self._broker_text()):
            if shared_name is not None:
                # Link names are unique on a connection; the broker reads a shared
                # subscription's name up to the '|' (as Qpid JMS names its shared links).
                name = f"{shared_name}|{subscription_id}"
            else:
                name = durable_name or f"hafailover-receiver-{next(self._names)}"
            link = self._require_session().receiver(name)
            link.source.address = self.address(destination)
            if durable_name is not None or self.durable_node(destination):
                _make_durable(link.source)
            if shared_name is not None:
                link.source.capabilities.put_object(SHARED)
            if browse:
                link.source.distribution_mode = Terminus.DIST_MODE_COPY
            if settle_on_delivery or browse:
                link.snd_settle_mode = Link.SND_SETTLED
            else:
                link.snd_settle_mode = Link.SND_UNSETTLED
                link.rcv_settle_mode = Link.RCV_FIRST
            subscription = _Subscription(
                subscription_id,
                link,
                destination,
                credit,
                durable=durable_name is not None,
                attaching=attaching,
                browse=browse,
            )
            self._subscriptions[subscription_id] = subscription
            self._link_subscription[link] = subscription
            self._pending.add(attaching)
            self._open_receiver(link)
        return attaching

    def attach_subscription(self, subscription_id: str, name: str) -> Pending[None]:
        """Attach to the durable subscription ``name`` without naming its topic (a source
        with no address, as Qpid JMS does to unsubscribe): the broker answers with the
        subscription's source, or refuses when it has none of that name. No credit is
        given; ``unsubscribe(subscription_id, remove_durable=True)`` then deletes it."""
        self._require_open()
        if subscription_id in self._subscriptions:
            raise IllegalStateError(f"subscription {subscription_id!r} exists already")
        attaching: Pending[None] = Pending(
            f"{self._broker_text()}: find durable subscription {name!r}"
        )
        with map_errors(self._broker_text()):
            link = self._require_session().receiver(name)
            _make_durable(link.source)
            link.snd_settle_mode = Link.SND_UNSETTLED
            link.rcv_settle_mode = Link.RCV_FIRST
            subscription = _Subscription(
                subscription_id,
                link,
                Destination.topic(name),
                0,
                durable=True,
                attaching=attaching,
            )
            self._subscriptions[subscription_id] = subscription
            self._link_subscription[link] = subscription
            self._pending.add(attaching)
            self._open_receiver(link)
        return attaching

    def _open_receiver(self, link: Receiver) -> None:
        """Open ``link`` now, or once the broker has answered the detach of an earlier link
        of the same name."""
        if link.name in self._detaching:
            self._held_attaches.setdefault(link.name, []).append(link)
        else:
            link.open()

    def settle(
        self,
        delivery_token: int,
        outcome: Outcome,
        *,
        tx: AmqpTransaction | None = None,
        token: int | None = None,
    ) -> None:
        """Settle a received message. A token of a delivery already settled, or of a link
        that has ended, is ignored.

        With ``token`` the outcome is sent unsettled and the delivery is settled only once the
        broker has settled it, which the reference broker does when the outcome is durable
        (or, inside a transaction, taken into it): ``on_settled(token, None)`` confirms it.
        RabbitMQ cannot settle an outcome sent unsettled: there it is sent settled and
        confirmed once written."""
        self._require_open()
        self.check_transaction(tx)
        entry = self._incoming.pop(delivery_token, None)
        if entry is None:
            if token is not None:
                self._emit(self.events.on_settled, token, None)  # settled already
            return
        delivery, _ = entry
        if outcome is Outcome.MODIFIED and self._dialect is _Dialect.RABBITMQ:
            # RabbitMQ 3.10 ends the session on a modified outcome ("Unrecognised state"):
            # released gives the message back there too (uncounted: the consumer counts
            # its failures itself for max_redeliveries).
            outcome = Outcome.RELEASED
        with map_errors(self._broker_text()):
            self._set_outcome(delivery, outcome, tx)
        if token is not None and self._dialect is not _Dialect.RABBITMQ:
            # Settled when the broker settles: once durable, or (in a transaction) once the
            # broker has taken the outcome into the transaction, so a discharge sent after
            # it cannot overtake it.
            self._confirming[delivery] = token
            return
        # RabbitMQ 3.10 cannot settle an outcome sent unsettled: a disposition that does not
        # say settled=true (proton leaves out the default, false) ends its session with an
        # internal error. So there the outcome goes settled, and is confirmed once written.
        delivery.settle()
        if token is not None:
            self._emit(self.events.on_settled, token, None)

    @staticmethod
    def _set_outcome(delivery: Delivery, outcome: Outcome, tx: AmqpTransaction | None) -> None:
        if tx is not None:
            code, fields = {
                Outcome.ACCEPTED: (ACCEPTED, list[Any]()),
                Outcome.RELEASED: (RELEASED, []),
                Outcome.REJECTED: (REJECTED, []),
                Outcome.MODIFIED: (MODIFIED, [True]),
            }[outcome]
            _set_state(delivery, TRANSACTIONAL_STATE, [tx.txn_id, Described(ulong(code), fields)])
        elif outcome is Outcome.ACCEPTED:
            delivery.update(Delivery.ACCEPTED)
        elif outcome is Outcome.RELEASED:
            delivery.update(Delivery.RELEASED)
        elif outcome is Outcome.REJECTED:
            delivery.update(Delivery.REJECTED)
        else:
            delivery.local.failed = True
            delivery.update(Delivery.MODIFIED)

    def unsubscribe(self, subscription_id: str, *, remove_durable: bool = False) -> None:
        """Stop a subscription; its unsettled messages go back to the broker. A durable
        subscription is kept on the broker unless ``remove_durable``."""
        self._require_open()
        subscription = self._subscriptions.get(subscription_id)
        if subscription is None:
            return
        link = subscription.link
        self._forget_subscription(subscription)
        with map_errors(self._broker_text()):
            if subscription.durable and not remove_durable:
                link.detach()  # a detach keeps a durable subscription, a close removes it
            else:
                link.close()
            if link.state & Endpoint.REMOTE_ACTIVE:
                self._detaching[link.name] = link

    def _forget_subscription(self, subscription: _Subscription) -> None:
        self._subscriptions.pop(subscription.name, None)
        self._link_subscription.pop(subscription.link, None)
        for token in [t for t, (_, s) in self._incoming.items() if s is subscription]:
            del self._incoming[token]

    def create_temporary_queue(self) -> Pending[Destination]:
        """A queue that lives as long as this connection (or ``delete_temporary_queue``)."""
        self._require_open()
        created: Pending[Destination] = Pending(f"{self._broker_text()}: create a temporary queue")
        with map_errors(self._broker_text()):
            link = self._require_session().receiver(f"hafailover-temporary-{next(self._names)}")
            link.source.dynamic = True
            # No credit: this link only holds the queue; consumers subscribe to its address.
            self._temporary_queues[link] = _TemporaryQueue(link, created)
            self._pending.add(created)
            link.open()
        return created

    def alias_temporary_queue(self, alias: Destination, created: Destination) -> None:
        """Let ``alias`` (a temporary queue of an earlier connection) name ``created``, so an
        application's destination keeps working after a reconnect recreated it (F5)."""
        address = self._temporary.get(created)
        if address is None:
            raise IllegalStateError(f"{created} is not a temporary queue of this connection")
        self._temporary[alias] = address

    def delete_temporary_queue(self, destination: Destination) -> None:
        self._require_open()
        for link, queue in list(self._temporary_queues.items()):
            if queue.destination == destination:
                del self._temporary_queues[link]
                link.close()
        self._temporary.pop(destination, None)

    def declare(self) -> Pending[AmqpTransaction]:
        """Declare a local transaction; the Pending completes with its id."""
        self._require_open()
        declared: Pending[AmqpTransaction] = Pending(
            f"{self._broker_text()}: declare a transaction"
        )
        self._send_control(Described(DECLARE, [None]), declare=True, request=declared)
        return declared

    def discharge(
        self, tx: AmqpTransaction, *, fail: bool, token: int | None = None
    ) -> Pending[None]:
        """Commit (``fail=False``) or roll back; the Pending completes once the broker has
        settled it, or fails with ProtocolError if the broker refuses. A commit cut by the
        loss of the connection fails with TransactionOutcomeUnknownError. With a ``token``
        nobody waits on the Pending: its outcome arrives as ``on_settled(token, ...)``, as
        a send's does."""
        self._require_open()
        self.check_transaction(tx)
        discharged: Pending[None] = Pending(
            f"{self._broker_text()}: {'roll back' if fail else 'commit'} a transaction",
            UnblockedError if fail else TransactionOutcomeUnknownError,
        )
        if token is not None:
            discharged.notify = functools.partial(self._discharged, token, discharged)
        self._send_control(
            Described(DISCHARGE, [tx.txn_id, fail]), declare=False, request=discharged
        )
        return discharged

    def _discharged(self, token: int, discharged: Pending[None]) -> None:
        """A discharge made with a token was answered (or cut): its outcome as an event."""
        error: RemoteError | None = None
        try:
            discharged.result()
        except RemoteError as exc:
            error = exc
        except HaFailoverError as exc:  # closed here: nobody waits for it any more
            error = UnblockedError(str(exc))
        self._emit(self.events.on_settled, token, error)

    def _send_control(self, body: Described, *, declare: bool, request: Pending[Any]) -> None:
        with map_errors(self._broker_text()):
            coordinator = self._coordinator
            if coordinator is None:
                coordinator = self._require_session().sender(f"hafailover-txn-{next(self._names)}")
                coordinator.target.type = Terminus.COORDINATOR
                coordinator.target.capabilities.put_object(LOCAL_TRANSACTIONS)
                coordinator.open()
                self._coordinator = coordinator
            delivery = coordinator.delivery(str(next(self._names)))
            coordinator.stream(proton.Message(body=body).encode())
            coordinator.advance()
        self._control[delivery] = (declare, request)
        self._pending.add(request)

    def close(self) -> None:
        """Say goodbye: release every waiting request and send a Close. The broker's Close
        (or ``abort``, when the caller stops waiting for it) ends the engine."""
        self._closing = True
        connection = self._connection
        if self.state is _State.NEW:
            self.state = _State.ENDED
            return
        if self._dead or connection is None or connection.state & Endpoint.LOCAL_CLOSED:
            self._shutdown()
            return
        self._dead = True
        self.state = _State.ENDING
        self._release(closing=True)
        connection.close()

    def abort(self) -> None:
        """End at once, without a Close."""
        self._closing = True
        if self.state is _State.NEW:
            self.state = _State.ENDED
            return
        self._dead = True
        self._release(closing=True)
        self._shutdown()

    def _require_open(self) -> None:
        if self.state is not _State.OPEN or self._dead:
            raise NotConnectedError(f"{self._broker_text()}: the connection is not open")

    def _require_session(self) -> Session:
        if self._session is None:
            raise NotConnectedError(f"{self._broker_text()}: the connection is not open")
        return self._session

    def _broker_text(self) -> str:
        return self._broker_redacted

    def _emit(self, callback: Callable[..., None], *args: Any) -> None:
        self._outbox.append((callback, args))

    # --- endings ------------------------------------------------------------------------------

    def _die(
        self,
        reason: str,
        condition: Condition | None,
        *,
        refused: RemoteError | None = None,
        blame_pending: bool = True,
    ) -> None:
        """The connection is gone (or never came): tell who needs to know, once, and stop.

        ``condition``: the broker's or proton's reason, if any; ``refused``: what the open
        fails with instead of the error the condition names; ``blame_pending``: whether the
        waiting requests get the condition as a refusal (else the requests it refused have
        had it already, and the others are released as by a loss)."""
        if self._dead:
            self._shutdown()
            return
        self._dead = True
        if self.state in (_State.OPENING, _State.OPEN):
            self.state = _State.ENDING
        if condition is not None and condition.name == REDIRECT and not self._closing:
            target = parse_redirect(condition.info)
            if target is not None:
                self._emit(self.events.on_redirect, *target)
        opening = self._opening
        self._opening = None
        if opening is not None:
            opening.fail(refused or refusal(condition, self._broker_text()))
        elif not self._closing and not self._lost_reported:
            self._lost_reported = True
            self._emit(self.events.on_lost, f"{self._broker_text()}: {reason}")
        self._release(self._closing, reason, condition if blame_pending else None)
        self._shutdown()

    def _release(self, closing: bool, reason: str = "", condition: Condition | None = None) -> None:
        """Release every waiting request: the answer it waits for will never come.

        When the broker ended the connection or session refusing a request (RabbitMQ ends
        the session on a transaction or a dynamic node it does not implement), the requests
        get that refusal: repeating them after a reconnect would fail the same way."""
        pending, self._pending = self._pending, set()
        if self._opening is not None:
            pending.add(self._opening)
            self._opening = None
        for request in pending:
            error: HaFailoverError
            if closing:
                error = ConnectionClosedError(f"{request.what}: the connection was closed")
            elif request.interrupted is UnblockedError and refuses_request(condition):
                error = condition_error(condition, request.what)
            else:
                lost = f"the connection was lost: {reason}" if reason else "the connection was lost"
                error = request.interrupted(f"{request.what}: {lost}")
            # An event like the others, so a waiter wakes only once the driver has heard of
            # the loss queued before it (``_die``): its failover has begun.
            self._emit(request.fail, error)
        self._control.clear()

    def _shutdown(self) -> None:
        """Close both ends of proton's transport: nothing more goes in or out."""
        if self.state is _State.ENDED:
            return
        self.state = _State.ENDED
        transport = self._transport
        if transport is not None:
            with contextlib.suppress(proton.ProtonException):
                transport.close_tail()
            with contextlib.suppress(proton.ProtonException):
                transport.close_head()

    def _connection_opened(self, connection: Connection) -> None:
        if self._dead:
            return
        properties = connection.remote_properties or {}
        topology = properties.get(TOPOLOGY_PROPERTY)
        if isinstance(topology, list | tuple):
            announced = ",".join(str(item) for item in topology)
        else:
            announced = str(topology) if isinstance(topology, str) else ""
        product = str(properties.get(_PRODUCT, ""))
        session = connection.session()
        session.open()
        self._session = session
        broker = self.broker
        assert broker is not None
        if self.state is _State.OPENING:
            self.state = _State.OPEN
        if "rabbitmq" in product.lower():
            self._dialect = _Dialect.RABBITMQ
        opening = self._opening
        self._opening = None
        opened = Opened(
            broker=broker,
            session_id=None,  # AMQP has no reattach extension here
            resumed=False,
            last_received=-1,
            # hafailover's own key names this node first; the standard list the others.
            topology=tuple(
                dict.fromkeys(
                    parse_topology(announced)
                    + parse_failover_server_list(properties.get(FAILOVER_SERVER_LIST))
                )
            ),
            detects_duplicates=detects_duplicates(product),
            product=product,
        )
        if opening is not None and not opening.succeed(opened):
            self.abort()  # whoever opened gave up waiting

    def _connection_closed_by_peer(self, connection: Connection) -> None:
        condition = connection.remote_condition
        if self._dead:  # the answer to our Close
            self._shutdown()
            return
        self._die(f"closed by the broker: {condition_text(condition)}", condition)

    def _session_closed_by_peer(self, session: Session) -> None:
        if self._dead or session != self._session:
            return
        # Every link lived on this session: without it the connection is of no use.
        condition = session.remote_condition
        refused = self._refuse_attaching(condition) if refuses_request(condition) else None
        self._die(
            f"the broker ended the session: {condition_text(condition)}",
            condition,
            blame_pending=refused is None,
        )
        # After the loss: a caller that wakes with its refusal finds the failover begun.
        for request in refused or ():
            self._emit(request.fail, condition_error(condition, request.what))

    def _refuse_attaching(self, condition: Condition | None) -> list[Pending[Any]] | None:
        """Find the requests a refusal that ended the session refused: settle their sends
        with it and return the waiting requests it refused (None: it refused nothing here).

        RabbitMQ refuses an attach (a queue whose durability differs, a transaction
        coordinator) by ending the session with the reason. The links the broker had not
        attached yet are the candidates, and of those the ones whose node the reason names in
        quotes (RabbitMQ writes "... for queue 'x' ..."), else all of them: none of their
        requests reached a node. Their sends were never transferred (a sender gets no credit
        before it is attached) and their subscriptions never made: each gets the refusal as
        its outcome, not the loss of the connection that follows, which would make a send in
        doubt and a retry meet the same refusal after every failover."""
        attaching: list[tuple[Link, str | None]] = list(self._sender_addresses.items())
        attaching.extend((link, link.source.address) for link in self._link_subscription)
        attaching.extend((link, None) for link in self._temporary_queues)
        if self._coordinator is not None:
            attaching.append((self._coordinator, None))
        attaching = [(link, a) for link, a in attaching if link.state & Endpoint.REMOTE_UNINIT]
        description = "" if condition is None else str(condition.description or "")
        named = [
            link for link, a in attaching if a is not None and f"'{_node_name(a)}'" in description
        ]
        refused = set(named) if named else {link for link, _ in attaching}
        if not refused:
            return None
        what = self._broker_text()
        for delivery, token in list(self._outgoing.items()):
            if delivery.link in refused:
                del self._outgoing[delivery]
                address = self._sender_addresses.get(delivery.link, "")
                error = condition_error(condition, f"{what}: send to {address} (not sent)")
                self._emit(self.events.on_settled, token, error)
        waiters: list[Pending[Any]] = []
        for link in refused:
            subscription = self._link_subscription.get(link)
            if subscription is not None and subscription.attaching is not None:
                waiters.append(subscription.attaching)
                subscription.attaching = None
            queue = self._temporary_queues.get(link)
            if queue is not None and queue.attaching is not None:
                waiters.append(queue.attaching)
                queue.attaching = None
        waiters.extend(
            waiter for delivery, (_, waiter) in self._control.items() if delivery.link in refused
        )
        for waiter in waiters:
            self._pending.discard(waiter)
        return waiters

    def _transport_failed(self, condition: Condition | None) -> None:
        self._die(condition_text(condition), condition)

    def _link_opened(self, link: Link) -> None:
        subscription = self._link_subscription.get(link)
        if subscription is not None and subscription.attaching is not None:
            if link.remote_source.address is None:
                return  # refused: the detach with the reason follows (part 2.6.3)
            waiter, subscription.attaching = subscription.attaching, None
            self._pending.discard(waiter)
            if waiter.succeed(None):
                assert isinstance(link, Receiver)
                if subscription.browse:
                    link.drain(subscription.credit)
                else:
                    link.flow(subscription.credit)
            else:  # the subscriber gave up waiting
                self._forget_subscription(subscription)
                link.close()
            return
        queue = self._temporary_queues.get(link)
        if queue is not None and queue.attaching is not None:
            address = link.remote_source.address
            if address is None:
                return
            name = address.removeprefix(_TEMP_QUEUE_PREFIX)
            destination = Destination(DestinationKind.TEMPORARY_QUEUE, name)
            queue.destination = destination
            self._temporary[destination] = address
            created, queue.attaching = queue.attaching, None
            self._pending.discard(created)
            if not created.succeed(destination):  # nobody waits for it any more
                del self._temporary_queues[link]
                self._temporary.pop(destination, None)
                link.close()

    def _link_ended_by_peer(self, link: Link) -> None:
        if self._detaching.get(link.name) == link:
            del self._detaching[link.name]
            for held in self._held_attaches.pop(link.name, []):
                held.open()
            return
        condition = link.remote_condition
        reason = condition_text(condition)
        if link.state & Endpoint.LOCAL_ACTIVE:
            link.close()
        if self._dead:
            return
        subscription = self._link_subscription.get(link)
        if subscription is not None:
            self._forget_subscription(subscription)
            waiter, subscription.attaching = subscription.attaching, None
            error = ProtocolError(
                f"{self._broker_text()}: subscription {subscription.name!r} to "
                f"{subscription.destination} ended by the broker: {reason}"
            )
            if waiter is not None:
                self._pending.discard(waiter)
                waiter.fail(error)
            else:
                self._emit(self.events.on_error, error)
            return
        queue = self._temporary_queues.pop(link, None)
        if queue is not None:
            error = ProtocolError(f"{self._broker_text()}: temporary queue refused: {reason}")
            if queue.attaching is not None:
                self._pending.discard(queue.attaching)
                queue.attaching.fail(error)
            else:
                self._emit(self.events.on_error, error)
            return
        if link == self._coordinator:
            self._coordinator = None
            error = ProtocolError(
                f"{self._broker_text()}: the transaction coordinator ended: {reason}"
            )
            for delivery, (_, waiter) in list(self._control.items()):
                if delivery.link == link:
                    del self._control[delivery]
                    self._pending.discard(waiter)
                    waiter.fail(error)
            self._emit(self.events.on_error, error)
            return
        address = self._sender_addresses.pop(link, None)
        if address is not None:
            if self._senders.get(address) == link:
                del self._senders[address]
            if link.remote_target.address is None:  # refused at attach: nothing arrived
                error = ProtocolError(
                    f"{self._broker_text()}: the broker refused a sender to {address}, "
                    f"the message was not sent: {reason}"
                )
            else:
                error = ProtocolError(
                    f"{self._broker_text()}: the sender link to {address} ended before the "
                    f"broker settled: outcome unknown: {reason}"
                )
            for delivery, token in list(self._outgoing.items()):
                if delivery.link == link:
                    del self._outgoing[delivery]
                    self._emit(self.events.on_settled, token, error)
            self._emit(
                self.events.on_error,
                ProtocolError(f"{self._broker_text()}: sender link to {address} ended: {reason}"),
            )

    def _delivery_updated(self, delivery: Delivery) -> None:
        link = delivery.link
        if link.is_receiver:
            assert isinstance(link, Receiver)
            self._received(link, delivery)
        elif delivery in self._control:
            self._control_settled(delivery)
        else:
            self._sent_settled(link, delivery)

    def _received(self, link: Receiver, delivery: Delivery) -> None:
        confirm = self._confirming.pop(delivery, None)
        if confirm is not None:
            if delivery.settled:  # the broker settled our outcome: it is done (and durable)
                delivery.settle()
                self._emit(self.events.on_settled, confirm, None)
            else:
                self._confirming[delivery] = confirm
            return
        if delivery.aborted:
            delivery.settle()
            return
        if not delivery.readable or delivery.partial:
            return  # an update of a delivery read already, or more bytes to come
        payload = link.recv(delivery.pending) or b""
        link.advance()
        subscription = self._link_subscription.get(link)
        if subscription is None:  # a link that has ended or only holds a temporary queue
            delivery.update(Delivery.RELEASED)
            delivery.settle()
            return
        try:
            message = decode_message(payload, fallback=subscription.destination)
        except (proton.ProtonException, HaFailoverError, ValueError, TypeError) as exc:
            delivery.local.condition = Condition("amqp:decode-error", str(exc)[:200])
            delivery.update(Delivery.REJECTED)
            delivery.settle()
            self._emit(
                self.events.on_error,
                ProtocolError(f"{self._broker_text()}: an undecodable message was rejected: {exc}"),
            )
            return
        token = next(_DELIVERY_TOKENS)
        if delivery.settled:  # pre-settled by the broker: nothing left to say about it
            delivery.settle()
        else:
            self._incoming[token] = (delivery, subscription)
        if subscription.credit and link.credit <= subscription.credit // 2:
            if subscription.browse:
                link.drain(subscription.credit - link.credit)
            else:
                link.flow(subscription.credit - link.credit)
        self._emit(self.events.on_message, subscription.name, token, message)
        if subscription.drain_waiter is not None and link.credit == 0:
            self._drained(subscription)  # the drain's answer is this message: after it

    def pull(self, subscription_id: str) -> None:
        """A receive of a pull subscription (credit 0) waits: one credit, unless the link
        holds one or a drain is under way (zero prefetch, ``core/pull.py``)."""
        subscription = self._subscriptions.get(subscription_id)
        if subscription is None or subscription.attaching is not None or self._dead:
            return
        link = subscription.link
        assert isinstance(link, Receiver)
        if link.credit == 0 and subscription.drain_waiter is None:
            link.flow(1)

    def drain(self, subscription_id: str) -> Pending[None]:
        """The receive ended without a message: take the pull's credit back. Completes once
        the broker has used it (the message is delivered first) or returned it."""
        done: Pending[None] = Pending(f"{self._broker_text()}: drain {subscription_id!r}")
        subscription = self._subscriptions.get(subscription_id)
        if subscription is None or self._dead:
            done.succeed(None)
            return done
        link = subscription.link
        assert isinstance(link, Receiver)
        if link.credit == 0 or subscription.attaching is not None:
            done.succeed(None)
            return done
        if subscription.drain_waiter is None:
            subscription.drain_waiter = done
            self._pending.add(done)
            link.drain(0)
        return subscription.drain_waiter

    def _drained(self, subscription: _Subscription) -> None:
        """The pull's credit is used or returned. An event like the others, so that the
        receive waiting for it wakes after the message the credit brought was routed."""
        waiter, subscription.drain_waiter = subscription.drain_waiter, None
        if waiter is not None:
            self._pending.discard(waiter)
            self._emit(_succeed, waiter)

    def _link_flow(self, link: Link) -> None:
        subscription = self._link_subscription.get(link)
        if subscription is not None and subscription.drain_waiter is not None:
            assert isinstance(link, Receiver)
            if link.credit == 0 and not link.draining():
                self._drained(subscription)
            return
        if subscription is None or not subscription.browse or subscription.attaching is not None:
            return
        assert isinstance(link, Receiver)
        if link.credit == 0 and not link.draining():
            # The broker drained the link: the snapshot is over. The link has done its job.
            self._forget_subscription(subscription)
            link.close()
            self._emit(self.events.on_browse_end, subscription.name)

    def _sent_settled(self, link: Link, delivery: Delivery) -> None:
        token = self._outgoing.get(delivery)
        state = delivery.remote_state
        if token is None:
            if delivery.settled:
                delivery.settle()
            return
        outcome = int(state) if state else 0
        if outcome == TRANSACTIONAL_STATE:
            outcome = _transactional_outcome(delivery.remote.data)
            if outcome == 0:
                return  # no outcome yet
        elif outcome not in OUTCOME_NAMES:
            if not delivery.settled:
                return  # a non-terminal state (received): wait for the outcome
            outcome = ACCEPTED  # settled without a state: the broker took it
        del self._outgoing[delivery]
        error = None
        if outcome != ACCEPTED:
            address = self._sender_addresses.get(link) or link.name
            error = outcome_error(outcome, delivery, f"{self._broker_text()}: send to {address}")
        delivery.settle()
        self._emit(self.events.on_settled, token, error)

    def _control_settled(self, delivery: Delivery) -> None:
        state = delivery.remote_state
        if not state and not delivery.settled:
            return
        declare, waiter = self._control.pop(delivery)
        self._pending.discard(waiter)
        remote = delivery.remote
        delivery.settle()
        if declare and state == DECLARED and remote.data:
            tx = AmqpTransaction(_txn_id(remote.data[0]), self.serial)
            if not waiter.succeed(tx):  # nobody waits for it: end what it began
                self._send_control(
                    Described(DISCHARGE, [tx.txn_id, True]), declare=False, request=Pending("")
                )
            return
        if not declare and state == Delivery.ACCEPTED:
            waiter.succeed(None)
            return
        what = "declare" if declare else "discharge"
        code = int(state) if state else 0
        reason = condition_text(remote.condition) if code == REJECTED else f"state {code:#x}"
        waiter.fail(ProtocolError(f"{waiter.what}: the broker refused the {what}: {reason}"))


def _make_durable(terminus: Terminus) -> None:
    """A terminus that outlives its link: a durable subscription, or a durable queue on
    RabbitMQ (which also wants the expiry policy "never" for one)."""
    terminus.durability = Terminus.DELIVERIES
    terminus.expiry_policy = Terminus.EXPIRE_NEVER


def _node_name(address: str) -> str:
    """The name of the node an address names, without its kind (``/queue/x``: ``x``)."""
    for prefix in ("/queue/", "/topic/", "queue://", "topic://"):
        if address.startswith(prefix):
            return address[len(prefix) :]
    return address


def _set_state(delivery: Delivery, state: int, data: list[Any]) -> None:
    """Give a delivery a state proton has no setter for (declared, transactional)."""
    # proton annotates Disposition.data as a list of int; it is any AMQP list.
    delivery.local.data = data
    delivery.update(state)


def _txn_id(value: object) -> bytes:
    if isinstance(value, bytes | memoryview | bytearray):
        return bytes(value)
    return str(value).encode()


def _transactional_outcome(data: object) -> int:
    """The outcome code inside a transactional-state, or 0 if it holds none."""
    if not isinstance(data, list) or len(data) < 2 or not isinstance(data[1], Described):
        return 0
    descriptor = data[1].descriptor
    if isinstance(descriptor, int):
        return int(descriptor)
    names = {v: k for k, v in OUTCOME_NAMES.items() if isinstance(k, int)}
    return names.get(OUTCOME_NAMES.get(str(descriptor), ""), 0)


def _given(value: T | None) -> T:
    """proton types an event's objects as optional; an event of each kind carries its own."""
    assert value is not None
    return value


def _on_link_flow(engine: AmqpEngine, event: Event) -> None:
    if event.link is not None:
        engine._link_flow(event.link)


def _on_transport_error(engine: AmqpEngine, event: Event) -> None:
    engine._transport_failed(None if event.transport is None else event.transport.condition)


def _on_transport_closed(engine: AmqpEngine, event: Event) -> None:
    condition = None if event.transport is None else event.transport.condition
    engine._transport_failed(condition or Condition("connection closed"))


_HANDLERS: Final[dict[object, Callable[[AmqpEngine, Event], None]]] = {
    Event.CONNECTION_REMOTE_OPEN: lambda e, ev: e._connection_opened(_given(ev.connection)),
    Event.CONNECTION_REMOTE_CLOSE: lambda e, ev: e._connection_closed_by_peer(
        _given(ev.connection)
    ),
    Event.SESSION_REMOTE_CLOSE: lambda e, ev: e._session_closed_by_peer(_given(ev.session)),
    Event.LINK_REMOTE_OPEN: lambda e, ev: e._link_opened(_given(ev.link)),
    Event.LINK_REMOTE_CLOSE: lambda e, ev: e._link_ended_by_peer(_given(ev.link)),
    Event.LINK_REMOTE_DETACH: lambda e, ev: e._link_ended_by_peer(_given(ev.link)),
    Event.LINK_FLOW: _on_link_flow,
    Event.DELIVERY: lambda e, ev: e._delivery_updated(_given(ev.delivery)),
    Event.TRANSPORT_ERROR: _on_transport_error,
    Event.TRANSPORT_CLOSED: _on_transport_closed,
}
