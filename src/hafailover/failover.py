"""The connection's failover state machine (rules F1, F2, F3, F10, F12).

Theory of operation
-------------------
A connection is in one of seven states::

    CONNECTING --Connected--> CONNECTED --Lost--> FAILING_OVER --Connected(resumed)--> REATTACHED
        |                                             |      \\--Connected(new)-----> RECONNECTED
        |                                             |--Exhausted--> FAILED
        \\--Exhausted--> FAILED         any --CloseRequested--> CLOSED

REATTACHED and RECONNECTED serve calls exactly like CONNECTED; they only
remember how the last failover ended. A Lost from any of the three starts a new
failover (or ends in FAILED when reconnection is off).

The machine does no I/O. ``handle(event)`` returns the effects the driver must
carry out, in order; ``admit()`` tells a call that needs the network whether to
proceed, wait (stop the world, F1) or raise. Every (state, event) pair is in
one table; a pair that is not there is a driver bug: the machine moves to the
sticky FAILED state and raises ``FailoverStateError``.

Effects, in the order they are returned:
- F3: calls waiting for a broker reply are released with UNBLOCKED after a
  reconnect; after a reattach the replay completes them, so they keep waiting.
- F5: sessions are reattached (replay from the window) or recreated.
- F1: calls parked by stop-the-world are woken to re-check ``admit()``.
- F10: the exception listener hears about every loss exactly once, when its
  outcome is known: FAILOVER (with reattached or not) or DISCONNECT.
- F2: when attempts run out, pending and later calls fail with DISCONNECT.
- F12: the first connection failing ends in FAILED with NOT_CONNECTED and no
  listener call (there was no connection to lose).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Final, TypeAlias

import attrs

from hafailover.errors import ErrorCode, IllegalStateError
from hafailover.url import BrokerAddress

__all__ = [
    "Admission",
    "CancelReconnect",
    "CloseRequested",
    "CloseTransport",
    "Connected",
    "Effect",
    "Event",
    "Exhausted",
    "FailPendingCalls",
    "FailoverMachine",
    "FailoverState",
    "FailoverStateError",
    "LearnTopology",
    "Lost",
    "NotifyListener",
    "ReattachSessions",
    "RecreateSessions",
    "StartReconnect",
    "TopologyAnnounced",
    "UnblockPendingCalls",
    "WakeBlockedCalls",
]


class FailoverState(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    FAILING_OVER = "failing over"
    REATTACHED = "reattached"
    RECONNECTED = "reconnected"
    FAILED = "failed"
    CLOSED = "closed"


_UP: Final = frozenset(
    {FailoverState.CONNECTED, FailoverState.REATTACHED, FailoverState.RECONNECTED}
)


class FailoverStateError(IllegalStateError):
    """The driver fed an event that makes no sense in the current state."""


# --- events (inputs) ----------------------------------------------------------


@attrs.frozen
class Connected:
    """A transport is up and the protocol handshake is done.

    ``resumed`` is true when the server still held the sessions and agreed to
    a reattach; false for a fresh session (first connect, other server, or the
    session expired).
    """

    broker: BrokerAddress
    resumed: bool = False


@attrs.frozen
class Lost:
    """The established connection died (socket closed, heartbeat missed, I/O error)."""

    reason: str


@attrs.frozen
class Exhausted:
    """The reconnect schedule made every attempt it was allowed, all failed."""

    attempts: int
    reason: str


@attrs.frozen
class TopologyAnnounced:
    """The broker told us where the live and backup nodes are."""

    endpoints: tuple[tuple[str, int], ...]


@attrs.frozen
class CloseRequested:
    """The application called close()."""


Event: TypeAlias = Connected | Lost | Exhausted | TopologyAnnounced | CloseRequested


# --- effects (outputs) --------------------------------------------------------


@attrs.frozen
class StartReconnect:
    """Run the reconnect schedule in the background."""


@attrs.frozen
class CancelReconnect:
    """Stop the reconnect schedule (close() during failover)."""


@attrs.frozen
class CloseTransport:
    """Close the current or just-made transport."""


@attrs.frozen
class LearnTopology:
    endpoints: tuple[tuple[str, int], ...]


@attrs.frozen
class ReattachSessions:
    """Replay each session's window after the server's last-received id (F4)."""


@attrs.frozen
class RecreateSessions:
    """Recreate sessions, producers, consumers and temporary queues (F5)."""


@attrs.frozen
class UnblockPendingCalls:
    """Release every call waiting for a broker reply with this code (F3)."""

    code: ErrorCode


@attrs.frozen
class FailPendingCalls:
    """Fail waiting and parked calls for good with this code (F2, close)."""

    code: ErrorCode


@attrs.frozen
class WakeBlockedCalls:
    """Wake calls parked by stop-the-world so they re-check admission (F1)."""


@attrs.frozen
class NotifyListener:
    """Tell the exception listener (F10)."""

    code: ErrorCode
    reattached: bool = False
    reason: str = ""


Effect: TypeAlias = (
    StartReconnect
    | CancelReconnect
    | CloseTransport
    | LearnTopology
    | ReattachSessions
    | RecreateSessions
    | UnblockPendingCalls
    | FailPendingCalls
    | WakeBlockedCalls
    | NotifyListener
)


class Admission(enum.Enum):
    PROCEED = "proceed"
    WAIT = "wait"  # stop the world: park until the state changes
    RAISE = "raise"


# --- the table ----------------------------------------------------------------

_Outcome: TypeAlias = tuple[list[Effect], FailoverState]
_Handler: TypeAlias = Callable[["FailoverMachine", Event], _Outcome]

S = FailoverState


def _stay(effects: list[Effect]) -> _Handler:
    return lambda machine, event: (list(effects), machine.state)


def _learn(machine: FailoverMachine, event: Event) -> _Outcome:
    assert isinstance(event, TopologyAnnounced)
    return [LearnTopology(event.endpoints)], machine.state


def _first_connected(machine: FailoverMachine, event: Event) -> _Outcome:
    assert isinstance(event, Connected)
    machine.ever_connected = True
    machine.broker = event.broker
    return [WakeBlockedCalls()], S.CONNECTED


def _initial_exhausted(machine: FailoverMachine, event: Event) -> _Outcome:
    return [FailPendingCalls(ErrorCode.NOT_CONNECTED), WakeBlockedCalls()], S.FAILED


def _lost_while_up(machine: FailoverMachine, event: Event) -> _Outcome:
    assert isinstance(event, Lost)
    if machine.reconnect_enabled:
        machine.failovers_started += 1
        return [StartReconnect()], S.FAILING_OVER
    return [
        CloseTransport(),
        FailPendingCalls(ErrorCode.DISCONNECT),
        WakeBlockedCalls(),
        NotifyListener(ErrorCode.DISCONNECT, reason=event.reason),
    ], S.FAILED


def _failed_over(machine: FailoverMachine, event: Event) -> _Outcome:
    assert isinstance(event, Connected)
    machine.broker = event.broker
    machine.failovers_completed += 1
    if event.resumed:
        return [
            ReattachSessions(),
            WakeBlockedCalls(),
            NotifyListener(ErrorCode.FAILOVER, reattached=True),
        ], S.REATTACHED
    return [
        UnblockPendingCalls(ErrorCode.UNBLOCKED),
        RecreateSessions(),
        WakeBlockedCalls(),
        NotifyListener(ErrorCode.FAILOVER, reattached=False),
    ], S.RECONNECTED


def _failover_exhausted(machine: FailoverMachine, event: Event) -> _Outcome:
    assert isinstance(event, Exhausted)
    return [
        FailPendingCalls(ErrorCode.DISCONNECT),
        WakeBlockedCalls(),
        NotifyListener(ErrorCode.DISCONNECT, reason=event.reason),
    ], S.FAILED


def _close(effects: list[Effect]) -> _Handler:
    def handler(machine: FailoverMachine, event: Event) -> _Outcome:
        return [*effects, FailPendingCalls(ErrorCode.CLOSED), WakeBlockedCalls()], S.CLOSED

    return handler


_TABLE: Final[Mapping[tuple[FailoverState, type], _Handler]] = {
    (S.CONNECTING, Connected): _first_connected,
    # The schedule reports failed attempts itself; a Lost here is a transport
    # that died during the handshake, which is just another failed attempt.
    (S.CONNECTING, Lost): _stay([]),
    (S.CONNECTING, Exhausted): _initial_exhausted,
    (S.CONNECTING, TopologyAnnounced): _learn,
    (S.CONNECTING, CloseRequested): _close([CancelReconnect()]),
    **{(up, Lost): _lost_while_up for up in _UP},
    **{(up, TopologyAnnounced): _learn for up in _UP},
    **{(up, CloseRequested): _close([CloseTransport()]) for up in _UP},
    (S.FAILING_OVER, Connected): _failed_over,
    (S.FAILING_OVER, Lost): _stay([]),
    (S.FAILING_OVER, Exhausted): _failover_exhausted,
    (S.FAILING_OVER, TopologyAnnounced): _learn,
    (S.FAILING_OVER, CloseRequested): _close([CancelReconnect()]),
    # Terminal states absorb late events; a transport that finished connecting
    # after the end is closed at once.
    **{(end, Connected): _stay([CloseTransport()]) for end in (S.FAILED, S.CLOSED)},
    **{(end, Lost): _stay([]) for end in (S.FAILED, S.CLOSED)},
    **{(end, Exhausted): _stay([]) for end in (S.FAILED, S.CLOSED)},
    **{(end, TopologyAnnounced): _stay([]) for end in (S.FAILED, S.CLOSED)},
    (S.FAILED, CloseRequested): lambda machine, event: ([WakeBlockedCalls()], S.CLOSED),
    (S.CLOSED, CloseRequested): _stay([]),
}


class FailoverMachine:
    """The state of one logical connection across any number of failovers."""

    __slots__ = (
        "broker",
        "ever_connected",
        "failovers_completed",
        "failovers_started",
        "reconnect_enabled",
        "state",
    )

    def __init__(self, *, reconnect_enabled: bool) -> None:
        self.state = FailoverState.CONNECTING
        self.reconnect_enabled = reconnect_enabled
        self.ever_connected = False
        self.broker: BrokerAddress | None = None
        self.failovers_started = 0
        self.failovers_completed = 0

    @property
    def is_up(self) -> bool:
        return self.state in _UP

    def handle(self, event: Event) -> list[Effect]:
        """Apply one event; return the effects to carry out, in order."""
        handler = _TABLE.get((self.state, type(event)))
        if handler is None:
            previous = self.state
            self.state = FailoverState.FAILED
            raise FailoverStateError(
                f"{type(event).__name__} is not valid in state {previous.value!r}"
            )
        effects, self.state = handler(self, event)
        return effects

    def admit(self) -> tuple[Admission, ErrorCode | None]:
        """May a call that needs the network go ahead now? (F1, F2)"""
        state = self.state
        if state in _UP:
            return Admission.PROCEED, None
        if state is FailoverState.FAILING_OVER or state is FailoverState.CONNECTING:
            return Admission.WAIT, None
        if state is FailoverState.CLOSED:
            return Admission.RAISE, ErrorCode.CLOSED
        if not self.ever_connected:
            return Admission.RAISE, ErrorCode.NOT_CONNECTED
        return Admission.RAISE, ErrorCode.DISCONNECT
