"""The AMQP 1.0 server: a SASL layer of its own, then a sans-IO proton transport per socket.

One ``AmqpConnection`` (an asyncio protocol) per TCP connection, on the node's one event
loop, with no threads and no proton reactor. The connection first runs the SASL exchange
itself (``reference_broker.amqp.sasl``): the PyPI proton has no Cyrus SASL (DESIGN.md
section 8, option (b)), and checking PLAIN here keeps one users file for STOMP and AMQP.
What follows the SASL layer is pushed into a proton ``Transport`` in server mode with SASL
off; proton's events drive the engine, and proton's output goes back to the socket.

What it maps (addresses and messages: ``reference_broker.amqp.mapping``):

- A client's sender link is a producer; each transfer is one ``Engine.send``. An unsettled
  transfer of a persistent message is accepted only once ``core.durable()`` says it is in
  the journal and on the backup: that disposition is the broker's confirmation. Producers
  get ``PRODUCER_CREDIT`` of link credit, topped up as transfers are confirmed, so a slow
  disk slows producers instead of growing memory. A sender link without a target address
  is an anonymous relay (each message's ``to`` names its address); ANONYMOUS-RELAY is
  offered in the Open.
- A client's receiver link is a consumer: link credit is the engine consumer's credit;
  a pre-settled link (snd-settle-mode settled) consumes in AUTO ack mode, any other in
  CLIENT_INDIVIDUAL with the client's dispositions mapped to outcomes (accepted ->
  ACCEPTED, released -> RELEASED, rejected -> REJECTED, modified with delivery-failed ->
  FAILED, without it -> RELEASED; settled without a state counts as accepted). Drain is
  honoured once the engine has dispatched what it can. A topic link with a durable source
  (durability not none, expiry-policy never) is the durable subscription named after the
  link; closing the link (detach with closed=true) deletes it, a plain detach keeps it.
  Without the source capability ``shared`` such a subscription has one active consumer at
  a time; with it, links named ``<name>`` or ``<name>|<anything>`` share the subscription
  ``<name>``, and a topic link with ``shared`` and a
  non-durable source is a shared subscription deleted with its last link. A receiver with
  no source address attaches to the durable subscription its name names (to close it).
  A source with distribution-mode copy is a queue browser: a snapshot of the waiting
  messages, pre-settled. Message selectors are refused (amqp:not-implemented).
- A dynamic source or target is a temporary queue owned by the connection, deleted when
  its link closes (the AMQP default lifetime policy) or the connection ends.
- A coordinator target is the transaction coordinator: declare -> ``Engine.begin``,
  discharge -> commit (accepted once durable) or rollback. Transfers and dispositions whose
  state is transactional-state join the engine transaction. Transaction ids are only valid
  on the connection that declared them.
- Errors: a ``BrokerError`` on attach refuses the link, on a transfer rejects it, on a
  disposition detaches the link, each with the condition ``mapping.condition_for`` names
  and the broker's text. Malformed input closes the connection with an error; a bug in a
  handler closes that one connection (amqp:internal-error) and is logged; the broker goes
  on serving the others.

Extension, topology announcement (DESIGN F12): the server's Open carries, in its
properties, the symbol key ``hafailover-topology`` with a list of strings: the client
addresses ("host:port") of this node and its backup, this node first. A client that knows
the key may add them to its failover list; any other client ignores it. Beside it, the
standard key ``failover-server-list`` (as ActiveMQ Artemis sends and Qpid JMS reads): a list
of maps with ``network-host``, ``hostname``, ``port`` and ``scheme``, one per other node.

Heart-beats: the transport's local idle timeout is twice ``core.config.heartbeat``; proton
announces half of it in the Open, so a client sends a frame at least every heartbeat
seconds, and one silent for two is closed (amqp:resource-limit-exceeded). proton's
``tick`` gives the next deadline, kept with ``loop.call_at``.

Flow control: deliveries never exceed link credit, and while the socket's write buffer
is above its high-water mark (``pause_writing``) the connection's consumers are paused in
the engine. A slow reader therefore costs at most one loop turn's dispatch (bounded by the
credit it granted) beyond the high-water mark, never an unbounded buffer.

It never touches the journal or the replication link (durability is the core's business)
and never blocks the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from functools import partial
from typing import Final, TypeAlias

from proton import (
    Collector,
    Condition,
    Connection,
    Data,
    Delivery,
    Described,
    Endpoint,
    Event,
    Link,
    Message,
    ProtonException,
    Session,
    Terminus,
    Transport,
    symbol,
    ulong,
)

from reference_broker.amqp.mapping import (
    NotImplementedByBrokerError,
    amqp_address,
    condition_for,
    decode_incoming,
    encode_delivery,
)
from reference_broker.amqp.sasl import (
    AmqpHeaderReceived,
    PlainCredentialsError,
    SaslCode,
    SaslInitReceived,
    SaslProtocolError,
    SaslServer,
    parse_plain,
)
from reference_broker.core import BrokerCore
from reference_broker.engine import (
    AckMode,
    Outcome,
    UnknownAddressError,
    UnknownDeliveryError,
    UnknownTransactionError,
)
from reference_broker.engine import Delivery as EngineDelivery
from reference_broker.message import BrokerError, InvalidRequestError, NotFoundError
from reference_broker.message import Message as EngineMessage
from reference_broker.users import login_guard

__all__ = [
    "PRODUCER_CREDIT",
    "TOPOLOGY_PROPERTY",
    "AmqpConnection",
    "serve_amqp",
]

log = logging.getLogger(__name__)

TOPOLOGY_PROPERTY: Final = symbol("hafailover-topology")
# A source capability (Qpid JMS): the subscription is shared by the links that name it.
SHARED: Final = "shared"
FAILOVER_SERVER_LIST: Final = symbol("failover-server-list")


def _server_entry(address: str) -> dict[symbol, object]:
    """One node of the failover-server-list: where a client reaches it."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return {
        symbol("network-host"): host,
        symbol("hostname"): host,
        symbol("port"): int(port),
        symbol("scheme"): "amqp",
    }


