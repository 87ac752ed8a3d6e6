"""The STOMP server (1.0, 1.1, 1.2): frames from the codec, operations on the engine, frames back.

One ``StompConnection`` per TCP connection (an asyncio protocol); the session state it
serves lives in a ``StompSession``, so that a session can outlive its connection and be
taken over by a new one (the reattach extension, docs/protocol-reattach.md).

Rules this module enforces:
- CONNECT (or STOMP) first; the version is the highest of 1.0, 1.1 and 1.2 the client
  accepts (no accept-version header means 1.0); login and passcode checked against the
  users file; anything else gets an ERROR frame naming the problem, and the connection is
  closed after it, as the spec requires.
- What differs by version: header escaping (none on 1.0, no CR on 1.1); heart-beating
  (1.1 and 1.2); what an ACK or NACK names (1.2: the MESSAGE's ``ack`` header as ``id``;
  1.1: ``message-id`` and ``subscription``; 1.0: ``message-id``, and there is no NACK). The
  hafailover extensions (reattach and the confirmation window) are for 1.2 clients only.
  1.0 as its specification has it: a SUBSCRIBE without ``id`` is named by its destination,
  an UNSUBSCRIBE may name the subscription by ``destination`` alone, and a body on a frame
  other than SEND is accepted and ignored (the codec's rule).
- A receipt for a SEND of a persistent message, an ACK, NACK, COMMIT or DISCONNECT is sent
  only when what it confirms is durable (the live's journal and the backup). Receipts go out
  in the order their frames came in, and any receipt also waits for the durable work of the
  frames before it that asked for none: one receipt confirms every frame before it.
- Heart-beats both ways: the server sends EOLs at the negotiated period and closes a
  connection that stays silent for twice the period it asked for.
- Destinations: ``/queue/x``, ``/topic/x``, ``/temp-queue/x`` and the ``queue://x`` forms.
  Temporary queues get broker-wide names unique to the session; they live as long as the
  session, a reattach included (a reconnect is a new session with new queues).
- Duplicate detection: a SEND carrying ``_AMQ_DUPL_ID`` that the address has seen is
  dropped and still acknowledged with its receipt (DESIGN F13). As on Artemis, the header
  stays with the message and is delivered with it: it is the one id of the message that
  is the same on every node (``message-id`` is the node's).
- A full address (engine.AddressLimit): policy FAIL answers the SEND with an ERROR frame
  that names the address and its limit, carries the SEND's receipt-id and
  ``hafailover-code: ADDRESS_FULL``, and keeps the connection (as Artemis does; STOMP 1.2
  would close it); policy BLOCK holds that SEND and every frame after it, and stops reading
  the socket, until the address has room. A SEND without a receipt header is held under
  FAIL too: a refusal could name no frame, and a later receipt would confirm it unstored.
- Flow control: a client-acknowledge subscription holds at most its prefetch (1000 unless
  it asks otherwise), and a slow reader pauses its consumers while the socket's buffer is
  full. An ``ack:auto`` subscription is settled as it is dispatched, so what one dispatch
  turn handed it (at most ``EngineConfig.dispatch_per_poll``) is lost if it then
  disconnects, as ``ack:auto`` allows.
- JMS subscriptions on a topic: ``durable-subscription-name`` (or
  ``activemq.subscriptionName``) names a durable subscription, ``shared-subscription-name``
  a shared one that is not durable, and ``hafailover-exclusive: true`` makes the consumer
  the only active one of its subscription (another is refused while it is there). An
  UNSUBSCRIBE naming ``durable-subscription-name`` and no subscription of the connection
  deletes that durable subscription. A NACK with ``requeue: false`` (RabbitMQ's header)
  rejects the message to the dead-letter queue.

It never touches the journal or the replication link: durability is the core's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final

from hafailover.protocols.stomp.frame import (
    VERSIONS,
    Frame,
    FrameParser,
    Heartbeat,
    ParserLimits,
    Side,
    StompProtocolError,
    encode,
    encode_header,
    encode_message,
    format_heart_beat,
    negotiate_heart_beat,
    negotiate_version,
    parse_heart_beat,
)
from reference_broker.core import BrokerCore
from reference_broker.engine import AckMode, AddressFullError, Delivery, Outcome
from reference_broker.message import BrokerError, InvalidRequestError

__all__ = ["StompConnection", "StompSession", "serve_stomp", "stomp_destination"]

log = logging.getLogger(__name__)

SERVER_NAME: Final = "hafailover-reference-broker/0.1"
DUPLICATE_ID_HEADER: Final = "_AMQ_DUPL_ID"
# Reattach extension headers (docs/protocol-reattach.md).
H_SESSION: Final = "hafailover-session"
H_REATTACH: Final = "hafailover-reattach"
H_WINDOW: Final = "hafailover-window"
H_TTL: Final = "hafailover-ttl"
H_LAST_RECEIVED: Final = "hafailover-last-received"
H_TOPOLOGY: Final = "hafailover-topology"
CONFIRM_PREFIX: Final = "hafailover-confirm:"
# On an ERROR frame: the broker error's code (reference_broker.message.BrokerError.code).
CODE_HEADER: Final = "hafailover-code"

# Headers the broker interprets on SEND; everything else travels with the message.
_SEND_CONTROL: Final = frozenset(
    {
        "destination",
        "content-length",
        "receipt",
        "transaction",
        "persistent",
        "priority",
        "expires",
    }
)
_ACK_MODES: Final = {
    "auto": AckMode.AUTO,
    "client": AckMode.CLIENT,
    "client-individual": AckMode.CLIENT_INDIVIDUAL,
}
_WRITE_HIGH_WATER: Final = 4 * 1024 * 1024
# What a client may pipeline after CONNECT while its password is checked: frames and bytes.
_MAX_EARLY_FRAMES: Final = 1000
_MAX_EARLY_BYTES: Final = 1024 * 1024


def stomp_destination(destination: str, session: StompSession) -> str:
    """Map a STOMP destination to the engine's canonical address."""
    for prefix, canonical in (("/queue/", "queue://"), ("/topic/", "topic://")):
        if destination.startswith(prefix) and len(destination) > len(prefix):
            return canonical + destination[len(prefix) :]
    if destination.startswith("/temp-queue/") and len(destination) > len("/temp-queue/"):
        return session.temp_queue(destination[len("/temp-queue/") :])
    if destination.startswith(("queue://", "topic://", "temp-queue://")):
        return destination
    raise InvalidRequestError(
        f"unknown destination {destination!r}: use /queue/NAME, /topic/NAME, "
        "/temp-queue/NAME, queue://NAME or topic://NAME"
    )


