"""One connection to one broker, as the driver sees it: the same operations for both protocols.

A link wraps one protocol transport (``adapters.stomp`` or ``adapters.amqp``) and turns the
driver's operations (send, subscribe, acknowledge, transactions, temporary queues) into that
protocol's frames or calls. It owns no failover logic: it never retries, never waits for a
lost connection, and says nothing about what a failure means. Events come back to the
driver through ``LinkEvents``, tagged with the link so that a late event of a link the
driver has replaced is ignored there.

STOMP links number every frame for the confirmation window (F4) and ask for a receipt when
the driver wants a confirmation; AMQP links carry the driver's token in the transfer and
report its settlement. Calls marked *blocking* wait for the broker and must be made without
the driver's lock held (the AMQP reader thread calls back into the driver).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from typing import Any, Final, Protocol

from hafailover.adapters.amqp import AmqpTransaction, Outcome
from hafailover.adapters.amqp_io import AmqpTransport
from hafailover.adapters.base import Opened, TlsOptions
from hafailover.adapters.stomp import (
    DUPLICATE_ID,
    STOMP_TEMPORARY_PREFIX,
    StompTransport,
    send_headers,
    stomp_address,
)
from hafailover.destination import Destination, DestinationKind
from hafailover.errors import (
    CallTimeoutError,
    NotConnectedError,
    ProtocolError,
    RemoteError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.url import BrokerAddress, FailoverPolicy
from hafailover.window import ConfirmationWindow, command_flags

__all__ = ["AmqpLink", "Link", "LinkEvents", "LinkFactory", "StompLink", "make_link"]

# A STOMP receipt the driver waits for carries its token after this prefix.
_TOKEN_PREFIX: Final = "hafailover-call-"  # noqa: S105 - a receipt prefix, not a secret


class LinkEvents(Protocol):
    """What the driver hears from a link (on the transport's thread; must not block)."""

    def link_message(self, link: Link, subscription: str, tag: str, message: Message) -> None: ...

    def link_completed(self, link: Link, token: int, error: RemoteError | None) -> None: ...

    def link_confirmed(self, link: Link, upto: int) -> None: ...

    def link_error(self, link: Link, error: ProtocolError) -> None: ...

    def link_browse_end(self, link: Link, subscription: str) -> None: ...

    def link_lost(self, link: Link, reason: str) -> None: ...


class Link(Protocol):
    """One open connection to one broker.

    What a link can do is said by its capabilities, never by its class: the driver asks
    ``windowed`` (frames numbered for the confirmation window and receipts in frame order,
    so one receipt confirms every frame before it, and ``sync`` may be called),
    ``calls_block`` (subscribe, browse, begin and end wait for the broker: call them without
    the driver's lock) and ``settles_transacted_work`` (the broker settles each transacted
    transfer and acknowledge, and a commit must wait for those settlements)."""

    broker: BrokerAddress
    serial: int
    windowed: bool
    calls_block: bool
    settles_transacted_work: bool

    def open(self, broker: BrokerAddress, *, resume: str | None) -> Opened:
        """Connect and log in (blocking)."""
        ...

    def send(
        self, destination: Destination, message: Message, *, tx: object, token: int | None
    ) -> int:
        """Send a message; with a token the broker's confirmation completes it. Returns the
        command id (STOMP with the window on) or -1."""
        ...

    def subscribe(
        self,
        subscription: str,
        destination: Destination,
        *,
        acknowledged: bool,
        prefetch: int,
        selector: str | None = None,
        token: int | None = None,
    ) -> None:
        """Start a subscription (blocking on AMQP); a token is completed once the broker
        has it, or failed with the broker's refusal."""
        ...

    def unsubscribe(self, subscription: str) -> None: ...

    def browse(self, subscription: str, queue: Destination) -> None:
        """Copy a queue's waiting messages (blocking on AMQP); ``link_browse_end`` follows."""
        ...

    def acknowledge(self, subscription: str, tag: str, *, tx: object, token: int | None) -> None:
        """Accept one delivery (inside ``tx`` when given)."""
        ...

    def redeliver(self, subscription: str, tag: str) -> None:
        """Give one delivery back for redelivery, counted as a failed attempt."""
        ...

    def begin(self) -> object:
        """Start a transaction; returns its handle (blocking on AMQP)."""
        ...

    def end(self, tx: object, *, commit: bool, token: int) -> None:
        """Commit or roll back; completion arrives as ``link_completed(token)``."""
        ...

    def temporary_queue(self, wanted: Destination | None) -> Destination:
        """Create a temporary queue; ``wanted`` recreates one under the same name (F5)."""
        ...

    def replay(self, payload: object) -> None:
        """Write a command kept by the confirmation window again (reattach)."""
        ...

    def sync(self, token: int) -> None:
        """Windowed links only: a frame that asks for nothing but a receipt, which then
        confirms every frame written before it."""
        ...

    def resend(self, payload: object) -> int:
        """Windowed links only: write a command a previous link's window kept (a send
        stamped with a duplicate id) as a new command of this one; returns its id."""
        ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


_SERIALS: Final = itertools.count(1)


class StompLink:
    """A link over one stomp.py connection, with frames numbered for the window."""

    def __init__(
        self,
        events: LinkEvents,
        policy: FailoverPolicy,
        window: ConfirmationWindow[tuple[str, dict[str, str], bytes]],
    ) -> None:
        self.serial = next(_SERIALS)
        self.events = events
        self.policy = policy
        self.window = window
        self.windowed = False  # the broker agreed to the reattach extension
        self.calls_block = False
        self.settles_transacted_work = False
        self._tx_names = itertools.count(1)
        self._transport = StompTransport(
            _StompEvents(self),
            tls=TlsOptions.of(policy),
            heartbeat=policy.heartbeat,
            connect_timeout=max(2.0, policy.heartbeat * 4),
        )
        self.broker: BrokerAddress = policy.brokers[0]

    def open(self, broker: BrokerAddress, *, resume: str | None) -> Opened:
        self.broker = broker
        policy = self.policy
        window = policy.confirmation_window_size
        opened = self._transport.open(
            broker,
            reattach=resume,
            window=window if window > 0 else -1,
            connection_ttl=policy.connection_ttl,
        )
        self.windowed = opened.session_id is not None and window > 0
        return opened

    def _write(
        self,
        command: str,
        headers: dict[str, str],
        body: bytes = b"",
        *,
        replayable: bool = True,
        resendable: bool = False,
    ) -> int:
        size = self._transport.write(command, headers, body)
        if not self.windowed:
            return -1
        # Only SENDs wait for room (the driver checks before writing); the frame is on the
        # wire already, so it is numbered whatever the window holds.
        return self.window.record(
            (command, headers, body),
            size,
            replayable=replayable,
            resendable=resendable,
            force=True,
        )

    def send(
        self, destination: Destination, message: Message, *, tx: object, token: int | None
    ) -> int:
        headers = send_headers(message, duplicate_detection=self.policy.duplicate_detection)
        headers["destination"] = stomp_address(destination)
        if tx is not None:
            headers["transaction"] = str(tx)
        if token is not None:
            headers["receipt"] = f"{_TOKEN_PREFIX}{token}"
        replayable, resendable = command_flags(
            transacted=tx is not None, stamped=DUPLICATE_ID in headers
        )
        return self._write(
            "SEND", headers, message.body_bytes, replayable=replayable, resendable=resendable
        )

    def subscribe(
        self,
        subscription: str,
        destination: Destination,
        *,
        acknowledged: bool,
        prefetch: int,
        selector: str | None = None,
        token: int | None = None,
    ) -> None:
        headers = {
            "destination": stomp_address(destination),
            "id": subscription,
            "ack": "client-individual" if acknowledged else "auto",
        }
        if acknowledged:
            headers["prefetch-count"] = str(prefetch)
        if selector is not None:
            headers["selector"] = selector
        if token is not None:
            headers["receipt"] = f"{_TOKEN_PREFIX}{token}"
        self._write("SUBSCRIBE", headers)

    def unsubscribe(self, subscription: str) -> None:
        self._write("UNSUBSCRIBE", {"id": subscription})

    def browse(self, subscription: str, queue: Destination) -> None:
        # ActiveMQ's convention: a snapshot, then a MESSAGE with browser:end and no body.
        self._write(
            "SUBSCRIBE",
            {
                "destination": stomp_address(queue),
                "id": subscription,
                "ack": "auto",
                "browser": "true",
            },
        )

    def acknowledge(self, subscription: str, tag: str, *, tx: object, token: int | None) -> None:
        headers = {"id": tag}
        if tx is not None:
            headers["transaction"] = str(tx)
        if token is not None:
            headers["receipt"] = f"{_TOKEN_PREFIX}{token}"
        replayable, _ = command_flags(transacted=tx is not None, stamped=False)
        self._write("ACK", headers, replayable=replayable)

    def redeliver(self, subscription: str, tag: str) -> None:
        self._write("NACK", {"id": tag})

    def begin(self) -> object:
        name = f"tx-{self.serial}-{next(self._tx_names)}"
        self._write("BEGIN", {"transaction": name}, replayable=False)  # transacted (F9)
        return name

    def end(self, tx: object, *, commit: bool, token: int) -> None:
        headers = {"transaction": str(tx), "receipt": f"{_TOKEN_PREFIX}{token}"}
        self._write("COMMIT" if commit else "ABORT", headers, replayable=False)

    def temporary_queue(self, wanted: Destination | None) -> Destination:
        # STOMP temporary queues are named by the client and scoped by the broker to the
        # connection: the same name on a new connection is the same queue to the application.
        if wanted is not None:
            return wanted
        return Destination(
            DestinationKind.TEMPORARY_QUEUE, f"{STOMP_TEMPORARY_PREFIX}{uuid.uuid4().hex[:16]}"
        )

    def sync(self, token: int) -> None:
        """A frame that does nothing but ask for a receipt (an empty transaction rolled
        back): with receipts in frame order it confirms everything written before it."""
        name = f"sync-{self.serial}-{next(self._tx_names)}"
        frames: list[tuple[str, dict[str, str], bytes]] = [
            ("BEGIN", {"transaction": name}, b""),
            ("ABORT", {"transaction": name, "receipt": f"{_TOKEN_PREFIX}{token}"}, b""),
        ]
        sizes = self._transport.write_frames(frames)  # one write: no Nagle wait between them
        if self.windowed:
            for frame, size in zip(frames, sizes, strict=True):
                self.window.record(frame, size, force=True)

    def replay(self, payload: object) -> None:
        assert isinstance(payload, tuple)
        command, headers, body = payload
        self._transport.write(str(command), headers, bytes(body))

    def resend(self, payload: object) -> int:
        assert isinstance(payload, tuple)
        command, headers, body = payload
        return self._write(str(command), headers, bytes(body), resendable=True)

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()


class _StompEvents:
    def __init__(self, link: StompLink) -> None:
        self._link = link
        self._events = link.events

    def on_message(self, subscription: str, ack_id: str, message: Message) -> None:
        if message.message_id is None and message.properties.get("browser") == "end":
            self._events.link_browse_end(self._link, subscription)
            return
        self._events.link_message(self._link, subscription, ack_id, message)

    def on_receipt(self, receipt_id: str) -> None:
        if receipt_id.startswith(_TOKEN_PREFIX):
            token = receipt_id[len(_TOKEN_PREFIX) :]
            if token.isdigit():
                self._events.link_completed(self._link, int(token), None)

    def on_confirmed(self, upto: int) -> None:
        self._events.link_confirmed(self._link, upto)

    def on_error(self, error: ProtocolError) -> None:
        # A STOMP ERROR ends the connection; the broker closes it and the loss follows.
        receipt = getattr(error, "receipt_id", None)
        if receipt is not None and receipt.startswith(_TOKEN_PREFIX):
            token = receipt[len(_TOKEN_PREFIX) :]
            if token.isdigit():
                self._events.link_completed(self._link, int(token), error)
                return
        self._events.link_error(self._link, error)

    def on_lost(self, reason: str) -> None:
        self._events.link_lost(self._link, reason)


class AmqpLink:
    """A link over one AMQP 1.0 connection (adapters.amqp_io: proton's engine on a socket)."""

    def __init__(self, events: LinkEvents, policy: FailoverPolicy) -> None:
        self.serial = next(_SERIALS)
        self.events = events
        self.policy = policy
        self.windowed = False  # no reattach extension on AMQP: every failover reconnects
        # attach, declare and discharge wait for the broker's answer
        self.calls_block = True
        # the broker settles transactional transfers and dispositions; a discharge must not
        # overtake them
        self.settles_transacted_work = True
        self._transport = AmqpTransport(
            _AmqpEvents(self),
            tls=TlsOptions.of(policy),
            heartbeat=policy.heartbeat,
            connect_timeout=max(2.0, policy.heartbeat * 4),
            call_timeout=policy.call_timeout,
        )
        self.broker: BrokerAddress = policy.brokers[0]

    def open(self, broker: BrokerAddress, *, resume: str | None) -> Opened:
        self.broker = broker
        return self._transport.open(broker)

    def send(
        self, destination: Destination, message: Message, *, tx: object, token: int | None
    ) -> int:
        self._transport.send(
            0 if token is None else token,
            destination,
            message,
            duplicate_detection=self.policy.duplicate_detection,
            tx=_transaction(tx),
        )
        return -1

    def subscribe(
        self,
        subscription: str,
        destination: Destination,
        *,
        acknowledged: bool,
        prefetch: int,
        selector: str | None = None,
        token: int | None = None,
    ) -> None:
        error: RemoteError | None = None
        try:
            self._transport.subscribe(
                subscription,
                destination,
                credit=max(1, prefetch),
                settle_on_delivery=not acknowledged,
            )
        except RemoteError as exc:
            if token is None or isinstance(
                exc, NotConnectedError | UnblockedError | CallTimeoutError
            ):
                # The connection failed or did not answer in time, not the subscription:
                # the caller decides (a failover's recreation fails its attempt).
                raise
            error = exc
        if token is not None:
            self.events.link_completed(self, token, error)

    def unsubscribe(self, subscription: str) -> None:
        self._transport.unsubscribe(subscription)

    def browse(self, subscription: str, queue: Destination) -> None:
        self._transport.subscribe(
            subscription, queue, credit=200, settle_on_delivery=True, browse=True
        )

    def acknowledge(self, subscription: str, tag: str, *, tx: object, token: int | None) -> None:
        # The broker's settlement confirms the acknowledge (inside a transaction: that the
        # broker holds it in the transaction).
        self._transport.settle(int(tag), Outcome.ACCEPTED, tx=_transaction(tx), token=token)

    def redeliver(self, subscription: str, tag: str) -> None:
        self._transport.settle(int(tag), Outcome.MODIFIED)

    def begin(self) -> object:
        return self._transport.declare()

    def end(self, tx: object, *, commit: bool, token: int) -> None:
        transaction = _transaction(tx)
        assert transaction is not None
        error: RemoteError | None = None
        try:
            self._transport.discharge(transaction, fail=not commit)
        except RemoteError as exc:
            error = exc
        self.events.link_completed(self, token, error)

    def temporary_queue(self, wanted: Destination | None) -> Destination:
        created = self._transport.create_temporary_queue()
        if wanted is not None and wanted != created:
            self._transport.alias_temporary_queue(wanted, created)
            return wanted
        return created

    def replay(self, payload: object) -> None:
        raise NotConnectedError("AMQP links have no confirmation window to replay")

    def sync(self, token: int) -> None:
        raise NotConnectedError("AMQP links confirm each call on its own: nothing to sync")

    def resend(self, payload: object) -> int:
        raise NotConnectedError("AMQP links have no confirmation window to resend from")

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()


def _transaction(tx: object) -> AmqpTransaction | None:
    if tx is None or isinstance(tx, AmqpTransaction):
        return tx
    raise TypeError(f"not an AMQP transaction: {tx!r}")


class _AmqpEvents:
    def __init__(self, link: AmqpLink) -> None:
        self._link = link
        self._events = link.events

    def on_message(self, subscription: str, delivery: int, message: Message) -> None:
        self._events.link_message(self._link, subscription, str(delivery), message)

    def on_settled(self, token: int, error: RemoteError | None) -> None:
        if token:
            self._events.link_completed(self._link, token, error)

    def on_error(self, error: ProtocolError) -> None:
        self._events.link_error(self._link, error)

    def on_lost(self, reason: str) -> None:
        self._events.link_lost(self._link, reason)

    def on_browse_end(self, subscription: str) -> None:
        self._events.link_browse_end(self._link, subscription)


LinkFactory = Callable[[LinkEvents, FailoverPolicy, ConfirmationWindow[Any]], Link]


def make_link(
    events: LinkEvents,
    policy: FailoverPolicy,
    window: ConfirmationWindow[Any],
) -> Link:
    """A new, unopened link for the policy's protocol."""
    if policy.brokers[0].scheme.startswith("stomp"):
        return StompLink(events, policy, window)
    return AmqpLink(events, policy)


# For type checkers: both link classes satisfy the protocol.
_check_stomp: Callable[..., Link] = StompLink
_check_amqp: Callable[..., Link] = AmqpLink
