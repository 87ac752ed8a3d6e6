"""hafailover: client-side failover for STOMP and AMQP 1.0 messaging.

The public surface is what ``__all__`` names; every module behind it may change.
"""

from hafailover.ack_modes import AckMode, LinkReliability
from hafailover.connection import (
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
    connect,
)
from hafailover.destination import Destination, DestinationKind, parse_destination
from hafailover.errors import (
    AcknowledgeFailedError,
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
from hafailover.report import FailoverReport, SessionFailover
from hafailover.url import BrokerAddress, FailoverMethod, FailoverPolicy, Protocol, parse_url

__version__ = "0.1.0"

__all__ = [
    "AckMode",
    "AcknowledgeFailedError",
    "BrokerAddress",
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
    "TransactionOutcomeUnknownError",
    "TransactionRolledBackError",
    "UnblockedError",
    "__version__",
    "connect",
    "parse_destination",
    "parse_url",
]
