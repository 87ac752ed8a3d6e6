"""The error hierarchy: one root, a machine-readable code on every class.

Every error hafailover raises is a ``HaFailoverError``. It is split into
``LocalError`` (the application misused the API or the configuration; retrying
the same call cannot help) and ``RemoteError`` (the network or a broker failed;
the application may retry). Each class also subclasses the builtin that fits,
so ``except ConnectionError`` or ``except ValueError`` keep working in code that
has never heard of hafailover.

The codes follow the Artemis names where Artemis has one (FAILOVER,
DISCONNECT, UNBLOCKED, TRANSACTION_ROLLED_BACK, TRANSACTION_OUTCOME_UNKNOWN).
This module imports nothing from the rest of the package.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import ClassVar

__all__ = [
    "AcknowledgeFailedError",
    "BrokerResourceError",
    "BrowserInvalidatedError",
    "CallTimeoutError",
    "ConfigurationError",
    "ConnectionClosedError",
    "DisconnectedError",
    "ErrorCode",
    "FailoverNotice",
    "HaFailoverError",
    "IllegalStateError",
    "InvalidURLError",
    "LocalError",
    "MessageTooLargeError",
    "NotConnectedError",
    "ProtocolError",
    "RemoteError",
    "SecurityError",
    "StaleAcknowledgeError",
    "TransactionOutcomeUnknownError",
    "TransactionRolledBackError",
    "UnblockedError",
]


class ErrorCode(enum.Enum):
    """Machine-readable reason carried by every hafailover error."""

    # Told to the exception listener: failover happened and succeeded.
    FAILOVER = "FAILOVER"
    # Reconnection gave up, or failover is disabled: the connection is gone.
    DISCONNECT = "DISCONNECT"
    # A call waiting for a broker reply was released because the connection died.
    UNBLOCKED = "UNBLOCKED"
    TRANSACTION_ROLLED_BACK = "TRANSACTION_ROLLED_BACK"
    TRANSACTION_OUTCOME_UNKNOWN = "TRANSACTION_OUTCOME_UNKNOWN"
    # The first connection could not be made.
    NOT_CONNECTED = "NOT_CONNECTED"
    CONNECTION_TIMEDOUT = "CONNECTION_TIMEDOUT"
    # An acknowledge could not reach the broker (AUTO_ACKNOWLEDGE, F6).
    ACKNOWLEDGE_FAILED = "ACKNOWLEDGE_FAILED"
    # Messages held before a failover can no longer be acknowledged (CLIENT, F8).
    ACKNOWLEDGE_STALE = "ACKNOWLEDGE_STALE"
    # A queue browser's iteration was cut by a failover (F11).
    BROWSER_INVALIDATED = "BROWSER_INVALIDATED"
    SECURITY = "SECURITY"
    PROTOCOL = "PROTOCOL"
    INVALID_CONFIGURATION = "INVALID_CONFIGURATION"
    ILLEGAL_STATE = "ILLEGAL_STATE"
    CLOSED = "CLOSED"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    # The broker refused a request for lack of a resource: its disk is full (as Artemis's
    # ADDRESS_FULL, but for any resource the broker names).
    RESOURCE_LIMIT = "RESOURCE_LIMIT"


class HaFailoverError(Exception):
    """Root of every error hafailover raises."""

    code: ClassVar[ErrorCode]


class LocalError(HaFailoverError):
    """The application asked for something that cannot work; retrying will not help."""


class RemoteError(HaFailoverError):
    """A broker or the network failed; the operation may succeed if retried."""


# --- local misuse -------------------------------------------------------------


class ConfigurationError(LocalError, ValueError):
    """A bad option, value or combination of options."""

    code = ErrorCode.INVALID_CONFIGURATION


class InvalidURLError(ConfigurationError):
    """A connection URL that cannot be parsed, naming the part that is wrong.

    ``option`` is the option (or URL part) at fault and ``accepted`` what would
    have been accepted, so tools can show both without parsing the message.
    """

    def __init__(self, message: str, *, option: str, accepted: Sequence[str] = ()) -> None:
        self.option = option
        self.accepted = tuple(accepted)
        if self.accepted:
            message = f"{message} (accepted: {', '.join(self.accepted)})"
        super().__init__(message)


class IllegalStateError(LocalError, RuntimeError):
    """The call is not allowed in the object's current state."""

    code = ErrorCode.ILLEGAL_STATE


