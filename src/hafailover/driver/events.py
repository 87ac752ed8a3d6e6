"""What a connection tells applications besides errors: lifecycle events and statistics.

Values only: no I/O.
"""

from __future__ import annotations

import attrs

from hafailover.core.report import FailoverReport

__all__ = [
    "ConnectionEvent",
    "ConnectionStatistics",
    "FailoverCompleted",
    "FailoverFailed",
    "FailureDetected",
]


@attrs.frozen
class FailureDetected:
    """The connection to ``broker`` was lost; failover starts (or, if disabled, it ends)."""

    broker: str
    reason: str


@attrs.frozen
class FailoverCompleted:
    """Failover succeeded; ``report`` says what it did."""

    report: FailoverReport


@attrs.frozen
class FailoverFailed:
    """Failover gave up: the connection is disconnected for good."""

    report: FailoverReport


ConnectionEvent = FailureDetected | FailoverCompleted | FailoverFailed


@attrs.frozen
class ConnectionStatistics:
    """Counters since the connection was made."""

    sent: int  # messages handed to the broker (including resends)
    confirmed: int  # sends the broker confirmed
    failovers: int  # failovers completed
    reattached: int  # of which reattached the session on the same server
    replayed: int  # commands replayed from the confirmation window
    resent: int  # confirmed sends resent with their duplicate id after a reconnect
    in_doubt: int  # sends released with UNBLOCKED: may or may not have been stored
    received: int  # messages handed to the application
    duplicates_dropped: int = 0  # acknowledged and dropped by consumers' duplicate windows
