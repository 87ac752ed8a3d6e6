"""A producer of the threaded driver: sends pipelined through the confirmation window.

A confirmed send registers a call with the sessions core, which decides what a failover
does to it (replayed, resent with its duplicate id, or released as in doubt); this module
writes it and hands the application a completion.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs

from hafailover.core.inflight import CallKind
from hafailover.destination import Destination, parse_destination
from hafailover.driver import tracing
from hafailover.driver.calls import WouldBlock
from hafailover.driver.completions import SendCompletion
from hafailover.driver.waits import Steps
from hafailover.errors import (
    CallTimeoutError,
    ConfigurationError,
    HaFailoverError,
    IllegalStateError,
    MessageTooLargeError,
    NotConnectedError,
    UnblockedError,
)
from hafailover.message import Message, PropertyValue, new_message_id, stamps_duplicate_id

if TYPE_CHECKING:
    from hafailover.driver.session import Session

__all__ = ["MAX_MESSAGE_BYTES", "Producer"]

# The largest message body a producer accepts (a clear error instead of a broker's refusal).
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024


class Producer:
    """Sends messages; pipelined through the confirmation window."""

    def __init__(self, session: Session, destination: Destination | None, confirm: bool) -> None:
        self.session = session
        self.destination = destination
        self.confirm = confirm
        self._outstanding = 0

    def send(
        self,
        message: Message | bytes | str,
        *,
        destination: str | Destination | None = None,
        headers: Mapping[str, PropertyValue] | None = None,
        persistent: bool | None = None,
        priority: int | None = None,
        time_to_live: float | None = None,
    ) -> Message:
        """Send and, for a persistent message, wait until the broker has it (F1, F3)."""
        completion = self._send(
            message, destination, headers, persistent, priority, time_to_live, receipt=True
        )
        completion.result()
        assert completion.message is not None
        return completion.message

    def send_async(
        self,
        message: Message | bytes | str,
        *,
        destination: str | Destination | None = None,
        headers: Mapping[str, PropertyValue] | None = None,
        persistent: bool | None = None,
        priority: int | None = None,
        time_to_live: float | None = None,
    ) -> SendCompletion:
        """Send without waiting; the completion tells when the broker confirmed it."""
        return self._send(
            message, destination, headers, persistent, priority, time_to_live, receipt=False
        )

    def _send(
        self,
        message: Message | bytes | str,
        destination: str | Destination | None,
        headers: Mapping[str, PropertyValue] | None,
        persistent: bool | None,
        priority: int | None,
        time_to_live: float | None,
        *,
        receipt: bool,
        block: bool = True,
        failover_deadline: float | None = None,
    ) -> SendCompletion:
        """``block=False``: raise WouldBlock, having sent nothing, where the send would wait
        (the connection failing over, the window full, a transaction to begin); its caller
        keeps ``failover_deadline`` (``_failover_deadline()``) across its tries."""
        session = self.session
        session._check_open()
        target = self.destination if destination is None else parse_destination(destination)
        if target is None:
            raise IllegalStateError("this producer has no destination: pass destination=")
        msg = _as_message(message, headers, persistent, priority, time_to_live)
        hooks = tracing.installed()
        if hooks is None:
            return self._write(
                msg, target, receipt=receipt, block=block, failover_deadline=failover_deadline
            )
        connection = session.connection
        trace = hooks.send(connection._peer, target, msg)
        try:
            completion = self._write(
                msg, target, receipt=receipt, block=block, failover_deadline=failover_deadline
            )
        except WouldBlock:
            raise  # nothing was sent: this try's span is never ended, so never exported
        except BaseException as exc:
            trace.end(exc, connection._peer)
            raise
        completion.add_done_callback(lambda done: trace.end(done.exception(), connection._peer))
        return completion

    def _write(
        self,
        msg: Message,
        target: Destination,
        *,
        receipt: bool,
        block: bool,
        failover_deadline: float | None,
    ) -> SendCompletion:
        """Write ``msg`` through the confirmation window (stop the world while failing over)
        and return its completion."""
        size = msg.size()
        if size > MAX_MESSAGE_BYTES:
            raise MessageTooLargeError(
                f"a message of {size} bytes is larger than the {MAX_MESSAGE_BYTES} bytes allowed"
            )
        session = self.session
        connection = session.connection
        transacted = session.transacted
        confirm = self.confirm and msg.persistent and not transacted
        completion = SendCompletion(connection, msg)
        while True:
            # Begun outside the lock: on some links it waits for the broker. A caller that
            # must not block has begun it already (``_send_steps``).
            tx = session._ensure_tx() if transacted and block else None
            with connection._cond:
                deadline = failover_deadline if not block else connection._failover_deadline()
                link = connection._wait_window_room(size, deadline, block=block)
                if transacted:
                    transaction = session.rules.transaction
                    assert transaction is not None
                    if transaction.rollback_only:
                        # F9: the transaction is doomed; commit() will roll back and raise.
                        transaction.work()
                        completion._finish(None)
                        return completion
                    if not block:
                        tx = session._tx
                        if tx is None or session._tx_link != link.serial:
                            raise WouldBlock  # its transaction is to begin (again) first
                    elif session._tx_link != link.serial:
                        # A failover replaced the link after this send's transaction was
                        # begun, before any of its work was written (else it would be
                        # rollback-only): begin it again on the new link and send there.
                        continue
                    transaction.work()
                token = None
                transfer: SendCompletion | None = None
                if confirm:
                    token = connection._call(
                        CallKind.SEND,
                        completion,
                        session,
                        destination=target,
                        producer=self,
                        resendable=stamps_duplicate_id(
                            persistent=msg.persistent,
                            duplicate_detection=connection.policy.duplicate_detection,
                        ),
                        size=0 if link.windowed else size,
                    )
                    self._outstanding += 1
                elif transacted and link.settles_transacted_work:
                    # The broker settles each transactional transfer; the discharge
                    # must wait for them, or it can overtake transfers still waiting for
                    # a new sender link's credit (and commit without them). The send itself
                    # completes at once, as every transacted send does: commit() waits.
                    transfer = SendCompletion(connection, msg)
                    token = connection._call(
                        CallKind.TRANSFER, transfer, session, destination=target
                    )
                    session._tx_sends.append(transfer)
                ask = connection._core.asks_receipt(
                    token, windowed=link.windowed, waited_for=receipt
                )
                try:
                    command_id = link.send(target, msg, tx=tx, token=token if ask else None)
                except HaFailoverError as exc:
                    if not isinstance(exc, NotConnectedError | UnblockedError):
                        # Not the link's fault (a message this protocol cannot carry):
                        # nothing was sent, the connection is fine, the caller hears why.
                        if token is not None:
                            connection._abandon(token, exc)
                        if transfer is not None:
                            session._tx_sends.remove(transfer)
                        raise
                    connection._io_failed(link, exc)
                    if transacted:
                        # The transaction is doomed by the failover (F9): commit() says so.
                        completion._finish(None)
                        return completion
                    if token is not None:
                        # The pending send stays: the failover resends it or releases it.
                        return completion
                    continue  # unconfirmed: send again on the next link (stop the world)
                connection._core.count_sent()
                connection._written(token, link, command_id, asked=ask)
                if not confirm:
                    completion._finish(None)
                return completion

    def _send_steps(
        self,
        message: Message | bytes | str,
        destination: str | Destination | None,
        headers: Mapping[str, PropertyValue] | None,
        persistent: bool | None,
        priority: int | None,
        time_to_live: float | None,
        *,
        receipt: bool,
    ) -> Steps[SendCompletion]:
        """``send_async`` as steps: it waits out a failover (F1) and for room in the
        confirmation window, and begins its transaction first in a transacted session."""
        session = self.session
        deadline = session.connection._failover_deadline()
        while True:
            if session.transacted:
                yield from session._ensure_tx_steps()
            try:
                return self._send(
                    message,
                    destination,
                    headers,
                    persistent,
                    priority,
                    time_to_live,
                    receipt=receipt,
                    block=False,
                    failover_deadline=deadline,
                )
            except WouldBlock as blocked:
                wait, timed_out = blocked.wait, blocked.timed_out
            if wait is None:
                continue  # a failover replaced the transaction's link: begin it again
            try:
                yield wait
            except CallTimeoutError as exc:
                if timed_out is None:
                    raise
                timed_out(exc)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every send_async of this producer has completed."""
        self.session.connection._wait_until(
            lambda: self._outstanding <= 0,
            timeout,
            lambda: f"{self._outstanding} send(s) still unconfirmed after the timeout",
        )

    def close(self) -> None:
        self.flush()


