"""hafailover: client-side failover for STOMP and AMQP 1.0 messaging.

The public surface is what ``__all__`` names; every module behind it may change.
"""

from typing import TYPE_CHECKING, Any

from hafailover.ack_modes import AckMode, LinkReliability
from hafailover.core.report import FailoverReport, SessionFailover
from hafailover.destination import Destination, DestinationKind, parse_destination
from hafailover.errors import (
    AcknowledgeFailedError,
    BrokerResourceError,
    BrowserInvalidatedError,
    CallTimeoutError,
    ConfigurationError,
    ConnectionClosedError,
    DisconnectedError,
    ErrorCode,
    FailoverNotice,
    HaFailoverError,
    IllegalStateError,
    InvalidURLError,
    LocalError,
    MessageTooLargeError,
    NotConnectedError,
    ProtocolError,
    RemoteError,
    SecurityError,
    StaleAcknowledgeError,
    TransactionOutcomeUnknownError,
    TransactionRolledBackError,
    UnblockedError,
)
from hafailover.message import Message
from hafailover.url import BrokerAddress, FailoverMethod, FailoverPolicy, Protocol, parse_url

if TYPE_CHECKING:
    from hafailover.driver import (
        Browser,
        Connection,
        ConnectionEvent,
        ConnectionStatistics,
        Consumer,
        FailoverCompleted,
        FailoverFailed,
        FailureDetected,
        Producer,
        SendCompletion,
        Session,
        TransactionBlock,
        connect,
    )

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _DRIVER_NAMES:
        from hafailover import driver

        value = getattr(driver, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hafailover' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AckMode",
    "AcknowledgeFailedError",
    "BrokerAddress",
    "BrokerResourceError",
    "Browser",
    "BrowserInvalidatedError",
    "CallTimeoutError",
    "ConfigurationError",
    "Connection",
    "ConnectionClosedError",
    "ConnectionEvent",
    "ConnectionStatistics",
    "Consumer",
    "Destination",
    "DestinationKind",
    "DisconnectedError",
    "ErrorCode",
    "FailoverCompleted",
    "FailoverFailed",
    "FailoverMethod",
    "FailoverNotice",
    "FailoverPolicy",
    "FailoverReport",
    "FailureDetected",
    "HaFailoverError",
    "IllegalStateError",
    "InvalidURLError",
    "LinkReliability",
    "LocalError",
    "Message",
    "MessageTooLargeError",
    "NotConnectedError",
    "Producer",
    "Protocol",
    "ProtocolError",
    "RemoteError",
    "SecurityError",
    "SendCompletion",
    "Session",
    "SessionFailover",
    "StaleAcknowledgeError",
    "TransactionBlock",
    "TransactionOutcomeUnknownError",
    "TransactionRolledBackError",
    "UnblockedError",
    "__version__",
    "connect",
    "parse_destination",
    "parse_url",
]

# The driver (threads, sockets, stomp.py and proton) loads on first use of one of its
# names, so that the pure core (hafailover.core, .ack_modes,
# .tx, ...) imports without either client library: the public names not bound above.
_DRIVER_NAMES = frozenset(name for name in __all__ if name not in globals())
