"""The connection's failover state machine (rules F1, F2, F3, F10, F12).

Theory of operation
-------------------
A connection is in one of eight states::

    CONNECTING --Connected--> CONNECTED --Lost--> FAILING_OVER --Connected--> RESTORING
        |                                           ^   |                       |
        |                                           |   |--Exhausted--> FAILED  |--Restored-->
        \\--Exhausted--> FAILED                     +---|-------Lost------------+  REATTACHED
                                                        |                          or RECONNECTED
                              any --CloseRequested--> CLOSED

REATTACHED and RECONNECTED serve calls exactly like CONNECTED; they only
remember how the last failover ended. A Lost from any of the three starts a new
failover (or ends in FAILED when reconnection is off).

A failover's new connection first goes through RESTORING: the ``Connected``
event carries the sessions core's ``FailoverPlan`` (what becomes of every call
in flight and every session), and the effect ``ReattachSessions(plan)`` or
``RecreateSessions(plan)`` tells the driver to carry it out on the new link.
Calls still wait (F1) until the driver reports ``Restored``; only then are the
calls the plan gives up released (F3), blocked calls woken and the listener
told (F10). A link lost while it is being restored sends the machine back to
FAILING_OVER: that attempt failed and the schedule goes on.

Every ``Lost`` names the link it is about. A loss can be noticed several
times and in any order (by the reader, by a failed write on an application's
thread, by a heartbeat, by a timeout): only the first notice about the current
link counts; notices about a link already replaced are ignored here, in one
place. While connecting or failing over, a ``Lost`` about another link may be
about the link an attempt is opening right now, which dies before the driver
makes it current: the machine remembers it (``link_known_lost``), and a
``Connected`` for a link known dead is a failed attempt (the machine stays
where it is and the schedule goes on), never a restore on a dead link that
nobody would report again.

A loss the listener has not yet heard about stays owed until its outcome is
known (``loss_untold``): however reconnection ends, by success, exhaustion, or
a driver bug that moved the machine to FAILED, the ``Exhausted`` that ends it
tells the listener DISCONNECT (F2, F10), once.

The machine does no I/O. ``handle(event)`` returns the effects the driver must
carry out, in order; ``admit()`` tells a call that needs the network whether to
proceed, wait (stop the world, F1) or raise. Every (state, event) pair is in
one table; a pair that is not there is a driver bug: the machine moves to the
sticky FAILED state and raises ``FailoverStateError``.

Effects, in the order they are returned:
- F4, F5: sessions are reattached (replay from the window) or recreated, as
  the plan says.
- F3: calls the plan gives up are released with UNBLOCKED once restored
  (after a reattach only those whose answer can never come: the replay
  completes the others).
- F1: calls parked by stop-the-world are woken to re-check ``admit()``.
- F10: the exception listener hears about every loss exactly once, when its
  outcome is known: FAILOVER (with reattached or not) or DISCONNECT.
- F2: when attempts run out, or reconnection ends for any other reason, pending
  and later calls fail with DISCONNECT and the listener hears it.
- F11: a queue browser iterating when the link is lost, or when the connection
  ends, is invalidated (``InvalidateBrowsers``): the rest of its snapshot died with
  the link, whatever the failover does next.
- F12: the first connection failing ends in FAILED with NOT_CONNECTED and no
  listener call (there was no connection to lose).
- Priority failback (failover_method=priority): when a probe of the preferred broker
  gets through while the connection is up elsewhere (``PreferredAnswered``), the
  machine moves back at a clean point only: nothing in flight and no unfinished work
  (the sessions core's ``failback_blocker``); else it stays and the next probe asks
  again. The move is a failover like any other, begun on purpose: the old link is
  closed gracefully (its broker gives back what it had delivered), the reconnect
  schedule starts with the preferred broker, and the listener hears FAILOVER with
  ``failback`` set.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Final, TypeAlias

import attrs

from hafailover.core.inflight import FailoverPlan
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
    "InvalidateBrowsers",
    "LearnTopology",
    "Lost",
    "NotifyListener",
    "PreferredAnswered",
    "ReattachSessions",
    "RecreateSessions",
    "Restored",
    "StartReconnect",
    "TopologyAnnounced",
    "UnblockPendingCalls",
    "WakeBlockedCalls",
]


class FailoverState(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    FAILING_OVER = "failing over"
    RESTORING = "restoring"  # connected again; sessions being reattached or recreated
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
    session expired). ``plan`` is what the sessions core decided for a failover;
    ``link`` names the new link.
    """

    broker: BrokerAddress
    resumed: bool = False
    plan: FailoverPlan | None = None
    link: int = 0


