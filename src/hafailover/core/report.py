"""The failover report: what one failover did, for the application to read.

Every failover, successful or not, produces one ``FailoverReport``: where the
connection was and where it went, whether sessions were reattached or
recreated, which commands were replayed or resent, which sends are in doubt,
which acknowledgements were dropped as stale, which transactions were rolled
back, and what the broker could not do (a broker without reattach or
duplicate detection degrades to plain reconnect and is named here, never
silently). Sessions contribute their parts through ``SessionFailover``; the
driver folds them into the report. Values only: no I/O.
"""

from __future__ import annotations

import attrs

from hafailover.errors import ErrorCode

__all__ = ["FailoverReport", "SessionFailover"]


@attrs.frozen
class SessionFailover:
    """One session's part of a failover."""

    session_id: int
    replayed: tuple[int, ...] = ()  # command ids replayed after a reattach
    resent: tuple[str, ...] = ()  # message ids sent again on a new session (duplicate-id safe)
    in_doubt: tuple[str, ...] = ()  # message ids that may or may not have been stored
    stale_acks: tuple[str, ...] = ()  # deliveries whose acknowledgement was dropped
    rolled_back: bool = False  # the session's transaction became rollback-only or rolled back
    dirty: bool = False


@attrs.frozen
class FailoverReport:
    """The outcome of one connection failure."""

    code: ErrorCode  # FAILOVER or DISCONNECT
    reason: str  # why the connection was lost
    from_broker: str  # redacted address
    to_broker: str | None = None
    reattached: bool = False
    # a priority failback: the client moved back to its preferred broker on purpose
    failback: bool = False
    attempts: int = 0
    duration: float = 0.0  # seconds from detection to outcome
    sessions: tuple[SessionFailover, ...] = ()
    # What the broker lacked, e.g. "reattach", "duplicate detection".
    degraded: tuple[str, ...] = ()

    @property
    def replayed(self) -> int:
        return sum(len(s.replayed) for s in self.sessions)

    @property
    def resent(self) -> tuple[str, ...]:
        return tuple(m for s in self.sessions for m in s.resent)

    @property
    def in_doubt(self) -> tuple[str, ...]:
        return tuple(m for s in self.sessions for m in s.in_doubt)

    @property
    def stale_acks(self) -> tuple[str, ...]:
        return tuple(t for s in self.sessions for t in s.stale_acks)

    @property
    def transactions_rolled_back(self) -> tuple[int, ...]:
        return tuple(s.session_id for s in self.sessions if s.rolled_back)

    def summary(self) -> str:
        """One log line."""
        if self.code is ErrorCode.DISCONNECT:
            return (
                f"failover failed after {self.attempts} attempt(s) in {self.duration:.3f}s: "
                f"disconnected from {self.from_broker} ({self.reason})"
            )
        how = "reattached" if self.reattached else "reconnected"
        if self.failback:
            how = f"failback {how}"
        parts = [
            f"failover {how} {self.from_broker} -> {self.to_broker} "
            f"in {self.duration:.3f}s ({self.attempts} attempt(s))",
            f"replayed {self.replayed}",
            f"resent {len(self.resent)}",
            f"in doubt {len(self.in_doubt)}",
            f"stale acks {len(self.stale_acks)}",
            f"transactions rolled back {len(self.transactions_rolled_back)}",
        ]
        if self.degraded:
            parts.append("broker lacks " + ", ".join(self.degraded))
        return "; ".join(parts)
