"""One STOMP 1.2 connection to one broker, on stomp.py.

This adapter owns the translation between hafailover's values and stomp.py: it opens a
connection to a single broker (asking for the reattach and topology extensions,
docs/protocol-reattach.md, docs/protocol-topology.md), writes frames, turns the frames
stomp.py receives into events for the driver, and maps stomp.py's exceptions to ours in
one place (``_map_errors``). It never retries, reconnects or fails over: stomp.py's own
reconnection is switched off, and the driver decides what a lost connection means.

Events are called on stomp.py's receiver thread; the driver must not block in them.

Writes go through an ``Outbox`` (``protocols/outbox.py``): ``write`` encodes a frame and
queues it, ``flush`` writes the queue under the outbox's write lock, outside every other
lock. stomp.py's own writes (CONNECT, heart-beats, DISCONNECT) are routed into the same
outbox, so its heart-beat thread never waits behind a write a peer does not take (it goes
on checking the broker's heart-beats) and never splits a frame of ours. A write has no
timeout, unlike AMQP's: a STOMP broker may stop reading on purpose (ActiveMQ's producer flow
control), so a slow write is no loss by itself; the reader and the heart-beats say when the
connection is gone, and the driver's abort then shuts the socket, which ends a stuck write.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Protocol

import stomp
import stomp.exception

from hafailover.destination import Destination, DestinationKind, parse_destination
from hafailover.errors import (
    AddressFullError,
    BrokerResourceError,
    ErrorCode,
    NotConnectedError,
    ProtocolError,
    SecurityError,
)
from hafailover.message import Message, PropertyValue, plain_property, stamps_duplicate_id
from hafailover.protocols.base import Opened, TlsOptions, detects_duplicates, parse_topology
from hafailover.protocols.outbox import Chunk, Outbox
from hafailover.protocols.stomp.frame import encode_frame
from hafailover.url import BrokerAddress

log = logging.getLogger(__name__)

__all__ = [
    "STOMP_TEMPORARY_PREFIX",
    "Opened",
    "StompEvents",
    "StompTransport",
    "encode_frame",
    "send_headers",
    "stomp_address",
]

DUPLICATE_ID: Final = "_AMQ_DUPL_ID"
CONFIRM_PREFIX: Final = "hafailover-confirm:"
# On an ERROR frame from the bundled pair: the broker error's code (ADDRESS_FULL, ...).
CODE_HEADER: Final = "hafailover-code"
# Headers the broker or this adapter interpret; the rest are the message's properties.
_RESERVED: Final = frozenset(
    {
        "destination", "message-id", "subscription", "ack", "content-length", "persistent",
        "priority", "expires", "redelivered", "correlation-id", "reply-to", "receipt",
        "transaction", "hafailover-delivery-count", "content-type", DUPLICATE_ID,
    }
)  # fmt: skip


class StompEvents(Protocol):
    """What the driver hears from one transport (called on stomp.py's receiver thread)."""

    def on_message(self, subscription: str, ack_id: str, message: Message) -> None: ...

    def on_receipt(self, receipt_id: str) -> None: ...

    def on_confirmed(self, upto: int) -> None: ...

    def on_error(self, error: ProtocolError) -> None: ...

    def on_lost(self, reason: str) -> None: ...


@contextlib.contextmanager
def _map_errors(broker: BrokerAddress) -> Iterator[None]:
    """stomp.py's exceptions become ours, here and nowhere else."""
    try:
        yield
    except stomp.exception.ConnectFailedException as exc:
        raise NotConnectedError(f"cannot connect to {broker.redacted()}") from exc
    except stomp.exception.NotConnectedException as exc:
        raise NotConnectedError(f"not connected to {broker.redacted()}") from exc
    except OSError as exc:
        raise NotConnectedError(f"{broker.redacted()}: {exc}") from exc


def message_from_frame(headers: Mapping[str, str], body: bytes) -> Message:
    """A received MESSAGE frame as a Message."""
    properties: dict[str, PropertyValue] = {k: v for k, v in headers.items() if k not in _RESERVED}
    reply_to = headers.get("reply-to")
    destination = headers.get("destination")
    priority = headers.get("priority", "4")
    return Message(
        body=body,
        properties=properties,
        persistent=headers.get("persistent", "false") == "true",
        priority=int(priority) if priority.isdigit() and int(priority) <= 9 else 4,
        correlation_id=headers.get("correlation-id"),
        reply_to=_destination_or_none(reply_to),
        # The sender's id (its duplicate id) when it gave one: it stays the same when the
        # message is delivered again, by this broker or by another after a failover.
        message_id=headers.get(DUPLICATE_ID) or headers.get("message-id"),
        sender_id=bool(headers.get(DUPLICATE_ID)),
        destination=_destination_or_none(destination),
        redelivered=headers.get("redelivered", "false") == "true",
        delivery_count=int(headers.get("hafailover-delivery-count", "0") or 0),
    )


def _destination_or_none(text: str | None) -> Destination | None:
    if not text:
        return None
    try:
        return parse_destination(text)
    except ValueError:
        return None  # a broker-specific form this client does not model


# STOMP temporary queues are named by the client and scoped by the broker to the connection
# (``/temp-queue/NAME``); names with this prefix are the client's and are sent in that form.
STOMP_TEMPORARY_PREFIX: Final = "hafailover-tmp-"


def stomp_address(destination: Destination) -> str:
    """The STOMP destination header for a destination."""
    if destination.kind is DestinationKind.TEMPORARY_QUEUE and destination.name.startswith(
        STOMP_TEMPORARY_PREFIX
    ):
        return f"/temp-queue/{destination.name}"
    return destination.stomp


def send_headers(
    message: Message, *, duplicate_detection: bool, now: float | None = None
) -> dict[str, str]:
    """The SEND headers for a message (its id is given here if it has none yet)."""
    headers: dict[str, str] = {str(k): _header_value(v) for k, v in message.properties.items()}
    headers["persistent"] = "true" if message.persistent else "false"
    if message.priority != 4:  # 4 is every STOMP broker's default (as in JMS)
        headers["priority"] = str(message.priority)
    if message.time_to_live is not None:
        expires = (time.time() if now is None else now) + message.time_to_live
        headers["expires"] = str(int(expires * 1000))
    if message.correlation_id is not None:
        headers["correlation-id"] = message.correlation_id
    if message.reply_to is not None:
        headers["reply-to"] = stomp_address(message.reply_to)
    message_id = message.ensure_message_id()
    if stamps_duplicate_id(persistent=message.persistent, duplicate_detection=duplicate_detection):
        headers[DUPLICATE_ID] = message_id
    return headers


def _check_handshake(broker: BrokerAddress, tls: TlsOptions, timeout: float) -> None:
    """Shake hands as stomp.py would; raise SecurityError naming why TLS failed, if it does
    (a certificate or host name the client refuses, a certificate the broker wants)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if tls.ca_file is not None:
        context.load_verify_locations(tls.ca_file)
    else:
        context.load_default_certs()
    if not tls.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if tls.cert_file is not None:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    try:
        with (
            socket.create_connection((broker.host, broker.port), timeout) as raw,
            context.wrap_socket(raw, server_hostname=broker.host) as wrapped,
        ):
            wrapped.recv(1)  # a broker that wants a client certificate says so here
    except ssl.SSLCertVerificationError as exc:
        raise SecurityError(
            f"TLS with {broker.redacted()} refused: {exc.verify_message or exc.reason}"
        ) from exc
    except ssl.SSLError as exc:
        raise SecurityError(f"TLS with {broker.redacted()} failed: {exc.reason or exc}") from exc
    except OSError:
        return  # not a TLS matter: the broker is not there


def _put(transport: Any, data: Chunk) -> None:
    """Write bytes the way stomp.py's transport wants them. stomp.py's own path (listeners,
    Frame objects, its encoder) costs more than the rest of a send, so frames go straight to
    its socket (the outbox's write lock is the only writer's lock); but over TLS its reader
    thread owns the (non-blocking) socket and writes what is queued for it, since an SSL
    socket may not be written and read by two threads at once."""
    if transport.blocking:
        sock = transport.socket
        if sock is None:
            raise stomp.exception.NotConnectedException()
        sock.sendall(data)
    else:
        transport.send_queue.put(data)


def _no_delay(transport: Any) -> None:
    """Send each write at once. stomp.py leaves Nagle's algorithm on, so a small frame
    written while an earlier one is unacknowledged (a receipt sync after receipt-less
    sends, a COMMIT after its SENDs) waited for the broker's delayed TCP acknowledgement:
    about 40 ms on every such call."""
    sock = getattr(transport, "socket", None)
    if sock is not None:
        with contextlib.suppress(OSError):  # a socket that is already gone fails later
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _header_value(value: PropertyValue) -> str:
    if isinstance(value, bool):  # bool has no subclasses
        return "true" if value else "false"
    return str(plain_property(value))


class _Listener(stomp.ConnectionListener):  # type: ignore[misc]
    """stomp.py's callbacks, turned into the transport's events."""

    def __init__(self, transport: StompTransport) -> None:
        self._transport = transport

    def on_connected(self, frame: Any) -> None:
        self._transport._connected(dict(frame.headers))

    def on_message(self, frame: Any) -> None:
        headers = dict(frame.headers)
        body = frame.body if isinstance(frame.body, bytes) else str(frame.body).encode()
        self._transport.events.on_message(
            headers.get("subscription", ""),
            headers.get("ack", ""),
            message_from_frame(headers, body),
        )

    def on_receipt(self, frame: Any) -> None:
        receipt = frame.headers.get("receipt-id", "")
        if receipt.startswith(CONFIRM_PREFIX):
            with contextlib.suppress(ValueError):
                self._transport.events.on_confirmed(int(receipt[len(CONFIRM_PREFIX) :]))
            return
        self._transport.events.on_receipt(receipt)

    def on_error(self, frame: Any) -> None:
        message = frame.headers.get("message", "") or str(frame.body)
        code = frame.headers.get(CODE_HEADER)
        self._transport._failed(message, frame.headers.get("receipt-id"), code)

    def on_disconnected(self) -> None:
        self._transport._lost("connection closed")

    def on_heartbeat_timeout(self) -> None:
        self._transport._lost("heart-beat timeout")


# ERROR frames whose ``hafailover-code`` header says the broker lacks a resource (the bundled
# broker's engine codes); any other ERROR is a ProtocolError.
_RESOURCE_CODES: Final = frozenset({"DISK_FULL"})


def error_frame_error(text: str, code: str | None) -> ProtocolError:
    """The error an ERROR frame becomes (its ``hafailover-code`` header, when it has one,
    decides)."""
    if code == ErrorCode.ADDRESS_FULL.value:
        return AddressFullError(text)
    if code in _RESOURCE_CODES:
        return BrokerResourceError(f"{text} (code {code})")
    return ProtocolError(text)


class StompTransport:
    """A single STOMP connection; ``open`` blocks until CONNECTED or failure."""

    def __init__(
        self,
        events: StompEvents,
        *,
        heartbeat: float = 1.0,
        connect_timeout: float = 5.0,
        tls: TlsOptions | None = None,
        flush_later: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """``flush_later``: given the outbox's flush after each frame is queued, to call
        once the caller's locks are released (the driver's lock); None: flushed at once."""
        self.events = events
        self.tls = tls or TlsOptions()
        self.heartbeat = heartbeat
        self.connect_timeout = connect_timeout
        self.broker: BrokerAddress | None = None
        self._connection: stomp.Connection12 | None = None
        self._connected_headers: dict[str, str] | None = None
        self._error: str | None = None
        self._opened = threading.Event()
        self._closed = False
        self._lost_reported = False
        self._lock = threading.Lock()
        self._outbox = Outbox(self._put, self._write_failed)
        self._flush_later = flush_later

    def open(
        self,
        broker: BrokerAddress,
        *,
        reattach: str | None = None,
        window: int = -1,
        connection_ttl: float | None = None,
        client_id: str | None = None,
    ) -> Opened:
        """Connect and log in; ask to reattach to session ``reattach`` if given.
        ``client_id``: sent as ``client-id`` (Artemis and ActiveMQ name durable
        subscriptions by it)."""
        self.broker = broker
        ms = int(self.heartbeat * 1000)
        connection = stomp.Connection12(
            [(broker.host, broker.port)],
            heartbeats=(ms, ms),
            reconnect_attempts_max=1,
            reconnect_sleep_initial=0,  # stomp.py slept 0.2 s after a refusal; the schedule waits
            timeout=self.connect_timeout,
            auto_decode=False,
            # The host header names a virtual host on RabbitMQ; "/" is its default one and
            # brokers without virtual hosts ignore the header.
            vhost="/",
        )
        if broker.tls:
            tls = self.tls
            if not tls.verify:
                log.warning(
                    "TLS to %s: the broker's certificate is not verified", broker.redacted()
                )
            connection.set_ssl(
                [(broker.host, broker.port)],
                key_file=tls.key_file,
                cert_file=tls.cert_file,
                ca_certs=tls.ca_file,
                verify=tls.verify,
            )
        # stomp.py's own writes (CONNECT, heart-beats, DISCONNECT) join the outbox: in
        # order with ours, and never waiting behind a write the broker does not take.
        connection.transport.send = self._stomp_writes
        connection.set_listener("hafailover", _Listener(self))
        self._connection = connection
        headers: dict[str, str] = {}
        if window > 0:
            headers["hafailover-window"] = str(window)
            ttl_ms = 0 if connection_ttl is None else int(connection_ttl * 1000)
            headers["hafailover-ttl"] = str(ttl_ms if connection_ttl is not None else 2**31 - 1)
        if reattach is not None:
            headers["hafailover-reattach"] = reattach
        if client_id is not None:
            headers["client-id"] = client_id
        try:
            with _map_errors(broker):
                connection.connect(broker.user, broker.password, wait=False, headers=headers)
        except NotConnectedError:
            if broker.tls:
                # stomp.py keeps a failed handshake's reason to itself: find it out, so that
                # a certificate problem says so (and is not retried as a lost broker).
                _check_handshake(broker, self.tls, self.connect_timeout)
            raise
        _no_delay(connection.transport)
        if not self._opened.wait(self.connect_timeout):
            self.abort()
            raise NotConnectedError(
                f"{broker.redacted()} did not answer CONNECT within {self.connect_timeout}s"
            )
        if self._error is not None:
            error = self._error
            self.abort()
            if "authentication" in error.lower() or "access refused" in error.lower():
                raise SecurityError(f"{broker.redacted()} refused the login: {error}")
            raise NotConnectedError(f"{broker.redacted()} refused the connection: {error}")
        connected = self._connected_headers or {}
        resumed = "hafailover-last-received" in connected
        return Opened(
            broker=broker,
            session_id=connected.get("hafailover-session"),
            resumed=resumed,
            last_received=int(connected.get("hafailover-last-received", "-1")),
            topology=parse_topology(connected.get("hafailover-topology")),
            reattach_refused=connected.get("hafailover-reattach") == "refused",
            detects_duplicates=detects_duplicates(connected.get("server", "")),
            product=connected.get("server", ""),
        )

    def write(self, command: str, headers: Mapping[str, str], body: bytes = b"") -> int:
        """Queue one frame for the outbox; return its size in bytes (for the window)."""
        frame = encode_frame(command, headers, body)
        self._queue(frame)
        return len(frame)

    def write_frames(self, frames: Sequence[tuple[str, Mapping[str, str], bytes]]) -> list[int]:
        """Queue several frames as one write (a small frame written right after another
        would wait for the peer's delayed acknowledgement); their sizes."""
        encoded = [encode_frame(command, headers, body) for command, headers, body in frames]
        self._queue(b"".join(encoded))
        return [len(frame) for frame in encoded]

    def flush(self) -> None:
        """Write what is queued (outside every lock but the outbox's own)."""
        self._outbox.flush()

    def _queue(self, data: bytes) -> None:
        if self._connection is None or self.broker is None:
            raise NotConnectedError("the transport is not open")
        if self._lost_reported:
            # Known gone: the caller hears it now, as from a write that failed.
            raise NotConnectedError(f"{self._broker_text()}: the connection is gone")
        self._outbox.put(data)
        if self._flush_later is None:
            self._outbox.flush()
        else:
            self._flush_later(self._outbox.flush)

    def _stomp_writes(self, data: bytes) -> None:
        """stomp.py's ``send``: its frames join the outbox (its threads hold no lock). A
        heart-beat never blocks its thread, which also watches the broker's heart-beats:
        blocked in a full socket it could never see a broker gone silent."""
        if data.strip() == b"":
            self._outbox.offer(data, self._put_now)
            return
        self._outbox.put(data)
        self._outbox.flush()

    def _put(self, data: Chunk) -> None:
        """The outbox's write (under its write lock only)."""
        connection = self._connection
        if connection is None:
            raise stomp.exception.NotConnectedException()
        _put(connection.transport, data)

    def _put_now(self, data: Chunk) -> bool:
        """Write ``data`` only if the socket takes all of it at once; whether it did."""
        connection = self._connection
        if connection is None:
            raise stomp.exception.NotConnectedException()
        transport = connection.transport
        if not transport.blocking:
            transport.send_queue.put(data)  # TLS: stomp.py's reader writes, never blocking
            return True
        sock = transport.socket
        if sock is None:
            raise stomp.exception.NotConnectedException()
        try:
            return bool(sock.send(data, socket.MSG_DONTWAIT) == len(data))
        except BlockingIOError:
            return False

    def _write_failed(self, error: Exception) -> None:
        """A write failed: the connection is lost (once), and its socket is shut so the
        reader ends too."""
        reason = error if str(error) else type(error).__name__
        self._lost(f"writing failed: {reason}")
        connection = self._connection
        sock = getattr(connection.transport, "socket", None) if connection is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Say goodbye (DISCONNECT) and close; the session ends on the broker."""
        self._closed = True
        connection = self._connection
        if connection is not None:
            with contextlib.suppress(Exception):  # closing: stomp.py's errors no longer matter
                connection.disconnect()
            self.abort()

    def abort(self) -> None:
        """Drop the socket without DISCONNECT (a reattachable session stays held)."""
        self._closed = True
        connection = self._connection
        if connection is not None:
            # Close the socket first: stomp.py's stop() waits for its receiver thread, which
            # only ends once its recv() returns.
            with contextlib.suppress(Exception):
                connection.transport.disconnect_socket()
            with contextlib.suppress(Exception):
                connection.transport.stop()

    # --- from the listener ------------------------------------------------------------------

    def _connected(self, headers: dict[str, str]) -> None:
        self._connected_headers = headers
        self._opened.set()

    def _failed(self, message: str, receipt_id: str | None = None, code: str | None = None) -> None:
        if not self._opened.is_set():
            self._error = message
            self._opened.set()
            return
        # A full address refuses one send and keeps the connection (the bundled pair, as
        # Artemis): its own error, not a failover. Other codes: error_frame_error.
        error = error_frame_error(f"{self._broker_text()}: {message}", code)
        error.receipt_id = receipt_id  # the frame that caused it, when it asked for a receipt
        self.events.on_error(error)

    def _lost(self, reason: str) -> None:
        with self._lock:
            if self._lost_reported:
                return
            self._lost_reported = True
        if not self._opened.is_set():
            self._error = self._error or reason
            self._opened.set()
            return
        if not self._closed:
            self.events.on_lost(f"{self._broker_text()}: {reason}")

    def _broker_text(self) -> str:
        return self.broker.redacted() if self.broker is not None else "broker"