@attrs.frozen
class Lost:
    """A connection died (socket closed, heartbeat missed, I/O error); ``link`` says which."""

    reason: str
    link: int = 0


@attrs.frozen
class Restored:
    """The driver carried out the failover's plan on the new link."""


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


@attrs.frozen
class PreferredAnswered:
    """A probe of the preferred broker (failover_method=priority) got through while the
    connection is on link ``link`` to another one. ``blocker`` says why this is no clean
    point to move (the sessions core's ``failback_blocker``), empty when it is."""

    link: int
    blocker: str = ""


Event: TypeAlias = (
    Connected | Lost | Restored | Exhausted | TopologyAnnounced | CloseRequested | PreferredAnswered
)


# --- effects (outputs) --------------------------------------------------------


@attrs.frozen
class StartReconnect:
    """Run the reconnect schedule in the background."""


@attrs.frozen
class CancelReconnect:
    """Stop the reconnect schedule (close() during failover)."""


@attrs.frozen
class CloseTransport:
    """Close the current or just-made transport: abort it (a dead or unwanted link), or
    close it ``gracefully`` (a failback: the broker ends the session and takes back what
    it had delivered)."""

    gracefully: bool = False


@attrs.frozen
class LearnTopology:
    endpoints: tuple[tuple[str, int], ...]


@attrs.frozen
class ReattachSessions:
    """Carry out ``plan`` on a server that kept the session: replay the window after
    its last-received id, settle what it had (F4)."""

    plan: FailoverPlan | None = None


@attrs.frozen
class RecreateSessions:
    """Carry out ``plan`` on a new session: recreate consumers and temporary queues,
    resend what carries a duplicate id (F5, F13)."""

    plan: FailoverPlan | None = None


@attrs.frozen
class UnblockPendingCalls:
    """Release the calls ``tokens`` (the plan's, given up) with this code (F3)."""

    code: ErrorCode
    tokens: tuple[int, ...] = ()


@attrs.frozen
class FailPendingCalls:
    """Fail waiting and parked calls for good with this code (F2, close)."""

    code: ErrorCode


@attrs.frozen
class InvalidateBrowsers:
    """Queue browsers iterating now must raise BrowserInvalidatedError (F11)."""


@attrs.frozen
class WakeBlockedCalls:
    """Wake calls parked by stop-the-world so they re-check admission (F1)."""


@attrs.frozen
class NotifyListener:
    """Tell the exception listener (F10)."""

    code: ErrorCode
    reattached: bool = False
    reason: str = ""
    failback: bool = False  # a move back to the preferred broker (failover_method=priority)