PRODUCER_CREDIT: Final = 1000
ANONYMOUS_RELAY: Final = symbol("ANONYMOUS-RELAY")
PRODUCT: Final = "hafailover-reference-broker/0.1"

# Transaction performatives and delivery states (AMQP 1.0 part 4.5).
_DECLARE: Final = (ulong(0x31), symbol("amqp:declare:list"))
_DISCHARGE: Final = (ulong(0x32), symbol("amqp:discharge:list"))
_DECLARED: Final = 0x33
_TRANSACTIONAL_STATE: Final = 0x34
_ACCEPTED_OUTCOME: Final = ulong(0x24)
_OUTCOMES: Final = {
    0x24: Outcome.ACCEPTED,
    0x25: Outcome.REJECTED,
    0x26: Outcome.RELEASED,
}
_MODIFIED: Final = 0x27

_WRITE_HIGH_WATER: Final = 4 * 1024 * 1024
_MAX_FRAME_SIZE: Final = 1024 * 1024
# Room for the sections around a body of max_body_size.
_MESSAGE_OVERHEAD: Final = 64 * 1024
# How long a closing connection may take to say goodbye before its socket is aborted.
_CLOSE_GRACE: Final = 2.0


class _Producer:
    """A client's sender link: the broker receives."""

    __slots__ = ("address", "inflight", "link", "temp_queue")

    def __init__(self, link: Link, address: str | None, temp_queue: str | None) -> None:
        self.link = link
        self.address = address  # None: anonymous relay
        self.temp_queue = temp_queue
        self.inflight = 0  # transfers received, not yet confirmed


class _Consumer:
    __slots__ = ("auto", "consumer_id", "link", "subscription", "temp_queue")

    def __init__(
        self,
        link: Link,
        consumer_id: int,
        *,
        auto: bool,
        subscription: tuple[str, str] | None,
        temp_queue: str | None,
    ) -> None:
        self.link = link
        self.consumer_id = consumer_id
        self.auto = auto
        self.subscription = subscription  # (topic, name) of a durable subscription
        self.temp_queue = temp_queue


class _Browser:
    __slots__ = ("link", "messages", "sent")

    def __init__(self, link: Link, messages: Iterable[EngineMessage]) -> None:
        self.link = link
        self.messages = deque(messages)
        self.sent = 0


class _Coordinator:
    __slots__ = ("declared", "link")

    def __init__(self, link: Link) -> None:
        self.link = link
        self.declared: set[bytes] = set()  # txn-ids declared here and not yet discharged


_LinkState: TypeAlias = _Producer | _Consumer | _Browser | _Coordinator
# A transfer or discharge waiting for durability, and the producer whose credit it holds.
_Unconfirmed: TypeAlias = tuple[Delivery, _Producer | None]


def _terminus_object(data: Data) -> object:
    """The value held in one of a terminus's Data fields (capabilities, filter), or None."""
    data.rewind()
    return data.get_object() if data.next() else None


def _symbols(value: object) -> set[str]:
    if value is None:
        return set()
    if isinstance(value, str):
        return {str(value)}
    if isinstance(value, Iterable):
        return {str(v) for v in value if isinstance(v, str)}
    return set()


def _txn_id_bytes(value: object) -> bytes | None:
    if isinstance(value, bytes | memoryview):
        return bytes(value)
    return None


