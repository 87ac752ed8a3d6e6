"""The sessions core: every call waiting for the broker, and what a failover does to it.

Theory of operation
-------------------
The driver registers each call that waits for the broker here before it writes it (a
confirmed send, a transacted transfer the broker settles, an acknowledge, a commit or
rollback, a subscription, a frame written only for its receipt) and gets a *token*; once
written, the call learns the link it went out on, its command id in the confirmation window
and whether any later receipt confirms it too (cumulative receipts, in frame order). The
broker's answers come back as ``answered(token)``: the core says which calls are done.

The core also owns the confirmation window (F4), the flow control of links without one, and
each session's acknowledge-mode rules and transaction state (F6-F9). So when the connection
comes back after a loss, one pure decision, ``failover()``, says what becomes of everything
in flight, as a frozen ``FailoverPlan`` the driver carries out without deciding anything:

==========================  ===========================================  ===================
call at the loss             reattached (server kept the session, F4)     reconnected (F5)
==========================  ===========================================  ===================
server received it           done (its answer was lost); a resendable     -
(id <= last_received)        send is sent again (duplicate id, F13); a
                             commit is UNBLOCKED, its transaction's
                             rules say what commit() raises (F3)
server did not               replayed from the window; keeps waiting      -
never written (write failed) a send is sent; anything else UNBLOCKED     -
confirmed send, dup id       -                                            resent (F13)
other                        -                                            UNBLOCKED (F3)
==========================  ===========================================  ===================

Window commands that no call waits for (sends made with ``confirm=False``) follow the window:
replayed on a reattach; on a reconnect resent when they carry a duplicate id, else reported
in doubt. Each session's rules decide its deliveries and transaction (``AckRules.failover``),
with what the reattach showed: whether transacted work was lost and whether the server got
a commit (F9, F3), or what the reconnect lost: the acknowledges still waiting (F6).

Pure: no sockets, threads or clocks; the driver holds the lock around every call.
"""

from __future__ import annotations

import contextlib
import enum
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs

from hafailover.ack_modes import (
    AckMode,
    AckRules,
    FailoverOutcome,
    rules_for,
)
from hafailover.core.report import SessionFailover
from hafailover.core.window import Command, ConfirmationWindow, ReattachImpossibleError
from hafailover.errors import (
    CallTimeoutError,
    HaFailoverError,
    NotConnectedError,
    UnblockedError,
)

__all__ = [
    "Answer",
    "Call",
    "CallKind",
    "FailoverPlan",
    "SessionsCore",
]

# With cumulative receipts, ask for a receipt at least every this many confirmed sends or
# AUTO acknowledges, and whenever somebody waits.
RECEIPT_EVERY: Final = 64


class CallKind(enum.Enum):
    SEND = "send"  # a confirmed send
    TRANSFER = "transfer"  # a transacted send the broker settles; the commit waits for it
    ACK = "acknowledge"
    END = "end"  # a commit or rollback
    SUBSCRIBE = "subscribe"
    SYNC = "sync"  # a frame written only for its receipt


@attrs.define(slots=True)
class Call:
    """One call waiting for the broker."""

    kind: CallKind
    session_id: int | None
    resendable: bool = False  # a send stamped with a duplicate id (F13)
    size: int = 0  # bytes held against the window of a link without one
    message_id: str = ""
    subscription: str = ""  # SUBSCRIBE, ACK: the consumer's subscription
    tag: str = ""  # ACK: the delivery acknowledged
    link: int = 0  # serial of the link it was written on; 0 before it was
    command_id: int = -1  # its id in the confirmation window; -1 without one
    cumulative: bool = False  # any later receipt confirms it too
    commit: bool = False  # END: a commit (else a rollback)


@attrs.frozen
class Answer:
    """Calls a broker answer ended."""

    done: tuple[int, ...]  # tokens confirmed
    failed: tuple[int, ...] = ()  # tokens refused (the error is the answer's)
    refused_subscriptions: tuple[str, ...] = ()  # subscriptions the broker refused


@attrs.frozen
class FailoverPlan:
    """Everything a failover does to the calls in flight and to each session."""

    reattached: bool
    replay: tuple[Command[Any], ...] = ()  # window commands to write again, in order
    resend: tuple[int, ...] = ()  # tokens to send again on the new link, in order
    resend_frames: tuple[Command[Any], ...] = ()  # window-only sends to write again
    complete: tuple[int, ...] = ()  # tokens the server had: done
    unblock: tuple[int, ...] = ()  # released with UNBLOCKED when the failover completes
    outcomes: Mapping[int, FailoverOutcome] = attrs.field(factory=dict)  # by session id
    sessions: tuple[SessionFailover, ...] = ()  # the report's parts