Effect: TypeAlias = (
    StartReconnect
    | CancelReconnect
    | CloseTransport
    | LearnTopology
    | ReattachSessions
    | RecreateSessions
    | UnblockPendingCalls
    | FailPendingCalls
    | InvalidateBrowsers
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


def _attempt_opened(handler: _Handler) -> _Handler:
    """A Connected about a link already reported lost is a failed attempt: the machine
    stays where it is (the driver's attempt fails and the schedule makes the next one)."""

    def handle(machine: FailoverMachine, event: Event) -> _Outcome:
        assert isinstance(event, Connected)
        if event.link in machine.lost_links:
            return [], machine.state
        machine.lost_links.clear()
        return handler(machine, event)

    return handle


def _lost_while_connecting(machine: FailoverMachine, event: Event) -> _Outcome:
    """While no link is current, a Lost may be about the link an attempt is opening:
    remember it, so that the attempt cannot restore a dead link. (A notice about the
    link the failover started from changes nothing: it was counted.)"""
    assert isinstance(event, Lost)
    if event.link != machine.link or machine.state is S.CONNECTING:
        machine.lost_links.add(event.link)
    return [], machine.state


def _first_connected(machine: FailoverMachine, event: Event) -> _Outcome:
    assert isinstance(event, Connected)
    machine.ever_connected = True
    machine.broker = event.broker
    machine.link = event.link
    return [WakeBlockedCalls()], S.CONNECTED


def _stale_or(handler: _Handler) -> _Handler:
    """A Lost about a link other than the current one changes nothing (F1-F3): the loss
    of a replaced link was handled when it was first noticed."""

    def handle(machine: FailoverMachine, event: Event) -> _Outcome:
        assert isinstance(event, Lost)
        if event.link != machine.link:
            return [], machine.state
        return handler(machine, event)

    return handle


def _initial_exhausted(machine: FailoverMachine, event: Event) -> _Outcome:
    return [
        FailPendingCalls(ErrorCode.NOT_CONNECTED),
        InvalidateBrowsers(),
        WakeBlockedCalls(),
    ], S.FAILED


def _lost_while_up(machine: FailoverMachine, event: Event) -> _Outcome:
    assert isinstance(event, Lost)
    if machine.reconnect_enabled:
        machine.failovers_started += 1
        machine.loss_untold = True
        return [InvalidateBrowsers(), StartReconnect()], S.FAILING_OVER
    return [
        CloseTransport(),
        FailPendingCalls(ErrorCode.DISCONNECT),
        InvalidateBrowsers(),
        WakeBlockedCalls(),
        NotifyListener(ErrorCode.DISCONNECT, reason=event.reason),
    ], S.FAILED


def _preferred_answered(machine: FailoverMachine, event: Event) -> _Outcome:
    """Move back to the preferred broker, at a clean point only; a probe about a link
    already replaced, or made while work is unfinished, changes nothing."""
    assert isinstance(event, PreferredAnswered)
    if event.link != machine.link or event.blocker or not machine.reconnect_enabled:
        return [], machine.state
    machine.failovers_started += 1
    machine.loss_untold = True
    machine.failing_back = True
    return [CloseTransport(gracefully=True), InvalidateBrowsers(), StartReconnect()], (
        S.FAILING_OVER
    )


def _failed_over(machine: FailoverMachine, event: Event) -> _Outcome:
    assert isinstance(event, Connected)
    machine.broker = event.broker
    machine.link = event.link
    machine.restoring = event
    if event.resumed:
        return [ReattachSessions(event.plan)], S.RESTORING
    return [RecreateSessions(event.plan)], S.RESTORING


def _restored(machine: FailoverMachine, event: Event) -> _Outcome:
    connected = machine.restoring
    assert connected is not None
    machine.restoring = None
    machine.loss_untold = False
    machine.failovers_completed += 1
    plan = connected.plan
    effects: list[Effect] = []
    if plan is not None and plan.unblock:
        effects.append(UnblockPendingCalls(ErrorCode.UNBLOCKED, plan.unblock))
    effects += [
        WakeBlockedCalls(),
        NotifyListener(
            ErrorCode.FAILOVER, reattached=connected.resumed, failback=machine.failing_back
        ),
    ]
    machine.failing_back = False
    return effects, S.REATTACHED if connected.resumed else S.RECONNECTED


def _lost_while_restoring(machine: FailoverMachine, event: Event) -> _Outcome:
    # The new link died before its sessions were restored: that attempt failed, and the
    # reconnect schedule, still running, makes the next one.
    machine.restoring = None
    return [], S.FAILING_OVER


def _failover_exhausted(machine: FailoverMachine, event: Event) -> _Outcome:
    assert isinstance(event, Exhausted)
    machine.loss_untold = False
    machine.restoring = None
    machine.failing_back = False
    return [
        FailPendingCalls(ErrorCode.DISCONNECT),
        InvalidateBrowsers(),
        WakeBlockedCalls(),
        NotifyListener(ErrorCode.DISCONNECT, reason=event.reason),
    ], S.FAILED


def _exhausted_after_failure(machine: FailoverMachine, event: Event) -> _Outcome:
    """FAILED already. If it got there in the middle of a failover (an illegal event: a
    driver bug), the loss was never told: reconnection ending tells it now (F2, F10)."""
    if not machine.loss_untold:
        return [], machine.state
    return _failover_exhausted(machine, event)


def _close(effects: list[Effect]) -> _Handler:
    def handler(machine: FailoverMachine, event: Event) -> _Outcome:
        return [
            *effects,
            FailPendingCalls(ErrorCode.CLOSED),
            InvalidateBrowsers(),
            WakeBlockedCalls(),
        ], S.CLOSED

    return handler


_TABLE: Final[Mapping[tuple[FailoverState, type], _Handler]] = {
    (S.CONNECTING, Connected): _attempt_opened(_first_connected),
    # The schedule reports failed attempts itself; a Lost here is a transport
    # that died during the handshake or right after it: that attempt failed.
    (S.CONNECTING, Lost): _lost_while_connecting,
    (S.CONNECTING, Exhausted): _initial_exhausted,
    (S.CONNECTING, TopologyAnnounced): _learn,
    (S.CONNECTING, CloseRequested): _close([CancelReconnect()]),
    **{(up, Lost): _stale_or(_lost_while_up) for up in _UP},
    **{(up, TopologyAnnounced): _learn for up in _UP},
    **{(up, CloseRequested): _close([CloseTransport()]) for up in _UP},
    **{(up, PreferredAnswered): _preferred_answered for up in _UP},
    (S.FAILING_OVER, Connected): _attempt_opened(_failed_over),
    (S.FAILING_OVER, Lost): _lost_while_connecting,
    (S.FAILING_OVER, Exhausted): _failover_exhausted,
    (S.FAILING_OVER, TopologyAnnounced): _learn,
    (S.FAILING_OVER, CloseRequested): _close([CancelReconnect()]),
    (S.RESTORING, Restored): _restored,
    (S.RESTORING, Lost): _stale_or(_lost_while_restoring),
    (S.RESTORING, Exhausted): _failover_exhausted,
    (S.RESTORING, TopologyAnnounced): _learn,
    (S.RESTORING, CloseRequested): _close([CancelReconnect(), CloseTransport()]),
    # Terminal states absorb late events; a transport that finished connecting
    # after the end is closed at once.
    **{(end, Connected): _stay([CloseTransport()]) for end in (S.FAILED, S.CLOSED)},
    **{(end, Lost): _stay([]) for end in (S.FAILED, S.CLOSED)},
    **{(end, Restored): _stay([]) for end in (S.FAILED, S.CLOSED)},
    (S.FAILED, Exhausted): _exhausted_after_failure,
    (S.CLOSED, Exhausted): _stay([]),
    **{(end, TopologyAnnounced): _stay([]) for end in (S.FAILED, S.CLOSED)},
    # A probe answered just as the connection went down or began to move: nothing to do.
    **{
        (state, PreferredAnswered): _stay([])
        for state in (S.CONNECTING, S.FAILING_OVER, S.RESTORING, S.FAILED, S.CLOSED)
    },
    (S.FAILED, CloseRequested): lambda machine, event: ([WakeBlockedCalls()], S.CLOSED),
    (S.CLOSED, CloseRequested): _stay([]),
}


class FailoverMachine:
    """The state of one logical connection across any number of failovers."""

    __slots__ = (
        "broker",
        "ever_connected",
        "failing_back",
        "failovers_completed",
        "failovers_started",
        "link",
        "loss_untold",
        "lost_links",
        "reconnect_enabled",
        "restoring",
        "state",
    )

    def __init__(self, *, reconnect_enabled: bool) -> None:
        self.state = FailoverState.CONNECTING
        self.reconnect_enabled = reconnect_enabled
        self.ever_connected = False
        self.broker: BrokerAddress | None = None
        self.failovers_started = 0
        self.failovers_completed = 0
        self.link = 0  # the current link's serial
        self.restoring: Connected | None = None  # the connection being restored
        # Links reported lost while not current (an attempt's link that died while being
        # opened), until a link is restored; and whether a loss awaits its listener call.
        self.lost_links: set[int] = set()
        self.loss_untold = False
        self.failing_back = False  # the failover under way is a priority failback

    @property
    def is_up(self) -> bool:
        return self.state in _UP

    @property
    def finished(self) -> bool:
        """FAILED or CLOSED: no attempt can bring the connection back."""
        return self.state in (FailoverState.FAILED, FailoverState.CLOSED)

    def link_known_lost(self, link: int) -> bool:
        """Was ``link``, not yet current, reported lost? Then an attempt that opened it
        failed: it must not be planned for or restored (asked before the plan is made,
        since making one changes the sessions core)."""
        return link in self.lost_links

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
        if state in (FailoverState.FAILING_OVER, FailoverState.RESTORING, FailoverState.CONNECTING):
            return Admission.WAIT, None
        if state is FailoverState.CLOSED:
            return Admission.RAISE, ErrorCode.CLOSED
        if not self.ever_connected:
            return Admission.RAISE, ErrorCode.NOT_CONNECTED
        return Admission.RAISE, ErrorCode.DISCONNECT