# The id each application Message was sent with, kept beside it: a message object is never
# changed by a send, and sending the same object again (a retried transaction, a resend
# after an unknown outcome) uses the same id, so a broker with duplicate detection stores it
# once (F13). Held weakly: forgotten with the message.
_SENT_IDS: Final[weakref.WeakKeyDictionary[Message, str]] = weakref.WeakKeyDictionary()
_SENT_IDS_LOCK: Final = threading.Lock()


def sent_id(message: Message) -> str:
    """The id ``message`` is sent with: its own, else the one first given to it."""
    if message.message_id is not None:
        return message.message_id
    with _SENT_IDS_LOCK:
        message_id = _SENT_IDS.get(message)
        if message_id is None:
            message_id = _SENT_IDS[message] = new_message_id()
        return message_id


def _as_message(
    message: Message | bytes | str,
    headers: Mapping[str, PropertyValue] | None,
    persistent: bool | None,
    priority: int | None,
    time_to_live: float | None,
) -> Message:
    """The message to send: a copy of an application's Message (which no send changes, so
    it may be sent from several threads, or again), or a new one for a bare body."""
    if isinstance(message, Message):
        changes: dict[str, Any] = {}
        if headers is not None:
            changes["properties"] = {**message.properties, **headers}
        if persistent is not None:
            changes["persistent"] = persistent
        if priority is not None:
            changes["priority"] = priority
        if time_to_live is not None:
            changes["time_to_live"] = time_to_live
        # evolve runs the validators on the copy, so bad options are refused here.
        return attrs.evolve(
            message, message_id=sent_id(message), delivery=None, acknowledger=None, **changes
        )
    if headers is None and priority is None and time_to_live is None:
        return Message.of_body(message, persistent=True if persistent is None else persistent)
    if not isinstance(message, bytes | str):
        raise ConfigurationError(
            f"a message body must be bytes or str (or a Message), not {type(message).__name__}"
        )
    return Message(
        body=message,
        properties=dict(headers or {}),
        persistent=True if persistent is None else persistent,
        priority=4 if priority is None else priority,
        time_to_live=time_to_live,
    )