# Reattachable sessions attached to a connection, by (core, session id): a reattach may
# take one over from a connection that is dead but not yet seen to be.
_ATTACHED: weakref.WeakValueDictionary[tuple[int, str], StompSession] = (
    weakref.WeakValueDictionary()
)


def _reply_destination(address: str) -> str:
    for canonical, prefix in (("queue://", "/queue/"), ("topic://", "/topic/")):
        if address.startswith(canonical):
            return prefix + address[len(canonical) :]
    return address


class StompSession:
    """A STOMP session's state on the broker, independent of the socket that carries it."""

    def __init__(self, core: BrokerCore, session_id: str, user: str | None) -> None:
        self.core = core
        self.session_id = session_id
        self.user = user
        self.connection_id = core.engine.connect()
        self.subscriptions: dict[str, int] = {}  # subscription id -> consumer id
        self.consumer_subscription: dict[int, str] = {}
        self.destinations: dict[int, str] = {}  # consumer id -> reply destination
        self.unacked: dict[tuple[int, int], Delivery] = {}  # client-ack deliveries in flight
        self.temp_names: dict[str, str] = {}
        # Reattach: client frames counted from 0; confirmations every half window of bytes.
        self.window = -1
        self.ttl = 0.0
        self.received = -1
        self.bytes_since_confirm = 0
        self.connection: StompConnection | None = None

    @property
    def reattachable(self) -> bool:
        return self.window > 0 and self.ttl > 0

    def temp_queue(self, name: str) -> str:
        address = self.temp_names.get(name)
        if address is None:
            address = f"temp-queue://{self.session_id}-{name}"
            self.temp_names[name] = address
        self.core.engine.create_temp_queue(self.connection_id, address)
        return address

    def expire(self) -> None:
        """The held session's TTL passed: end it in the engine."""
        self.end()

    def end(self) -> None:
        core = self.core
        for consumer_id in self.consumer_subscription:
            core.remove_target(consumer_id)
        with contextlib.suppress(BrokerError):  # already gone
            core.engine.disconnect(self.connection_id)
        self.subscriptions.clear()
        self.consumer_subscription.clear()
        self.unacked.clear()
        core.kick()