class SessionsCore:
    """Calls in flight, the confirmation window and the rules of every session."""

    def __init__(self, window_size: int) -> None:
        self.window: ConfirmationWindow[Any] = ConfirmationWindow(window_size)
        self.calls: dict[int, Call] = {}
        self.rules: dict[int, AckRules] = {}
        self._next_token = 1
        # Cumulative receipts: calls in wire order, and how many confirmed sends were
        # written since a frame last asked for a receipt.
        self._receipt_order: deque[int] = deque()
        self._unreceipted = 0
        # The last window command a receipt covered (the broker had every command up to
        # it): a reconnect resends none of those.
        self._receipted_through = -1
        # Links without a window: bytes of confirmed sends still waiting, held to its size.
        self.unconfirmed_bytes = 0
        # Counters for the connection's statistics.
        self.sent = 0
        self.confirmed = 0
        self.replayed = 0
        self.resent = 0

    # --- sessions -----------------------------------------------------------------------

    def open_session(self, session_id: int, mode: AckMode) -> AckRules:
        rules = rules_for(mode, session_id)
        self.rules[session_id] = rules
        return rules

    def close_session(self, session_id: int) -> None:
        self.rules.pop(session_id, None)

    def failback_blocker(self) -> str | None:
        """Why now is no clean point to move to another broker on purpose (a priority
        failback): a call waits for the broker, or a session has unfinished work (an open
        transaction, unacknowledged CLIENT messages). None when nothing would be cut: the
        move then loses nothing a reconnect would report."""
        if self.calls:
            return f"{len(self.calls)} call(s) wait for the broker"
        unreceipted = self.unreceipted_commands()
        if unreceipted:
            return f"{unreceipted} command(s) written since the broker's last receipt"
        for rules in self.rules.values():
            unfinished = rules.unfinished()
            if unfinished is not None:
                return unfinished
        return None

    def unreceipted_commands(self) -> int:
        """Window commands no receipt has covered yet (sends made with confirm=False,
        acknowledges nobody waits for): a sync frame's receipt covers them."""
        return sum(1 for c in self.window if c.command_id > self._receipted_through)

    def committing(self, session_id: int) -> bool:
        """A commit of this session waits for the broker."""
        return any(
            c.kind is CallKind.END and c.commit and c.session_id == session_id
            for c in self.calls.values()
        )

    # --- calls --------------------------------------------------------------------------

    def call(
        self,
        kind: CallKind,
        session_id: int | None,
        *,
        resendable: bool = False,
        size: int = 0,
        message_id: str = "",
        subscription: str = "",
        tag: str = "",
        commit: bool = False,
    ) -> int:
        """Register a call about to be written; returns its token. An acknowledge names
        its ``tag``, and its message's ``message_id`` when the sender gave one and the
        acknowledge is pipelined (F6)."""
        token = self._next_token
        self._next_token = token + 1
        self.calls[token] = Call(
            kind,
            session_id,
            resendable=resendable,
            size=size,
            message_id=message_id,
            subscription=subscription,
            tag=tag,
            commit=commit,
        )
        self.unconfirmed_bytes += size
        return token

    def asks_receipt(self, token: int | None, *, windowed: bool, waited_for: bool) -> bool:
        """Whether the frame of ``token`` asks for a receipt: always without cumulative
        receipts; with them, when somebody waits for it or every RECEIPT_EVERY calls."""
        if token is None:
            return False
        return not windowed or waited_for or self._unreceipted >= RECEIPT_EVERY - 1

    def written(
        self, token: int, *, link: int, command_id: int, windowed: bool, asked: bool
    ) -> None:
        """The call's frame left on ``link`` (``asked``: it carries its own receipt)."""
        call = self.calls.get(token)
        if call is None:
            return
        call.link = link
        call.command_id = command_id
        # In frame order, a receipt confirms the durable work of every frame before it.
        if call.kind in (CallKind.SEND, CallKind.SYNC, CallKind.ACK) and windowed:
            call.cumulative = True
            self._receipt_order.append(token)
            self._unreceipted = 0 if asked else self._unreceipted + 1

    def sync_needed(self) -> bool:
        """Somebody waits for a cumulative confirmation no written frame has asked for:
        write a sync frame (a SYNC call) that asks for one."""
        return self._unreceipted > 0

    def count_sent(self) -> None:
        """A message left for the broker (statistics)."""
        self.sent += 1

    def answered(self, token: int, error: HaFailoverError | None = None) -> Answer:
        """The broker answered ``token``: confirmed it, or ended it with ``error``."""
        call = self.calls.get(token)
        if call is None:
            return Answer(())
        if error is not None:
            self._end(token)
            # A subscription the broker refused is gone for good, so a reconnect does not
            # ask again; one cut by the connection or a timeout is the failover's to redo.
            refused = call.kind is CallKind.SUBSCRIBE and not isinstance(
                error, NotConnectedError | UnblockedError | CallTimeoutError
            )
            return Answer((), (token,), (call.subscription,) if refused else ())
        if call.cumulative:
            self._receipted_through = max(self._receipted_through, call.command_id)
            done: list[int] = []
            order = self._receipt_order
            while order:
                first = order.popleft()
                if self._end(first, confirmed=True):
                    done.append(first)
                if first == token:
                    break
            return Answer(tuple(done))
        self._end(token, confirmed=True)
        return Answer((token,))

    def abandon(self, token: int) -> Call | None:
        """The call ends without the broker: its write failed, or it timed out."""
        call = self.calls.get(token)
        if call is not None:
            self._end(token)
        return call

    def _end(self, token: int, *, confirmed: bool = False) -> bool:
        call = self.calls.pop(token, None)
        if call is None:
            return False
        self.unconfirmed_bytes -= call.size
        if confirmed and call.kind is CallKind.SEND:
            self.confirmed += 1
        return True

    def confirmed_upto(self, upto: int) -> bool:
        """The broker confirmed window commands up to ``upto``; True if room was freed."""
        try:
            return self.window.confirm(upto) > 0
        except ReattachImpossibleError:
            return False  # a confirmation of a command never sent: ignored

    def has_room(self, size: int, *, windowed: bool) -> bool:
        """Flow control (F4): a send of ``size`` bytes may go now."""
        window = self.window
        if windowed:
            return window.has_room(size)
        return (
            window.size == -1
            or self.unconfirmed_bytes == 0
            or self.unconfirmed_bytes + size <= window.size
        )

    def outstanding(self, session_id: int, kind: CallKind) -> tuple[int, ...]:
        return tuple(
            t for t, c in self.calls.items() if c.session_id == session_id and c.kind is kind
        )

    # --- failover -----------------------------------------------------------------------

    def reattach_refusal(self, last_received: int) -> str | None:
        """Why a server that kept the session and received up to ``last_received`` cannot
        be reattached to, or None when it can (F4): the window's view and the server's
        disagree or the window is off, or transacted work it never received would have to
        be replayed, which never happens (F9). The driver then ends that server session
        and starts a new one (F5): never a fatal error."""
        window = self.window
        refusal = window.reattach_refusal(last_received)
        if refusal is not None:
            return refusal
        lost = [c.command_id for c in window if not c.replayable and c.command_id > last_received]
        if lost:
            return f"transacted commands {lost[0]}..{lost[-1]} never reached the server"
        return None

    def reattach_possible(self, last_received: int) -> bool:
        """Whether a reattach to a server that received up to ``last_received`` can go on."""
        return self.reattach_refusal(last_received) is None

    def first_connection(self) -> None:
        """The first connection: nothing is in flight yet; ids start at 0."""
        self.window.reconnect()

    def failover(self, *, resumed: bool, last_received: int = -1) -> FailoverPlan:
        """The connection is back: decide what becomes of every call and session. A
        reattach the window cannot honour (``reattach_refusal``) is planned as a
        reconnect: the plan's ``reattached`` says which it is."""
        if resumed and self.reattach_possible(last_received):
            return self._reattach(last_received)
        return self._reconnect()

    def _reattach(self, last_received: int) -> FailoverPlan:
        window_plan = self.window.reattach(last_received)
        self.replayed += len(window_plan.replay)
        lost_work = bool(window_plan.lost_unreplayable)
        resend: list[int] = []
        complete: list[int] = []
        unblock: list[int] = []
        commit_received: dict[int, bool] = {}
        resent: dict[int, list[str]] = {}
        for token, call in sorted(self.calls.items()):
            if call.command_id > last_received:
                continue  # replayed from the window: its answer comes after the replay
            if call.kind is CallKind.SEND and (call.resendable or call.command_id < 0):
                # The server had it and its answer was lost (sent again with its duplicate
                # id, F13), or its write failed and it never left (sending it is no copy).
                resend.append(token)
                self._forget_receipt(token)
                if call.session_id is not None:
                    resent.setdefault(call.session_id, []).append(call.message_id)
            elif call.command_id < 0:
                unblock.append(token)  # never written: no answer will ever come
            elif call.kind is CallKind.END and call.commit and call.session_id is not None:
                # The server got the commit; its answer was lost: the transaction's rules
                # decide what commit() says (F3).
                commit_received[call.session_id] = True
                unblock.append(token)
            else:
                complete.append(token)
        for token in complete:
            self._end(token, confirmed=True)
        outcomes, parts = self._sessions_fail_over(
            reattached=True,
            lost_work=lost_work,
            commit_received=commit_received,
            replayed=tuple(c.command_id for c in window_plan.replay),
            resent=resent,
            in_doubt={},
        )
        return FailoverPlan(
            reattached=True,
            replay=window_plan.replay,
            resend=tuple(resend),
            complete=tuple(complete),
            unblock=tuple(unblock),
            outcomes=outcomes,
            sessions=tuple(parts),
        )

    def _reconnect(self) -> FailoverPlan:
        window_plan = self.window.reconnect()
        self._receipt_order.clear()
        self._unreceipted = 0
        receipted_through, self._receipted_through = self._receipted_through, -1
        waited_for = {c.command_id for c in self.calls.values() if c.command_id >= 0}
        resend: list[int] = []
        unblock: list[int] = []
        resent: dict[int, list[str]] = {}
        in_doubt: dict[int, list[str]] = {}
        lost_acks: dict[int, list[tuple[str, str, str]]] = {}
        for token, call in sorted(self.calls.items()):
            if call.kind is CallKind.ACK and call.session_id is not None:
                lost = (call.subscription, call.tag, call.message_id)
                lost_acks.setdefault(call.session_id, []).append(lost)
            if call.kind is CallKind.SEND and call.resendable:
                resend.append(token)
                call.cumulative = False
                if call.session_id is not None:
                    resent.setdefault(call.session_id, []).append(call.message_id)
                continue
            unblock.append(token)
            if call.kind is CallKind.SEND and call.session_id is not None:
                in_doubt.setdefault(call.session_id, []).append(call.message_id)
        # Sends nobody waits for (confirm=False) follow the window: stamped ones are resent,
        # unless a receipt covered them (the broker had them: a copy is a duplicate where
        # the new broker is another one, or has no duplicate detection).
        resend_frames = tuple(
            c
            for c in window_plan.resend
            if c.command_id not in waited_for and c.command_id > receipted_through
        )
        outcomes, parts = self._sessions_fail_over(
            reattached=False,
            lost_work=False,
            commit_received={},
            replayed=(),
            resent=resent,
            in_doubt=in_doubt,
            lost_acks=lost_acks,
        )
        return FailoverPlan(
            reattached=False,
            resend=tuple(resend),
            resend_frames=resend_frames,
            unblock=tuple(unblock),
            outcomes=outcomes,
            sessions=tuple(parts),
        )

    def _sessions_fail_over(
        self,
        *,
        reattached: bool,
        lost_work: bool,
        commit_received: Mapping[int, bool],
        replayed: tuple[int, ...],
        resent: Mapping[int, list[str]],
        in_doubt: Mapping[int, list[str]],
        lost_acks: Mapping[int, list[tuple[str, str, str]]] | None = None,
    ) -> tuple[dict[int, FailoverOutcome], tuple[SessionFailover, ...]]:
        """Every session's rules (F6-F9): their outcomes, and the report's parts (the
        replayed ids, which the window does not tell apart by session, go to the first)."""
        outcomes: dict[int, FailoverOutcome] = {}
        parts: list[SessionFailover] = []
        first_session = min(self.rules, default=0)
        for session_id, rules in self.rules.items():
            lost = () if lost_acks is None else tuple(lost_acks.get(session_id, ()))
            outcome = rules.failover(
                reattached=reattached,
                lost_acks=lost,
                lost_work=lost_work,
                commit_received=commit_received.get(session_id),
            )
            outcomes[session_id] = outcome
            parts.append(
                SessionFailover(
                    session_id=session_id,
                    replayed=replayed if session_id == first_session else (),
                    resent=tuple(resent.get(session_id, ())),
                    in_doubt=tuple(in_doubt.get(session_id, ())),
                    stale_acks=outcome.stale,
                    rolled_back=outcome.rolled_back,
                    dirty=outcome.dirty,
                )
            )
        return outcomes, tuple(parts)

    def _forget_receipt(self, token: int) -> None:
        call = self.calls.get(token)
        if call is not None and call.cumulative:
            call.cumulative = False
            with contextlib.suppress(ValueError):
                self._receipt_order.remove(token)

    def resent_on(self, token: int, *, link: int, command_id: int) -> None:
        """A call of the plan's ``resend`` went out again on the new link (own receipt)."""
        call = self.calls.get(token)
        if call is not None:
            call.link = link
            call.command_id = command_id
            call.cumulative = False
        self.resent += 1
        self.sent += 1

    def release(self, tokens: Iterable[int]) -> tuple[int, ...]:
        """End these calls without an answer (unblocked or failed); returns those that
        were still waiting."""
        return tuple(token for token in tokens if self._end(token))

    def release_all(self) -> tuple[int, ...]:
        """Every waiting call ends (disconnected for good, or closed)."""
        self._receipt_order.clear()
        self._unreceipted = 0
        return self.release(list(self.calls))
