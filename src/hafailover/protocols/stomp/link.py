"""A link over one STOMP connection: the driver's operations as STOMP frames.

STOMP links number every frame for the confirmation window (F4) and ask for a receipt when
the driver wants a confirmation; the frames go out through ``transport.StompTransport``.
What a link is and owes the driver: ``hafailover.protocols.base.Link``.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from typing import Final

from hafailover.core.subscriptions import NamedSubscription
from hafailover.core.window import ConfirmationWindow, command_flags
from hafailover.destination import Destination, DestinationKind
from hafailover.errors import (
    ConfigurationError,
    ProtocolError,
)
from hafailover.message import Message
from hafailover.protocols.base import LINK_SERIALS, LinkEvents, Opened, TlsOptions
from hafailover.protocols.stomp.transport import (
    DUPLICATE_ID,
    STOMP_TEMPORARY_PREFIX,
    StompTransport,
    send_headers,
    stomp_address,
)
from hafailover.url import BrokerAddress, FailoverPolicy

__all__ = ["StompLink"]

# A STOMP receipt the driver waits for carries its token after this prefix.
_TOKEN_PREFIX: Final = "hafailover-call-"  # noqa: S105 - a receipt prefix, not a secret


class StompLink:
    """A link over one stomp.py connection, with frames numbered for the window."""

    def __init__(
        self,
        events: LinkEvents,
        policy: FailoverPolicy,
        window: ConfirmationWindow[tuple[str, dict[str, str], bytes]],
    ) -> None:
        self.serial = next(LINK_SERIALS)
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
            # Frames are queued under the driver's lock and written once it is released.
            flush_later=self._flush_later,
        )
        self.broker: BrokerAddress = policy.brokers[0]

    def _flush_later(self, flush: Callable[[], None]) -> None:
        self.events.link_output(self, flush)

    def open(self, broker: BrokerAddress, *, resume: str | None) -> Opened:
        self.broker = broker
        policy = self.policy
        window = policy.confirmation_window_size
        opened = self._transport.open(
            broker,
            reattach=resume,
            window=window if window > 0 else -1,
            connection_ttl=policy.connection_ttl,
            client_id=policy.client_id,
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
        # Only SENDs wait for room (the driver checks before writing); the frame is queued
        # already (it leaves in this order), so it is numbered whatever the window holds.
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
        named: NamedSubscription | None = None,
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
        if named is not None:
            headers.update(_named_headers(named))
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

    def reject(self, subscription: str, tag: str) -> None:
        # RabbitMQ's header: a NACK that does not requeue dead-letters the message.
        self._write("NACK", {"id": tag, "requeue": "false"})

    def remove_subscription(self, name: str, *, token: int) -> None:
        # Artemis deletes a durable subscription on an UNSUBSCRIBE that names it.
        self._write(
            "UNSUBSCRIBE",
            {
                "id": f"unsubscribe-{name}",
                "durable-subscription-name": name,
                "receipt": f"{_TOKEN_PREFIX}{token}",
            },
        )

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

    def pull(self, subscription: str) -> None:
        raise ConfigurationError(f"{subscription}: STOMP has no pull (see core/pull.py)")

    def drain(self, subscription: str) -> None:
        raise ConfigurationError(f"{subscription}: STOMP has no pull (see core/pull.py)")

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()


def _named_headers(named: NamedSubscription) -> dict[str, str]:
    """The headers of a durable or shared subscription: Artemis's and the reference broker's
    (``durable-subscription-name``; ``shared-subscription-name`` for a shared one that is
    not durable; ``hafailover-exclusive`` for one that is not shared: one consumer at a
    time) and RabbitMQ's (``durable`` and ``auto-delete`` with a queue of that name,
    ``x-queue-name``; its ``exclusive`` header would make the queue die with the
    connection, so it is not sent)."""
    name = named.broker_name
    headers = {"x-queue-name": name}
    if named.durable:
        headers.update(
            {"durable-subscription-name": name, "durable": "true", "auto-delete": "false"}
        )
    else:
        headers["shared-subscription-name"] = name
    if not named.shared:
        headers["hafailover-exclusive"] = "true"
    if named.client_id is not None:
        headers["client-id"] = named.client_id
    return headers


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