class StompConnection(asyncio.Protocol):
    """One client's TCP connection speaking STOMP 1.2."""

    def __init__(
        self,
        core: BrokerCore,
        limits: ParserLimits | None = None,
        *,
        on_lost: Callable[[StompConnection], None] | None = None,
    ) -> None:
        self.core = core
        self._on_lost = on_lost
        self.parser = FrameParser(
            Side.SERVER, limits or ParserLimits(max_body_size=core.config.max_body_size)
        )
        self.version = "1.2"  # until CONNECT says otherwise
        self.transport: asyncio.Transport | None = None
        self.session: StompSession | None = None
        self.peer = "?"
        self._receipts: deque[tuple[asyncio.Future[None] | None, bytes]] = deque()
        # Durable work done since the last receipt that waited for durability: the next
        # receipt confirms it too (one receipt confirms every frame before it).
        self._owed_durable = False
        self._closing = False
        self._explicit_disconnect = False
        self._last_received = time.monotonic()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._connect_timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._login: asyncio.Task[None] | None = None  # the CONNECT's password check
        self._early: deque[Frame] | None = None  # frames that came during it
        self._early_bytes = 0
        self._held: deque[Frame] | None = None  # frames behind a SEND held for a full address
        self._room: asyncio.Future[None] | None = None  # what the held SEND waits for

    # --- asyncio callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        refused = self.core.accept(self)
        if refused is not None:
            # Said and closed at once, before any frame is read: a flood of sockets costs
            # the node one write each, and no log line each (the core logs the cap once).
            self._closing = True
            self._write(encode(Frame("ERROR", (("message", refused),), refused.encode())))
            transport.close()
            return
        self._connect_timer = asyncio.get_running_loop().call_later(30, self._connect_timeout)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._last_received = time.monotonic()
        try:
            events = self.parser.feed(data)
        except StompProtocolError as exc:
            for event in exc.events:
                if self._closing:
                    return
                self._handle_event(event)
            self._error(exc.message)
            return
        for event in events:
            if self._closing:
                return
            self._handle_event(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.core.release(self)
        if self._on_lost is not None:
            self._on_lost(self)
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self._connect_timer is not None:
            self._connect_timer.cancel()
        if self._login is not None:
            self._login.cancel()
        if self._room is not None:
            self._room.cancel()
        session = self.session
        if session is None or session.connection is not self:
            return
        session.connection = None
        if session.reattachable and not self._explicit_disconnect:
            # F4: keep the session for a reattach within its TTL; its consumers pause.
            self.core.engine.pause_connection(session.connection_id)
            self.core.hold_session(session.session_id, session, session.ttl)
            log.info("stomp session %s held %.1fs for reattach", session.session_id, session.ttl)
        else:
            session.end()

    def pause_writing(self) -> None:
        self._paused = True
        if self.session is not None:
            self.core.engine.pause_connection(self.session.connection_id)

    def resume_writing(self) -> None:
        self._paused = False
        if self.session is not None and not self._closing:
            self.core.engine.resume_connection(self.session.connection_id)
            self.core.kick()

    # --- frames ----------------------------------------------------------------------------

    def _handle_event(self, event: Frame | Heartbeat) -> None:
        if isinstance(event, Heartbeat):
            return
        frame = event
        command = frame.command
        session = self.session
        if self._held is not None:
            self._held.append(frame)  # behind a SEND held for a full address, in order
            return
        if self._early is not None:
            self._early_bytes += len(frame.body) + sum(len(n) + len(v) for n, v in frame.headers)
            if len(self._early) >= _MAX_EARLY_FRAMES or self._early_bytes > _MAX_EARLY_BYTES:
                self._error(
                    f"more than {_MAX_EARLY_FRAMES} frames or {_MAX_EARLY_BYTES} bytes sent "
                    "before CONNECTED"
                )
                return
            self._early.append(frame)
            return
        if session is None:
            if self._login is not None:
                return  # a refused login: the ERROR is on its way
            if command in ("CONNECT", "STOMP"):
                self._on_connect(frame)
            else:
                self._error(f"expected CONNECT or STOMP as the first frame, got {command}")
            return
        if command in ("CONNECT", "STOMP"):
            self._error("already connected: CONNECT may only be sent once")
            return
        if not self.core.may_serve():
            # Fenced (a pause outlived the lease): accept nothing, not even a non-persistent
            # send, so that two nodes never accept at the same moment.
            self._error("this node is no longer active: reconnect to the live node")
            return
        session.received += 1
        # The frame's bytes as sent (command, header lines, body), give or take escapes:
        # clients size their window by the encoded frame, and a count much smaller than
        # theirs would leave their window full with no confirmation coming.
        size = len(command) + 2 + len(frame.body)
        for name, value in frame.headers:
            size += len(name) + len(value) + 2
        try:
            handler = self._HANDLERS[command]
            handler(self, frame, session)
        except AddressFullError as exc:
            # A SEND that asked for no receipt cannot be told it was refused: an ERROR without
            # a receipt-id names no frame, and the next receipt (cumulative for a client with
            # a confirmation window) would confirm it unstored. So it is held, as BLOCK holds.
            if exc.blocking or frame.get("receipt") is None:
                session.received -= 1  # not taken yet: handled again once there is room
                self._hold(frame, exc.address)
                return
            self._refuse(exc, receipt=frame.get("receipt"))
        except BrokerError as exc:
            # The engine's code (DISK_FULL, ...) lets a client tell the refusal apart.
            self._error(str(exc), receipt=frame.get("receipt"), extra=((CODE_HEADER, exc.code),))
            return
        except StompProtocolError as exc:
            self._error(exc.message, receipt=frame.get("receipt"))
            return
        if session.reattachable:
            session.bytes_since_confirm += size
            if session.bytes_since_confirm * 2 >= session.window:
                session.bytes_since_confirm = 0
                # It says what was received, not what is durable: it owes nothing.
                self._send_receipt(
                    f"{CONFIRM_PREFIX}{session.received}", durable=False, window=True
                )

    # --- a full address (reference_broker.engine.AddressLimit) ------------------------------

    def _refuse(self, error: AddressFullError, *, receipt: str | None) -> None:
        """Policy FAIL: an ERROR frame that names the address and its limit, in its place
        among the receipts; the connection stays (as Artemis's STOMP does for a send it
        refuses), so the client raises it from that send and goes on, with no failover."""
        text = str(error)
        headers = [("message", text), (CODE_HEADER, error.code), ("content-type", "text/plain")]
        if receipt is not None:
            headers.append(("receipt-id", receipt))
        log.debug("stomp client %s: %s", self.peer, text)
        data = encode(Frame("ERROR", tuple(headers), text.encode()), version=self.version)
        if self._receipts:
            self._receipts.append((None, data))
        else:
            self._write(data)

    def _hold(self, frame: Frame, address: str) -> None:
        """Policy BLOCK: the SEND waits, and every frame after it, until ``address`` has
        room; the socket is not read meanwhile, so the client's writes (and its receipts)
        wait too: back-pressure, as Artemis gives a producer no credit."""
        self._held = deque([frame])
        if self.transport is not None:
            self.transport.pause_reading()
        log.debug("stomp client %s: held until %s has room", self.peer, address)
        self._room = self.core.wait_for_room(address)
        self._room.add_done_callback(self._unhold)

    def _unhold(self, future: asyncio.Future[None]) -> None:
        self._room = None
        if self._closing or future.cancelled():
            return
        held, self._held = self._held, None
        for frame in held or ():
            if self._closing:
                return
            self._handle_event(frame)  # may hold again: the rest then waits behind it
        if self._held is None and self.transport is not None:
            self.transport.resume_reading()

    def _on_connect(self, frame: Frame) -> None:
        accepted = frame.get("accept-version")
        version = negotiate_version(accepted)
        if version is None:
            self._error(
                f"unsupported STOMP version(s) {accepted}: this broker speaks "
                f"{', '.join(VERSIONS)}",
                extra=(("version", ",".join(VERSIONS)),),
            )
            return
        self.version = self.parser.version = version
        # The password check runs off the event loop (reference_broker.users.LoginGuard):
        # frames that come meanwhile wait in _early and are handled once CONNECTED is sent.
        self._early = deque()
        self._login = asyncio.get_running_loop().create_task(self._log_in(frame, version))

    async def _log_in(self, frame: Frame, version: str) -> None:
        user, passcode = frame.get("login"), frame.get("passcode")
        ok = await self.core.authenticate(user, passcode, self.peer)
        if self._closing:
            return
        if not ok:
            self._error(f"authentication failed for user {user!r}")
            return
        self._connected(frame, version, user)
        early, self._early = self._early, None
        for event in early or ():
            if self._closing:
                return
            self._handle_event(event)

    def _connected(self, frame: Frame, version: str, user: str | None) -> None:
        if not self.core.may_serve():
            self._error("this node is not active: connect to the live node")
            return
        refused = self.core.admit(self, user)
        if refused is not None:
            self._error(refused)
            return
        try:
            # STOMP 1.0 has no heart-beating.
            client_hb = parse_heart_beat(
                frame.get("heart-beat", "0,0") if version != "1.0" else "0,0"
            )
        except StompProtocolError as exc:
            self._error(exc.message)
            return
        server_ms = int(self.core.config.heartbeat * 1000) if version != "1.0" else 0
        intervals = negotiate_heart_beat(client_hb, (server_ms, server_ms))
        if self._connect_timer is not None:
            self._connect_timer.cancel()

        headers: list[tuple[str, str]] = [("version", version)]
        if version != "1.0":
            headers.append(("heart-beat", format_heart_beat(server_ms, server_ms)))
        headers.append(("server", SERVER_NAME))
        session: StompSession | None = None
        reattached = False
        # The hafailover extensions are STOMP 1.2's only (docs/protocol-reattach.md).
        extended = version == "1.2"
        wanted = frame.get(H_REATTACH) if extended else None
        if frame.get(H_REATTACH) and not extended:
            headers.append((H_REATTACH, "refused"))
        if wanted:
            held = self.core.claim_session(wanted) or self._take_over(wanted, user)
            if isinstance(held, StompSession) and held.user == user:
                session = held
                reattached = True
                headers.append((H_LAST_RECEIVED, str(session.received)))
                log.info("stomp session %s reattached from %s", wanted, self.peer)
            else:
                headers.append((H_REATTACH, "refused"))
                if held is not None:  # pragma: no cover - another user's session id
                    held.expire()
        if session is None:
            session = StompSession(self.core, self.core.new_session_id(), user)
            try:
                session.window = int(frame.get(H_WINDOW, "-1")) if extended else -1
                ttl_ms = int(frame.get(H_TTL, "0"))
            except ValueError:
                self._error(f"{H_WINDOW} and {H_TTL} must be whole numbers")
                return
            session.ttl = min(ttl_ms / 1000.0, self.core.config.max_connection_ttl)
        headers.append(("session", session.session_id))
        headers.append((H_SESSION, session.session_id))
        topology = self.core.config.topology.get("stomp")
        if topology:
            headers.append((H_TOPOLOGY, ",".join(topology)))
        self.session = session
        session.connection = self
        if session.reattachable:
            _ATTACHED[(id(self.core), session.session_id)] = session
        self._write(encode(Frame("CONNECTED", tuple(headers))))
        if intervals.server_to_client or intervals.client_to_server:
            self._heartbeat_task = asyncio.get_running_loop().create_task(
                self._heartbeat(
                    intervals.server_to_client / 1000, intervals.client_to_server / 1000
                )
            )
        if reattached:
            self._resume(session)

    def _take_over(self, session_id: str, user: str | None) -> StompSession | None:
        """A reattach can arrive before this node has seen its old connection drop (the
        client noticed first): the session is taken from the old connection, which is
        aborted, exactly as if it had dropped a moment earlier."""
        session = _ATTACHED.get((id(self.core), session_id))
        if session is None or session.user != user or session.connection is None:
            return None
        old = session.connection
        session.connection = None  # its connection_lost neither holds nor ends the session
        old._closing = True
        if old.transport is not None:
            old.transport.abort()
        log.info("stomp session %s taken over from %s", session_id, old.peer)
        return session

    def _resume(self, session: StompSession) -> None:
        """After a reattach: re-send deliveries the old socket may have lost, then go on."""
        for delivery in list(session.unacked.values()):
            self._write_delivery(session, delivery, redelivered=True)
        for consumer_id in session.consumer_subscription:
            self.core.add_target(consumer_id, self)
        self.core.engine.resume_connection(session.connection_id)
        self.core.kick()

    def _on_send(self, frame: Frame, session: StompSession) -> None:
        destination = frame.get("destination")
        if not destination:
            raise InvalidRequestError("SEND needs a destination header")
        address = stomp_destination(destination, session)
        headers = {k: v for k, v in frame.header_map.items() if k not in _SEND_CONTROL}
        reply_to = headers.get("reply-to")
        if reply_to is not None and reply_to.startswith("/temp-queue/"):
            # A temporary queue's STOMP name is scoped to its session; the reply must
            # reach this session's queue from any other, so carry its broker-wide address.
            headers["reply-to"] = stomp_destination(reply_to, session)
        persistent = frame.get("persistent", "false").lower() == "true"
        priority = _int_header(frame, "priority", 4)
        expires = _int_header(frame, "expires", 0)
        tx = self._transaction(frame, session)
        self.core.engine.send(
            address,
            frame.body,
            headers=headers,
            persistent=persistent,
            priority=priority,
            expiration=expires / 1000.0 if expires else None,
            duplicate_id=frame.get(DUPLICATE_ID_HEADER),
            tx=tx,
        )
        self.core.kick()
        self._maybe_receipt(frame, durable=persistent and tx is None)

    def _on_subscribe(self, frame: Frame, session: StompSession) -> None:
        destination = frame.get("destination")
        sub_id = frame.get("id")
        if not sub_id and self.version == "1.0":
            sub_id = destination  # 1.0: id is optional; the destination names the subscription
        if not sub_id or not destination:
            needs = "a destination" if self.version == "1.0" else "id and destination"
            raise InvalidRequestError(f"SUBSCRIBE needs {needs} headers")
        if sub_id in session.subscriptions:
            raise InvalidRequestError(f"subscription id {sub_id!r} is already in use")
        if frame.get("selector"):
            raise InvalidRequestError("message selectors are not supported by this broker")
        if frame.get("browser") == "true":
            self._browse(sub_id, destination, session, frame)
            return
        ack_text = frame.get("ack", "auto")
        ack_mode = _ACK_MODES.get(ack_text)
        if ack_mode is None:
            raise InvalidRequestError(
                f"unknown ack mode {ack_text!r}: use auto, client or client-individual"
            )
        prefetch_text = frame.get("activemq.prefetchSize") or frame.get("prefetch-count")
        window: int | None = None
        if ack_mode is not AckMode.AUTO:
            window = self.core.config.default_prefetch
        if prefetch_text is not None:
            prefetch_header = (
                "prefetch-count" if frame.get("prefetch-count") else "activemq.prefetchSize"
            )
            window = _int_header(frame, prefetch_header, 0) or None
        durable_name = frame.get("durable-subscription-name") or frame.get(
            "activemq.subscriptionName"
        )
        address = stomp_destination(destination, session)
        consumer_id = self.core.engine.subscribe(
            session.connection_id,
            address,
            ack_mode=ack_mode,
            window=window,
            subscription=durable_name,
            # JMS subscriptions: a shared one that is not durable, and the only active
            # consumer of a durable one that is not shared.
            shared_name=frame.get("shared-subscription-name") or None,
            exclusive=frame.get("hafailover-exclusive") == "true",
        )
        session.subscriptions[sub_id] = consumer_id
        session.consumer_subscription[consumer_id] = sub_id
        session.destinations[consumer_id] = destination
        self.core.add_target(consumer_id, self)
        self.core.kick()
        self._maybe_receipt(frame, durable=True)

    def _browse(self, sub_id: str, destination: str, session: StompSession, frame: Frame) -> None:
        """A queue browser (ActiveMQ's ``browser:true``): a snapshot of the waiting messages,
        each a MESSAGE with no ack, then one MESSAGE with ``browser:end`` and no body. The
        subscription ends with the snapshot: nothing is consumed and nothing needs an ack."""
        address = stomp_destination(destination, session)
        if address.startswith("topic://"):
            raise InvalidRequestError(f"only queues can be browsed, not {destination}")
        self._maybe_receipt(frame, durable=False)
        for message in (
            self.core.engine.browse(address) if address in self.core.engine.queues() else []
        ):
            own = [
                ("subscription", sub_id),
                ("message-id", f"{self.core.config.node_id}:{message.id}"),
                ("destination", _reply_destination(message.address)),
                ("persistent", "true" if message.persistent else "false"),
                ("priority", str(message.priority)),
            ]
            self._write(
                encode_message(
                    message.body,
                    self._header_block(own),
                    self._header_block(message.headers.items()),
                )
            )
        end = self._header_block(
            (("subscription", sub_id), ("destination", destination), ("browser", "end"))
        )
        self._write(encode_message(b"", end, b""))

    def _on_unsubscribe(self, frame: Frame, session: StompSession) -> None:
        sub_id = frame.get("id")
        destination = frame.get("destination")
        if not sub_id and self.version == "1.0":
            # 1.0 names the subscription by id or by destination: the one subscribed without
            # an id (its destination is its id), else the only one on that destination.
            if not destination:
                raise InvalidRequestError("UNSUBSCRIBE needs an id or a destination header")
            sub_id = self._subscription_on(destination, session)
        elif not sub_id:
            raise InvalidRequestError(f"UNSUBSCRIBE needs an id header (STOMP {self.version})")
        if sub_id not in session.subscriptions and frame.get("durable-subscription-name"):
            self._remove_durable(frame, session)
            return
        consumer_id = session.subscriptions.pop(sub_id, None)
        if consumer_id is None:
            raise InvalidRequestError(f"no subscription with id {sub_id!r}")
        del session.consumer_subscription[consumer_id]
        session.destinations.pop(consumer_id, None)
        for key in [k for k in session.unacked if k[0] == consumer_id]:
            del session.unacked[key]
        self.core.remove_target(consumer_id)
        self.core.engine.close_consumer(consumer_id)
        self.core.kick()
        self._maybe_receipt(frame, durable=True)

    def _remove_durable(self, frame: Frame, session: StompSession) -> None:
        """An UNSUBSCRIBE that names a durable subscription and no subscription of this
        connection deletes that durable subscription (as Artemis does); one that does
        not exist is no error (JMS unsubscribe may repeat)."""
        name = frame.get("durable-subscription-name")
        engine = self.core.engine
        topic = engine.subscription_topic(name)
        if topic is not None:
            engine.delete_subscription(topic, name)
        self._maybe_receipt(frame, durable=True)

    @staticmethod
    def _subscription_on(destination: str, session: StompSession) -> str:
        """The id of the subscription a 1.0 UNSUBSCRIBE names by ``destination`` alone."""
        if destination in session.subscriptions:
            return destination
        ids = [
            session.consumer_subscription[consumer_id]
            for consumer_id, subscribed in session.destinations.items()
            if subscribed == destination and consumer_id in session.consumer_subscription
        ]
        if not ids:
            raise InvalidRequestError(f"no subscription to {destination!r}")
        if len(ids) > 1:
            raise InvalidRequestError(
                f"{len(ids)} subscriptions to {destination!r}: UNSUBSCRIBE by id instead"
            )
        return ids[0]

    def _on_ack(self, frame: Frame, session: StompSession, *, nack: bool = False) -> None:
        if nack and self.version == "1.0":
            raise InvalidRequestError("NACK is not a STOMP 1.0 frame (connect with 1.1 or 1.2)")
        consumer_id, tag = self._acknowledged(frame, session)
        tx = self._transaction(frame, session)
        engine = self.core.engine
        if nack and frame.get("requeue") == "false":
            # RabbitMQ's header: not back to the queue, to the dead-letter address.
            engine.settle(consumer_id, tag, Outcome.REJECTED, tx=tx)
        elif nack:
            engine.nack(consumer_id, tag, tx=tx)
        else:
            engine.ack(consumer_id, tag, tx=tx)
        # CLIENT mode settles everything up to the tag: forget those deliveries too.
        if engine.consumer_info(consumer_id).ack_mode is AckMode.CLIENT:
            for key in [k for k in session.unacked if k[0] == consumer_id and k[1] <= tag]:
                del session.unacked[key]
        else:
            session.unacked.pop((consumer_id, tag), None)
        self.core.kick()
        self._maybe_receipt(frame, durable=tx is None)

    def _on_nack(self, frame: Frame, session: StompSession) -> None:
        self._on_ack(frame, session, nack=True)

    def _acknowledged(self, frame: Frame, session: StompSession) -> tuple[int, int]:
        """The delivery an ACK or NACK names, as this connection's version names it."""
        command = frame.command
        if self.version == "1.2":
            ack_id = frame.get("id")
            if not ack_id:
                raise InvalidRequestError(f"{command} needs an id header")
            consumer_id, tag = _parse_ack_id(ack_id)
            if consumer_id not in session.consumer_subscription:
                raise InvalidRequestError(f"{command} of {ack_id!r}: no such subscription here")
            return consumer_id, tag
        message_id = frame.get("message-id")
        subscription = frame.get("subscription")
        if not message_id:
            raise InvalidRequestError(f"{command} needs a message-id header (STOMP {self.version})")
        if self.version == "1.1" and not subscription:
            raise InvalidRequestError(f"{command} needs a subscription header (STOMP 1.1)")
        node = self.core.config.node_id
        for (consumer_id, tag), delivery in session.unacked.items():
            if f"{node}:{delivery.message.id}" == message_id and (
                subscription is None
                or session.consumer_subscription.get(consumer_id) == subscription
            ):
                return consumer_id, tag
        raise InvalidRequestError(
            f"{command} of message-id {message_id!r}: no unacknowledged delivery of it here"
        )

    def _on_begin(self, frame: Frame, session: StompSession) -> None:
        name = frame.get("transaction")
        if not name:
            raise InvalidRequestError("BEGIN needs a transaction header")
        self.core.engine.begin(session.connection_id, name)
        self._maybe_receipt(frame, durable=False)

    def _on_commit(self, frame: Frame, session: StompSession) -> None:
        tx = self._named_transaction(frame, session)
        self.core.engine.commit(tx)
        self.core.kick()
        self._maybe_receipt(frame, durable=True)

    def _on_abort(self, frame: Frame, session: StompSession) -> None:
        tx = self._named_transaction(frame, session)
        self.core.engine.rollback(tx)
        self.core.kick()
        self._maybe_receipt(frame, durable=False)

    def _on_disconnect(self, frame: Frame, session: StompSession) -> None:
        self._explicit_disconnect = True
        receipt = frame.get("receipt")
        if receipt is not None:
            self._send_receipt(receipt, durable=True, then_close=True)
        else:
            self._close()

    _HANDLERS: Final = {
        "SEND": _on_send,
        "SUBSCRIBE": _on_subscribe,
        "UNSUBSCRIBE": _on_unsubscribe,
        "ACK": _on_ack,
        "NACK": _on_nack,
        "BEGIN": _on_begin,
        "COMMIT": _on_commit,
        "ABORT": _on_abort,
        "DISCONNECT": _on_disconnect,
    }

    # --- helpers ---------------------------------------------------------------------------

    def _transaction(self, frame: Frame, session: StompSession) -> int | None:
        name = frame.get("transaction")
        if name is None:
            return None
        return self.core.engine.transaction_id(session.connection_id, name)

    def _named_transaction(self, frame: Frame, session: StompSession) -> int:
        tx = self._transaction(frame, session)
        if tx is None:
            raise InvalidRequestError(f"{frame.command} needs a transaction header")
        return tx

    def _maybe_receipt(self, frame: Frame, *, durable: bool) -> None:
        """Answer ``frame``'s receipt header; ``durable``: what the frame did must be durable
        first. Without a receipt, that durability is owed to the next receipt."""
        receipt = frame.get("receipt")
        if receipt is not None:
            self._send_receipt(receipt, durable=durable)
        elif durable:
            self._owed_durable = True

    def _send_receipt(
        self, receipt_id: str, *, durable: bool, then_close: bool = False, window: bool = False
    ) -> None:
        data = encode(Frame("RECEIPT", (("receipt-id", receipt_id),)), version=self.version)
        if not window:
            durable = durable or self._owed_durable
            self._owed_durable = False
        future = self.core.durable() if durable else None
        if future is None and not self._receipts:
            self._write(data)
            if then_close:
                self._close()
            return
        self._receipts.append((future, data))
        if future is not None:
            future.add_done_callback(lambda _: self._flush_receipts(then_close))

    def _flush_receipts(self, then_close: bool = False) -> None:
        receipts = self._receipts
        while receipts:
            future, data = receipts[0]
            if future is not None:
                if not future.done():
                    return
                if future.exception() is not None:
                    self._error(f"not confirmed: {future.exception()}")
                    return
            receipts.popleft()
            self._write(data)
        if then_close:
            self._close()

    def deliver(self, delivery: Delivery) -> None:
        session = self.session
        if session is None or self._closing:
            return
        consumer_id = delivery.consumer_id
        if session.consumer_subscription.get(consumer_id) is None:
            return
        if self.core.engine.consumer_info(consumer_id).ack_mode is not AckMode.AUTO:
            session.unacked[(consumer_id, delivery.tag)] = delivery
        self._write_delivery(session, delivery, redelivered=delivery.redelivered)

    def _write_delivery(
        self, session: StompSession, delivery: Delivery, *, redelivered: bool
    ) -> None:
        message = delivery.message
        consumer_id = delivery.consumer_id
        own = [
            ("subscription", session.consumer_subscription[consumer_id]),
            ("message-id", f"{self.core.config.node_id}:{message.id}"),
            ("destination", _reply_destination(message.address)),
        ]
        if self.version == "1.2":
            own.append(("ack", f"{consumer_id}:{delivery.tag}"))
        own += [
            ("persistent", "true" if message.persistent else "false"),
            ("priority", str(message.priority)),
            ("redelivered", "true" if redelivered else "false"),
            ("hafailover-delivery-count", str(delivery.delivery_count)),
        ]
        if message.expiration is not None:
            own.append(("expires", str(int(message.expiration * 1000))))
        self._write(
            encode_message(
                message.body,
                self._header_block(own),
                self._header_block(message.headers.items()),
            )
        )

    def _header_block(self, headers: Iterable[tuple[str, str]]) -> bytes:
        """Header lines as this connection's version writes them. A sender's header that
        an older version cannot carry (a CR on 1.1, an EOL on 1.0) is left out."""
        version = self.version
        lines = []
        for name, value in headers:
            if name == "content-length":
                continue
            try:
                lines.append(encode_header(name, value, version))
            except ValueError:
                log.info("header %r cannot be written in STOMP %s: left out", name, version)
        return b"".join(lines)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _error(
        self,
        message: str,
        *,
        receipt: str | None = None,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Send an ERROR frame that names the problem, then close (STOMP 1.2)."""
        if self._closing:
            return
        # One line: a 1.0 client reads header values unescaped.
        text = message[:1000].replace("\r", " ").replace("\n", " ")
        headers = [("message", text), ("content-type", "text/plain"), *extra]
        if receipt is not None:
            headers.append(("receipt-id", receipt))
        log.info("stomp error to %s: %s", self.peer, message)
        self._write(encode(Frame("ERROR", tuple(headers), message.encode()), version=self.version))
        # An ERROR ends the session: it is not held for reattach.
        self._explicit_disconnect = True
        self._close()

    def _close(self) -> None:
        self._closing = True
        self.core.release(self)  # closing: it no longer holds a place under the caps
        if self.transport is not None:
            self.transport.close()

    def _connect_timeout(self) -> None:
        if self.session is None:
            self._error("no CONNECT frame within 30 seconds")

    async def _heartbeat(self, send_every: float, expect_every: float) -> None:
        period = min(p for p in (send_every, expect_every) if p > 0) / 2
        last_sent = time.monotonic()
        while not self._closing:
            await asyncio.sleep(period)
            now = time.monotonic()
            if send_every and now - last_sent >= send_every * 0.9:
                self._write(b"\n")
                last_sent = now
            if self._held is not None:
                self._last_received = now  # not read while held: its silence is ours
            if expect_every and now - self._last_received > expect_every * 2:
                log.info("stomp client %s silent past its heart-beat: closing", self.peer)
                self._close()
                return


def _int_header(frame: Frame, name: str, default: int) -> int:
    value = frame.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError(f"header {name} must be a whole number, not {value!r}") from None


def _parse_ack_id(ack_id: str) -> tuple[int, int]:
    consumer, _, tag = ack_id.partition(":")
    try:
        return int(consumer), int(tag)
    except ValueError:
        raise InvalidRequestError(f"unknown ack id {ack_id!r}") from None


async def serve_stomp(core: BrokerCore, host: str, port: int) -> asyncio.Server:
    """Listen for STOMP clients."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: StompConnection(core), host, port, reuse_address=True)
