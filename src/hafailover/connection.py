"""The public API's connection classes, kept importable from their first home.

The threaded driver lives in ``hafailover.driver``; this module only re-exports it.
"""

from hafailover.driver import (
    MAX_MESSAGE_BYTES,
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

__all__ = [
    "MAX_MESSAGE_BYTES",
    "Browser",
    "Connection",
    "ConnectionEvent",
    "ConnectionStatistics",
    "Consumer",
    "FailoverCompleted",
    "FailoverFailed",
    "FailureDetected",
    "Producer",
    "SendCompletion",
    "Session",
    "TransactionBlock",
    "connect",
]