class AmqpConnection(asyncio.Protocol):
    """One client's TCP connection speaking AMQP 1.0."""

    def __init__(
        self,
        core: BrokerCore,
        *,
        handshake_timeout: float = 30.0,
        on_lost: Callable[[AmqpConnection], None] | None = None,
    ) -> None:
        self.core = core
        self.handshake_timeout = handshake_timeout
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.user: str | None = None
        mechanisms = ["PLAIN", "ANONYMOUS"] if core.config.allow_anonymous else ["PLAIN"]
        self._sasl: SaslServer | None = SaslServer(mechanisms)
        # The AMQP layer, created once SASL is done (or skipped).
        self._proton: Transport | None = None
        self._connection: Connection | None = None
        self._collector: Collector | None = None
        self._refusal: tuple[str, str] | None = None  # (condition, text) for the Open
        self._engine_connection: int | None = None
        self._links: dict[Link, _LinkState] = {}
        self._consumers: dict[int, _Consumer] = {}
        self._transactions: dict[bytes, int] = {}
        self._unconfirmed: list[_Unconfirmed] = []
        self._draining: set[int] = set()
        self._closed = False
        self._failed = False  # closing with an error: the client's further requests are moot
        self._paused = False
        self._processing = False
        self._output_scheduled = False
        self._drain_scheduled = False
        self._tick_handle: asyncio.TimerHandle | None = None
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._abort_timer: asyncio.TimerHandle | None = None
        self._login: asyncio.Task[None] | None = None  # the SASL password check

    # --- asyncio callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self._handshake_timer = asyncio.get_running_loop().call_later(
            self.handshake_timeout, self._handshake_expired
        )

    def data_received(self, data: bytes) -> None:
        if self._closed or (self.transport is not None and self.transport.is_closing()):
            return  # refused or failed: what else the client says changes nothing
        if self._sasl is not None:
            self._sasl_received(data)
        else:
            self._push(data)

    def eof_received(self) -> bool | None:
        connection = self._connection
        if self._sasl is not None:
            log.info("amqp client %s: end of input during SASL", self.peer)
        elif connection is not None and not connection.state & Endpoint.REMOTE_CLOSED:
            log.info("amqp client %s: end of input without a Close", self.peer)
        if self._proton is not None and not self._closed:
            # Let proton see the end of input: it reports an abrupt end as an error.
            with contextlib.suppress(ProtonException):
                self._proton.close_tail()
            self._process()
        return None  # asyncio closes the socket once what was written is flushed

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.core.release(self)
        for timer in (self._tick_handle, self._handshake_timer, self._abort_timer):
            if timer is not None:
                timer.cancel()
        if self._login is not None:
            self._login.cancel()
        self._end_engine_connection()
        self._links.clear()
        self._unconfirmed.clear()
        if self._proton is not None:
            with contextlib.suppress(ProtonException):
                self._proton.unbind()
        self._proton = None
        self._connection = None
        self._collector = None
        if self._on_lost is not None:
            self._on_lost(self)

    def pause_writing(self) -> None:
        self._paused = True
        if self._engine_connection is not None:
            self.core.engine.pause_connection(self._engine_connection)

    def resume_writing(self) -> None:
        self._paused = False
        if self._engine_connection is not None and not self._closed:
            self.core.engine.resume_connection(self._engine_connection)
            self.core.kick()

    # --- the SASL layer --------------------------------------------------------------------

    def _sasl_received(self, data: bytes) -> None:
        sasl = self._sasl
        assert sasl is not None
        try:
            events = sasl.receive(data)
        except SaslProtocolError as exc:
            log.info("amqp client %s broke the SASL exchange: %s", self.peer, exc)
            self._write(sasl.data_to_send())
            self._close_socket()
            return
        self._write(sasl.data_to_send())
        for event in events:
            if isinstance(event, SaslInitReceived):
                self._authenticate(sasl, event)
            elif isinstance(event, AmqpHeaderReceived):
                # No SASL: only a broker that allows anonymous clients lets it in; any other
                # gets an Open and a Close that says why, which clients report clearly.
                self._sasl = None
                if not self.core.config.allow_anonymous:
                    log.info("amqp client %s skipped SASL: refused", self.peer)
                    self._refusal = (
                        "amqp:unauthorized-access",
                        "authentication required: use SASL PLAIN",
                    )
                self._start_amqp(event.data)

    def _authenticate(self, sasl: SaslServer, init: SaslInitReceived) -> None:
        user: str | None = None
        password: str | None = None
        if init.mechanism == "PLAIN":
            try:
                authzid, user, password = parse_plain(init.initial_response)
            except PlainCredentialsError as exc:
                log.info("amqp client %s: bad PLAIN response: %s", self.peer, exc)
                self._sasl_verdict(sasl, None)
                return
            if authzid not in ("", user):
                # No impersonation: an authorization id, if given, must be the user itself.
                log.warning("amqp client %s: PLAIN authzid %r is not %r", self.peer, authzid, user)
                self._sasl_verdict(sasl, None)
                return
        elif init.mechanism != "ANONYMOUS" or not self.core.config.allow_anonymous:
            log.warning(
                "amqp client %s asked for SASL mechanism %r, not offered", self.peer, init.mechanism
            )
            self._sasl_verdict(sasl, None)
            return
        # The password check runs off the event loop (reference_broker.users.LoginGuard); the
        # SASL machine keeps what the client pipelines meanwhile.
        self._login = asyncio.get_running_loop().create_task(self._log_in(sasl, user, password))

    async def _log_in(self, sasl: SaslServer, user: str | None, password: str | None) -> None:
        ok = await login_guard(self.core.users).authenticate(
            user, password, self.peer, allow_anonymous=self.core.config.allow_anonymous
        )
        if not self._closed and self._sasl is sasl:
            self._sasl_verdict(sasl, user if ok else None, ok=ok)

    def _sasl_verdict(self, sasl: SaslServer, user: str | None, *, ok: bool = False) -> None:
        if not ok:
            sasl.refuse(SaslCode.AUTH)
            self._write(sasl.data_to_send())
            self._close_socket()
            return
        self.user = user
        rest = sasl.accept()
        self._write(sasl.data_to_send())
        self._sasl = None
        self._start_amqp(rest)

    # --- the AMQP layer --------------------------------------------------------------------

    def _start_amqp(self, data: bytes) -> None:
        connection = Connection()
        collector = Collector()
        connection.collect(collector)
        transport = Transport(Transport.SERVER)
        transport.max_frame_size = _MAX_FRAME_SIZE
        transport.idle_timeout = 2 * self.core.config.heartbeat
        transport.bind(connection)
        self._connection = connection
        self._collector = collector
        self._proton = transport
        if data:
            self._push(data)

    def _push(self, data: bytes) -> None:
        transport = self._proton
        if transport is None:
            return
        while data:
            capacity = transport.capacity()
            if capacity <= 0:
                break  # input is closed: the transport is failing or done
            chunk, data = data[:capacity], data[capacity:]
            try:
                transport.push(chunk)
            except ProtonException as exc:
                log.info("amqp client %s: %s", self.peer, exc)
                break
        self._process()

    def _process(self) -> None:
        """Handle proton's events, settle what became durable, write proton's output."""
        if self._processing or self._closed:
            return
        collector, transport = self._collector, self._proton
        if collector is None or transport is None:
            return
        self._processing = True
        deadline = 0.0
        try:
            self._handle_events(collector)
            deadline = transport.tick(asyncio.get_running_loop().time())
            self._handle_events(collector)  # what the tick did (an idle timeout)
            self._request_confirmation()
            self.core.kick()
            self._write_output(transport)
        except ProtonException as exc:
            # proton refusing its own state is this connection's end, never the broker's.
            log.warning("amqp client %s: proton failed: %s: closing", self.peer, exc)
            self._abort()
        finally:
            self._processing = False
        self._schedule_tick(deadline)

    def _handle_events(self, collector: Collector) -> None:
        while (event := collector.peek()) is not None:
            handler = self._HANDLERS.get(event.type)
            if handler is not None and not self._closed and not self._failed:
                if self._refusal is not None and event.type is not Event.CONNECTION_REMOTE_OPEN:
                    pass  # a refused connection gets an Open and a Close, nothing else
                else:
                    try:
                        handler(self, event)
                    except Exception:
                        log.exception("amqp connection from %s: handler failed", self.peer)
                        self._fail("amqp:internal-error", "internal error in the broker")
            collector.pop()

    def _write_output(self, transport: Transport) -> None:
        while True:
            try:
                pending = transport.pending()
            except ProtonException:
                pending = -1
            if pending > 0:
                out = transport.peek(pending)
                if out:
                    self._write(out)
                transport.pop(pending)
            else:
                break
        if pending < 0:  # the head is closed: proton has said everything it will say
            self._close_socket()

    def _schedule_tick(self, deadline: float) -> None:
        handle = self._tick_handle
        if handle is not None and (not deadline or handle.when() != deadline):
            handle.cancel()
            self._tick_handle = None
        if deadline and self._tick_handle is None and not self._closed:
            self._tick_handle = asyncio.get_running_loop().call_at(deadline, self._on_tick)

    def _on_tick(self) -> None:
        self._tick_handle = None
        self._process()

    def _output_soon(self) -> None:
        if not self._output_scheduled:
            self._output_scheduled = True
            asyncio.get_running_loop().call_soon(self._output_now)

    def _output_now(self) -> None:
        self._output_scheduled = False
        self._process()

    # --- connection and sessions -----------------------------------------------------------

    def _on_connection_open(self, event: Event) -> None:
        connection = _connection_of(event)
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        connection.container = self.core.config.node_id
        if self._refusal is None and not self.core.may_serve():
            self._refusal = ("amqp:connection:forced", "this node is not active: use the live")
        if self._refusal is None:
            refused = self.core.admit(self, self.user)
            if refused is not None:
                self._refusal = ("amqp:resource-limit-exceeded", refused)
        if self._refusal is not None:
            name, text = self._refusal
            connection.open()
            connection.condition = Condition(name, text)
            connection.close()
            self._arm_abort()
            return
        connection.offered_capabilities = [ANONYMOUS_RELAY]
        config = self.core.config
        announced = config.topology.get("amqp", ())
        properties: dict[symbol, object] = {
            symbol("product"): PRODUCT,
            # The standard announcement (ActiveMQ Artemis, Qpid JMS): the other nodes.
            FAILOVER_SERVER_LIST: [_server_entry(address) for address in announced[1:]],
        }
        if config.topology_extension:
            properties[TOPOLOGY_PROPERTY] = list(announced)
        connection.properties = properties
        connection.open()
        self._engine_connection = self.core.engine.connect()
        if self._paused:
            self.core.engine.pause_connection(self._engine_connection)

    def _on_connection_close(self, event: Event) -> None:
        self._end_engine_connection()
        connection = _connection_of(event)
        if connection.state & Endpoint.LOCAL_ACTIVE:
            connection.close()
        self._arm_abort()

    def _on_session_open(self, event: Event) -> None:
        _session_of(event).open()

    def _on_session_close(self, event: Event) -> None:
        session = _session_of(event)
        for link in [link for link in self._links if link.session == session]:
            self._end_link(link, closed=False, session_ended=True)
        if session.state & Endpoint.LOCAL_ACTIVE:
            session.close()

    def _on_transport_error(self, event: Event) -> None:
        transport = event.transport
        condition = None if transport is None else transport.condition
        log.info(
            "amqp client %s: transport error: %s",
            self.peer,
            f"{condition.name}: {condition.description}" if condition else "unknown",
        )

    # --- links -----------------------------------------------------------------------------

    def _on_link_open(self, event: Event) -> None:
        link = _link_of(event)
        try:
            if link.is_receiver:
                self._open_producer(link)
            else:
                self._open_consumer(link)
        except BrokerError as exc:
            log.info("amqp client %s: link %r refused: %s", self.peer, link.name, exc)
            # Attach with a null terminus, then detach with the reason (part 2.6.3).
            link.open()
            link.condition = condition_for(exc)
            link.close()

    def _open_producer(self, link: Link) -> None:
        engine, connection_id = self.core.engine, self._require_engine_connection()
        remote = link.remote_target
        temp_queue: str | None = None
        state: _LinkState
        if remote.type == Terminus.COORDINATOR:
            state = _Coordinator(link)
        else:
            if remote.dynamic:
                temp_queue = address = engine.create_temp_queue(connection_id)
            elif remote.address is None:
                address = None  # anonymous relay
            else:
                address = amqp_address(remote.address, _symbols(_capabilities(remote)))
            state = _Producer(link, address, temp_queue)
        link.target.copy(remote)
        if temp_queue is not None:
            link.target.address = temp_queue
        link.source.copy(link.remote_source)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = Link.RCV_FIRST
        link.max_message_size = self.core.config.max_body_size + _MESSAGE_OVERHEAD
        self._links[link] = state
        link.open()
        link.flow(PRODUCER_CREDIT)

    def _open_consumer(self, link: Link) -> None:
        engine, connection_id = self.core.engine, self._require_engine_connection()
        remote = link.remote_source
        _refuse_selectors(remote)
        temp_queue: str | None = None
        by_name = remote.address is None and not remote.dynamic
        if remote.dynamic:
            temp_queue = address = engine.create_temp_queue(connection_id)
        elif by_name:
            address = self._durable_subscription_of(link)
        else:
            address = amqp_address(remote.address, _symbols(_capabilities(remote)))
        state: _LinkState
        if remote.distribution_mode == Terminus.DIST_MODE_COPY:
            state = _Browser(link, engine.browse(address))
            link.snd_settle_mode = Link.SND_SETTLED
        else:
            subscription: tuple[str, str] | None = None
            topic = address.startswith("topic://")
            # proton reads a source without an address as no source at all, durability
            # included: one found by its link's name is durable.
            # Qpid JMS marks a shared subscription with the source capability "shared" and
            # names its links "<subscription>|<n>" (link names are unique on a connection);
            # a durable one without it has one active consumer at a time.
            shared = topic and SHARED in _symbols(_capabilities(remote))
            name = link.name.split("|", 1)[0] if shared else link.name
            if by_name or (
                topic
                and remote.durability != Terminus.NONDURABLE
                and remote.expiry_policy == Terminus.EXPIRE_NEVER
            ):
                subscription = (address, name)
            auto = link.remote_snd_settle_mode == Link.SND_SETTLED
            consumer_id = engine.subscribe(
                connection_id,
                address,
                ack_mode=AckMode.AUTO if auto else AckMode.CLIENT_INDIVIDUAL,
                credit=0,
                subscription=None if subscription is None else subscription[1],
                exclusive=subscription is not None and not shared,
                shared_name=name if shared and subscription is None else None,
            )
            state = _Consumer(
                link, consumer_id, auto=auto, subscription=subscription, temp_queue=temp_queue
            )
            self._consumers[consumer_id] = state
            self.core.add_target(consumer_id, self)
            if self._paused:
                engine.pause_connection(connection_id)
            link.snd_settle_mode = Link.SND_SETTLED if auto else Link.SND_UNSETTLED
        link.source.copy(remote)
        if temp_queue is not None:
            link.source.address = address
        if by_name:
            link.source.type = Terminus.SOURCE
            link.source.address = address
            link.source.durability = Terminus.DELIVERIES
            link.source.expiry_policy = Terminus.EXPIRE_NEVER
        link.target.copy(link.remote_target)
        self._links[link] = state
        link.open()

    def _durable_subscription_of(self, link: Link) -> str:
        """A receiver with no source address attaches to the durable subscription its name
        names (Qpid JMS does so to unsubscribe: it then closes the link): its topic."""
        topic = self.core.engine.subscription_topic(link.name)
        if topic is None:
            raise UnknownAddressError(
                f"a receiver link needs a source address, a dynamic source or the name of a "
                f"durable subscription; there is no durable subscription {link.name!r}"
            )
        return topic

    def _on_link_close(self, event: Event) -> None:
        self._end_link(_link_of(event), closed=True)

    def _on_link_detach(self, event: Event) -> None:
        self._end_link(_link_of(event), closed=False)

    def _end_link(self, link: Link, *, closed: bool, session_ended: bool = False) -> None:
        """The client closed or detached a link, or ended its session: undo its effects.

        A durable subscription is deleted only by a close (a detach keeps it); a dynamic
        temporary queue goes with its link however the link ends.
        """
        state = self._links.pop(link, None)
        engine = self.core.engine
        if isinstance(state, _Consumer):
            self._consumers.pop(state.consumer_id, None)
            self._draining.discard(state.consumer_id)
            self.core.remove_target(state.consumer_id)
            with contextlib.suppress(NotFoundError):
                engine.close_consumer(state.consumer_id)
            if state.subscription is not None and closed and not session_ended:
                with contextlib.suppress(BrokerError):
                    engine.delete_subscription(*state.subscription)
        elif isinstance(state, _Coordinator):
            # Nobody could discharge its transactions any more: roll them back.
            for txn_id in state.declared:
                tx = self._transactions.pop(txn_id, None)
                if tx is not None:
                    with contextlib.suppress(NotFoundError):
                        engine.rollback(tx)
        temp_queue = getattr(state, "temp_queue", None)
        if temp_queue is not None:
            with contextlib.suppress(NotFoundError):
                for consumer_id in engine.delete_queue(temp_queue):
                    self._close_consumer_link(consumer_id, "its temporary queue was deleted")
        if link.state & Endpoint.LOCAL_ACTIVE and not session_ended:
            if closed:
                link.close()
            else:
                link.detach()

    def _close_consumer_link(self, consumer_id: int, why: str) -> None:
        consumer = self._consumers.pop(consumer_id, None)
        if consumer is None:
            return
        self.core.remove_target(consumer_id)
        self._links.pop(consumer.link, None)
        consumer.link.condition = Condition("amqp:resource-deleted", why)
        consumer.link.close()

    def _on_link_flow(self, event: Event) -> None:
        link = _link_of(event)
        state = self._links.get(link)
        if isinstance(state, _Consumer):
            # Proton's credit goes negative when a flow crossed deliveries in flight: the
            # client granted less than was already sent. The engine's credit is never negative.
            self.core.engine.set_credit(state.consumer_id, max(link.credit, 0))
            if link.drain_mode:
                # Drain after the engine dispatched what it can: at the end of this turn.
                self._draining.add(state.consumer_id)
                if not self._drain_scheduled:
                    self._drain_scheduled = True
                    self.core.kick()
                    asyncio.get_running_loop().call_soon(self._finish_drains)
        elif isinstance(state, _Browser):
            self._browse(state)

    def _finish_drains(self) -> None:
        self._drain_scheduled = False
        if self._closed:
            return
        for consumer_id in self._draining:
            consumer = self._consumers.get(consumer_id)
            if consumer is not None and consumer.link.credit > 0:
                self.core.engine.drain(consumer_id)
                consumer.link.drained()
        self._draining.clear()
        self._process()

    # --- transfers from producers ----------------------------------------------------------

    def _on_delivery(self, event: Event) -> None:
        delivery = _delivery_of(event)
        link = delivery.link
        state = self._links.get(link)
        if isinstance(state, _Consumer):
            if delivery.updated:
                self._on_disposition(state, delivery)
        elif isinstance(state, _Producer | _Coordinator):
            payload = self._read_transfer(link, delivery)
            if payload is None:
                return
            if isinstance(state, _Producer):
                self._on_transfer(state, delivery, payload)
            else:
                self._on_control(state, delivery, payload)
        elif isinstance(state, _Browser):
            if delivery.updated and not delivery.settled:
                delivery.settle()
        elif link.is_receiver and delivery.readable and not delivery.partial:
            # A transfer on a link already ended: drop it.
            link.recv(delivery.pending)
            link.advance()
            delivery.settle()

    def _read_transfer(self, link: Link, delivery: Delivery) -> bytes | None:
        """The whole payload of a transfer once it has arrived; None until then."""
        if delivery.aborted:
            delivery.settle()
            link.advance()
            return None
        if not delivery.readable:
            return None
        limit = self.core.config.max_body_size + _MESSAGE_OVERHEAD
        if delivery.pending > limit:
            link.condition = Condition(
                "amqp:link:message-size-exceeded", f"messages are limited to {limit} bytes"
            )
            self._end_link(link, closed=True)
            return None
        if delivery.partial:
            return None
        payload = link.recv(delivery.pending) or b""
        link.advance()
        return payload

    def _on_transfer(self, producer: _Producer, delivery: Delivery, payload: bytes) -> None:
        link = producer.link
        pre_settled = delivery.settled
        tx: int | None = None
        txn_id: bytes | None = None
        try:
            if delivery.remote_state == _TRANSACTIONAL_STATE:
                txn_id, tx = self._transaction_of(delivery.remote.data)
            incoming = decode_incoming(
                payload,
                time.time(),
                message_id_duplicates=self.core.config.amqp_message_id_duplicates,
            )
            address = producer.address
            if address is None:
                if incoming.to is None:
                    raise InvalidRequestError("a message on an anonymous link needs a 'to' address")
                address = amqp_address(incoming.to)
            self.core.engine.send(
                address,
                incoming.body,
                headers=incoming.headers,
                persistent=incoming.persistent,
                priority=incoming.priority,
                expiration=incoming.expiration,
                duplicate_id=incoming.duplicate_id,
                tx=tx,
            )
        except BrokerError as exc:
            if pre_settled:
                # Nothing to reject: the client gave up on the outcome; end the link instead.
                link.condition = condition_for(exc)
                self._end_link(link, closed=True)
                delivery.settle()
                return
            delivery.local.condition = condition_for(exc)
            delivery.update(Delivery.REJECTED)
            delivery.settle()
            self._top_up(producer)
            return
        if pre_settled:
            delivery.settle()
        elif txn_id is not None:
            # proton annotates Disposition.data as a list of int; it is any AMQP list.
            delivery.local.data = [txn_id, Described(_ACCEPTED_OUTCOME, [])]  # type: ignore[list-item]
            delivery.update(_TRANSACTIONAL_STATE)
            delivery.settle()
        elif incoming.persistent:
            producer.inflight += 1
            self._unconfirmed.append((delivery, producer))
        else:
            delivery.update(Delivery.ACCEPTED)
            delivery.settle()
        self._top_up(producer)

    def _top_up(self, producer: _Producer) -> None:
        link = producer.link
        if link not in self._links:
            return
        if link.credit + producer.inflight <= PRODUCER_CREDIT // 2:
            link.flow(PRODUCER_CREDIT - link.credit - producer.inflight)

    def _request_confirmation(self) -> None:
        """Ask for one durability future covering every transfer received so far."""
        if not self._unconfirmed:
            return
        batch, self._unconfirmed = self._unconfirmed, []
        self.core.durable().add_done_callback(partial(self._confirmed, batch))

    def _confirmed(self, batch: list[_Unconfirmed], future: asyncio.Future[None]) -> None:
        if self._closed:
            return
        error = future.exception() if not future.cancelled() else RuntimeError("cancelled")
        if error is not None:
            # Never accept what is not durable: the client must treat these as in doubt.
            log.warning("amqp client %s: not confirmed: %s", self.peer, error)
            self._fail("amqp:connection:forced", f"not confirmed: {error}")
            return
        for delivery, producer in batch:
            if producer is not None:
                producer.inflight -= 1
                if producer.link not in self._links:
                    continue
            delivery.update(Delivery.ACCEPTED)
            delivery.settle()
            if producer is not None:
                self._top_up(producer)
        self._process()

    # --- transactions ----------------------------------------------------------------------

    def _transaction_of(self, state_data: object) -> tuple[bytes, int]:
        """The (txn-id, engine transaction) a transactional-state names on this connection."""
        txn_id = None
        if isinstance(state_data, list) and state_data:
            txn_id = _txn_id_bytes(state_data[0])
        tx = None if txn_id is None else self._transactions.get(txn_id)
        if txn_id is None or tx is None:
            raise _unknown_transaction(txn_id)
        return txn_id, tx

    def _on_control(self, coordinator: _Coordinator, delivery: Delivery, payload: bytes) -> None:
        engine = self.core.engine
        link = coordinator.link
        try:
            message = Message()
            try:
                message.decode(payload)
            except ProtonException as exc:
                raise InvalidRequestError(f"not a transaction control message: {exc}") from None
            body = message.body
            if not isinstance(body, Described) or not isinstance(body.value, list):
                raise InvalidRequestError("expected a declare or discharge performative")
            fields = body.value
            if body.descriptor in _DECLARE:
                if fields and fields[0] is not None:
                    raise NotImplementedByBrokerError("distributed transactions are not supported")
                tx = engine.begin(self._require_engine_connection())
                txn_id = str(tx).encode()
                self._transactions[txn_id] = tx
                coordinator.declared.add(txn_id)
                delivery.local.data = [txn_id]  # type: ignore[list-item] # see _on_transfer
                delivery.update(_DECLARED)
                delivery.settle()
            elif body.descriptor in _DISCHARGE:
                discharged_id = _txn_id_bytes(fields[0]) if fields else None
                if discharged_id is None or discharged_id not in self._transactions:
                    raise _unknown_transaction(discharged_id)
                discharged = self._transactions.pop(discharged_id)
                coordinator.declared.discard(discharged_id)
                if len(fields) > 1 and fields[1]:
                    engine.rollback(discharged)
                    delivery.update(Delivery.ACCEPTED)
                    delivery.settle()
                else:
                    engine.commit(discharged)
                    # Accepted only once the commit is durable: that is its confirmation.
                    self._unconfirmed.append((delivery, None))
            else:
                raise InvalidRequestError(f"unknown transaction performative {body.descriptor!r}")
        except BrokerError as exc:
            delivery.local.condition = condition_for(exc)
            delivery.update(Delivery.REJECTED)
            delivery.settle()
        if link.credit < PRODUCER_CREDIT // 2:
            link.flow(PRODUCER_CREDIT - link.credit)

    # --- deliveries to consumers -----------------------------------------------------------

    def deliver(self, delivery: EngineDelivery) -> None:
        """Called by the core for each delivery to one of this connection's consumers."""
        consumer = self._consumers.get(delivery.consumer_id)
        if consumer is None or self._closed:
            return
        link = consumer.link
        payload = encode_delivery(
            delivery.message,
            delivery_count=delivery.delivery_count,
            redelivered=delivery.redelivered,
            node_id=self.core.config.node_id,
            now=time.time(),
        )
        sent = link.delivery(str(delivery.tag))
        link.send(payload)
        link.advance()
        if consumer.auto:
            sent.settle()
        self._output_soon()

    def _browse(self, browser: _Browser) -> None:
        link = browser.link
        node_id, now = self.core.config.node_id, time.time()
        while link.credit > 0 and browser.messages:
            message = browser.messages.popleft()
            browser.sent += 1
            sent = link.delivery(f"b{browser.sent}")
            link.send(
                encode_delivery(
                    message, delivery_count=0, redelivered=False, node_id=node_id, now=now
                )
            )
            link.advance()
            sent.settle()
        if link.drain_mode and link.credit > 0:
            link.drained()

    def _on_disposition(self, consumer: _Consumer, delivery: Delivery) -> None:
        state = delivery.remote_state
        tx: int | None = None
        outcome: Outcome | None
        if state == _TRANSACTIONAL_STATE:
            data = delivery.remote.data
            try:
                _, tx = self._transaction_of(data)
            except BrokerError as exc:
                self._detach_with(consumer.link, exc)
                return
            described = data[1] if isinstance(data, list) and len(data) > 1 else None
            outcome = _described_outcome(described)
            if outcome is None:
                return  # no outcome yet: a transactional "received" state
        elif state == Delivery.ACCEPTED:
            outcome = Outcome.ACCEPTED
        elif state == Delivery.RELEASED:
            outcome = Outcome.RELEASED
        elif state == Delivery.REJECTED:
            outcome = Outcome.REJECTED
        elif state == Delivery.MODIFIED:
            outcome = Outcome.FAILED if delivery.remote.failed else Outcome.RELEASED
        elif delivery.settled:
            outcome = Outcome.ACCEPTED  # settled without a state: the client is done with it
        else:
            return  # a non-terminal state (received): nothing to do yet
        try:
            tag = int(delivery.tag)
            self.core.engine.settle(consumer.consumer_id, tag, outcome, tx=tx)
        except UnknownDeliveryError:
            pass  # settled already (or an AUTO consumer's): nothing left to do
        except ValueError:
            log.info("amqp client %s settled an unknown delivery tag", self.peer)
        except BrokerError as exc:
            self._detach_with(consumer.link, exc)
            return
        # Settle once the outcome is durable (replicated): a client that waits for the
        # settlement knows its acknowledge survives a failover.
        future = self.core.durable() if tx is None else None
        if future is None:
            delivery.settle()
            return
        future.add_done_callback(lambda done: self._settle_durable(delivery, done))

    def _settle_durable(self, delivery: Delivery, done: asyncio.Future[None]) -> None:
        if done.cancelled() or done.exception() is not None:
            return  # not durable: leave it unsettled; the connection ends with the node
        delivery.settle()
        self._output_soon()

    def _detach_with(self, link: Link, error: BrokerError) -> None:
        link.condition = condition_for(error)
        self._end_link(link, closed=True)

    # --- endings ---------------------------------------------------------------------------

    def _require_engine_connection(self) -> int:
        if self._engine_connection is None:
            raise InvalidRequestError("the connection is not open")
        return self._engine_connection

    def _end_engine_connection(self) -> None:
        """The AMQP connection ended: its consumers, transactions and temporary queues too."""
        connection_id = self._engine_connection
        if connection_id is None:
            return
        self._engine_connection = None
        for consumer_id in self._consumers:
            self.core.remove_target(consumer_id)
        self._consumers.clear()
        self._transactions.clear()
        with contextlib.suppress(BrokerError):
            self.core.engine.disconnect(connection_id)
        self.core.kick()

    def _fail(self, name: str, text: str) -> None:
        """Close the whole connection with an error condition."""
        connection = self._connection
        if connection is None or self._closed:
            self._close_socket()
            return
        log.info("amqp client %s: closing the connection: %s: %s", self.peer, name, text)
        self._failed = True
        self._end_engine_connection()
        if not connection.state & Endpoint.LOCAL_CLOSED:
            connection.condition = Condition(name, text)
            if connection.state & Endpoint.LOCAL_UNINIT:
                connection.open()
            connection.close()
        self._arm_abort()
        self._output_soon()

    def _arm_abort(self) -> None:
        """A closing peer that never answers must not keep its socket."""
        if self._abort_timer is None and not self._closed:
            self._abort_timer = asyncio.get_running_loop().call_later(_CLOSE_GRACE, self._abort)

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        log.info("amqp client %s: no Open within %.0fs: closing", self.peer, self.handshake_timeout)
        if self._connection is not None:
            self._fail("amqp:connection:forced", "no Open within the handshake timeout")
        else:
            self._close_socket()

    def _write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _close_socket(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    _HANDLERS: Final[dict[object, Callable[[AmqpConnection, Event], None]]] = {
        Event.CONNECTION_REMOTE_OPEN: _on_connection_open,
        Event.CONNECTION_REMOTE_CLOSE: _on_connection_close,
        Event.SESSION_REMOTE_OPEN: _on_session_open,
        Event.SESSION_REMOTE_CLOSE: _on_session_close,
        Event.LINK_REMOTE_OPEN: _on_link_open,
        Event.LINK_REMOTE_CLOSE: _on_link_close,
        Event.LINK_REMOTE_DETACH: _on_link_detach,
        Event.LINK_FLOW: _on_link_flow,
        Event.DELIVERY: _on_delivery,
        Event.TRANSPORT_ERROR: _on_transport_error,
    }


# proton types an event's objects as optional; an event of each kind always carries its own.
def _connection_of(event: Event) -> Connection:
    connection = event.connection
    assert connection is not None
    return connection


def _session_of(event: Event) -> Session:
    session = event.session
    assert session is not None
    return session


def _link_of(event: Event) -> Link:
    link = event.link
    assert link is not None
    return link


def _delivery_of(event: Event) -> Delivery:
    delivery = event.delivery
    assert delivery is not None
    return delivery


def _capabilities(terminus: Terminus) -> object:
    return _terminus_object(terminus.capabilities)


def _refuse_selectors(source: Terminus) -> None:
    filters = _terminus_object(source.filter)
    if isinstance(filters, dict) and filters:
        raise NotImplementedByBrokerError(
            f"source filters ({', '.join(str(k) for k in filters)}) are not supported: "
            "this broker has no message selectors"
        )


def _described_outcome(value: object) -> Outcome | None:
    """The outcome inside a transactional-state (accepted, rejected, released, modified)."""
    if not isinstance(value, Described):
        return None
    descriptor = value.descriptor
    code = int(descriptor) if isinstance(descriptor, int) else None
    if code is None:
        names = {
            "amqp:accepted:list": 0x24,
            "amqp:rejected:list": 0x25,
            "amqp:released:list": 0x26,
            "amqp:modified:list": _MODIFIED,
        }
        code = names.get(str(descriptor))
    if code == _MODIFIED:
        fields = value.value if isinstance(value.value, list) else []
        return Outcome.FAILED if fields and fields[0] else Outcome.RELEASED
    return None if code is None else _OUTCOMES.get(code)


def _unknown_transaction(txn_id: bytes | None) -> BrokerError:
    return UnknownTransactionError(
        f"transaction {txn_id!r} was not declared on this connection"
        if txn_id is not None
        else "a transactional state needs a txn-id"
    )


async def serve_amqp(core: BrokerCore, host: str, port: int) -> asyncio.Server:
    """Listen for AMQP clients (used by tests; the node creates its own listener)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: AmqpConnection(core), host, port, reuse_address=True)