class ConnectionClosedError(IllegalStateError):
    """The connection, session or producer was closed by the application."""

    code = ErrorCode.CLOSED


class MessageTooLargeError(LocalError, ValueError):
    """A message larger than the connection allows."""

    code = ErrorCode.MESSAGE_TOO_LARGE


# --- remote failure -----------------------------------------------------------


class FailoverNotice(RemoteError, ConnectionError):  # noqa: N818 - told to listeners, never raised
    """Given to the exception listener after a successful failover (code FAILOVER).

    ``reattached`` tells whether the sessions were reattached on the same server
    (fully transparent) or recreated by a reconnect; ``report`` holds what the
    failover did (a :class:`hafailover.core.report.FailoverReport`).
    """

    code = ErrorCode.FAILOVER

    def __init__(self, message: str, *, reattached: bool, report: object = None) -> None:
        super().__init__(message)
        self.reattached = reattached
        self.report = report


class DisconnectedError(RemoteError, ConnectionError):
    """The connection is lost for good: reconnection gave up or is disabled."""

    code = ErrorCode.DISCONNECT


class NotConnectedError(RemoteError, ConnectionError):
    """The first connection could not be made within initial_connect_attempts."""

    code = ErrorCode.NOT_CONNECTED


class UnblockedError(RemoteError, ConnectionError):
    """A call waiting for a broker reply was released by a failover (F3)."""

    code = ErrorCode.UNBLOCKED


class CallTimeoutError(RemoteError, TimeoutError):
    """A call waited longer than call_timeout or call_failover_timeout."""

    code = ErrorCode.CONNECTION_TIMEDOUT


class TransactionRolledBackError(RemoteError):
    """The transaction was rolled back; replay it on the same session (F9)."""

    code = ErrorCode.TRANSACTION_ROLLED_BACK


class TransactionOutcomeUnknownError(RemoteError):
    """A commit was in flight when the connection died; it may or may not have happened.

    Retrying the transaction with the same duplicate ids is safe on a broker
    with duplicate detection (F13).
    """

    code = ErrorCode.TRANSACTION_OUTCOME_UNKNOWN


class AcknowledgeFailedError(RemoteError, ConnectionError):
    """An acknowledgement could not be sent; the message may be redelivered (F6)."""

    code = ErrorCode.ACKNOWLEDGE_FAILED


class StaleAcknowledgeError(RemoteError):
    """Messages received before a failover can no longer be acknowledged (F8).

    The session has been recovered: unacknowledged messages will be redelivered.
    """

    code = ErrorCode.ACKNOWLEDGE_STALE


class BrowserInvalidatedError(RemoteError, LookupError):
    """A failover cut a queue browser's iteration (F11).

    Deliberately not a StopIteration: a for loop must not end silently as if the
    queue had been fully browsed. LookupError is the builtin nearest to Java's
    NoSuchElementException.
    """

    code = ErrorCode.BROWSER_INVALIDATED


class SecurityError(RemoteError, PermissionError):
    """The broker refused the credentials."""

    code = ErrorCode.SECURITY


class ProtocolError(RemoteError):
    """The broker sent something the client cannot accept, or an ERROR frame."""

    code = ErrorCode.PROTOCOL
    # STOMP: the receipt id of the frame the broker refused, when it asked for one.
    receipt_id: str | None = None


class BrokerResourceError(ProtocolError):
    """The broker refused the request for lack of a resource (its disk is full) and stored
    nothing of it; the same request may succeed once the broker has room again.

    Raised for AMQP's ``amqp:resource-limit-exceeded`` (a rejected send, a refused link) and
    for a STOMP ERROR frame whose ``code`` header says ``DISK_FULL`` (the bundled broker's; a
    STOMP ERROR also ends the connection, which fails over as usual). A ProtocolError, so
    code that caught the broker's refusal as one still does.
    """

    code = ErrorCode.RESOURCE_LIMIT
