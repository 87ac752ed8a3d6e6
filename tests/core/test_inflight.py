"""The calls in flight (core/inflight.py): what a failover does to every call and session."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hafailover.ack_modes import AckMode, ClientAckRules, TransactedAckRules
from hafailover.core.inflight import RECEIPT_EVERY, CallKind, FailoverPlan, SessionsCore
from hafailover.errors import CallTimeoutError, ProtocolError, UnblockedError
from hafailover.tx.state import TxPhase

LINK = 1


def windowed_core() -> SessionsCore:
    return SessionsCore(64 * 1024)


def write(core: SessionsCore, token: int | None, *, size: int = 10, **flags: bool) -> int:
    """Write a frame as a windowed link does: number it in the window."""
    command_id = core.window.record(("frame", token), size, force=True, **flags)
    if token is not None:
        core.written(token, link=LINK, command_id=command_id, windowed=True, asked=True)
    return command_id


def test_a_receipt_confirms_every_cumulative_send_before_it() -> None:
    core = windowed_core()
    tokens = []
    for n in range(3):
        token = core.call(CallKind.SEND, 1, message_id=f"m{n}")
        asked = core.asks_receipt(token, windowed=True, waited_for=n == 2)
        command_id = core.window.record(("send", n), 10, force=True)
        core.written(token, link=LINK, command_id=command_id, windowed=True, asked=asked)
        tokens.append(token)
    answer = core.answered(tokens[2])
    assert answer.done == tuple(tokens)
    assert core.confirmed == 3 and not core.calls


def test_a_receipt_is_asked_every_so_many_sends_and_whenever_somebody_waits() -> None:
    core = windowed_core()
    asked = []
    for _ in range(RECEIPT_EVERY):
        token = core.call(CallKind.SEND, 1)
        ask = core.asks_receipt(token, windowed=True, waited_for=False)
        core.written(token, link=LINK, command_id=-1, windowed=True, asked=ask)
        asked.append(ask)
    assert asked == [False] * (RECEIPT_EVERY - 1) + [True]
    assert not core.sync_needed()
    token = core.call(CallKind.SEND, 1)
    core.written(token, link=LINK, command_id=-1, windowed=True, asked=False)
    assert core.sync_needed()  # somebody waiting for it needs a sync frame
    assert core.asks_receipt(core.call(CallKind.SEND, 1), windowed=False, waited_for=False)


def test_a_refused_subscription_is_gone_but_one_cut_by_the_connection_is_not() -> None:
    core = windowed_core()
    refused = core.call(CallKind.SUBSCRIBE, 1, subscription="sub-1")
    cut = core.call(CallKind.SUBSCRIBE, 1, subscription="sub-2")
    timed_out = core.call(CallKind.SUBSCRIBE, 1, subscription="sub-3")
    assert core.answered(refused, ProtocolError("no such queue")).refused_subscriptions == (
        "sub-1",
    )
    assert core.answered(cut, UnblockedError("cut")).refused_subscriptions == ()
    assert core.answered(timed_out, CallTimeoutError("slow")).refused_subscriptions == ()
    assert not core.calls


def test_f4_reattach_completes_what_the_server_had_and_keeps_the_rest_waiting() -> None:
    core = windowed_core()
    core.open_session(1, AckMode.AUTO)
    had = core.call(CallKind.ACK, 1)
    write(core, had)
    had_send = core.call(CallKind.SEND, 1, resendable=True, message_id="m-had")
    write(core, had_send)
    missed = core.call(CallKind.SEND, 1, resendable=True, message_id="m-missed")
    write(core, missed)
    never_written = core.call(CallKind.SEND, 1, message_id="m-never")
    plan = core.failover(resumed=True, last_received=1)
    assert plan.reattached
    assert [c.payload for c in plan.replay] == [("frame", missed)]
    assert plan.complete == (had,)
    # Its answer was lost: sent again with its duplicate id; one never written is sent too.
    assert plan.resend == (had_send, never_written)
    assert plan.unblock == ()
    assert set(core.calls) == {had_send, missed, never_written}
    assert plan.sessions[0].replayed == (2,)
    assert plan.sessions[0].resent == ("m-had", "m-never")


def test_f3_f9_reattach_after_the_server_got_the_commit_leaves_its_outcome_unknown() -> None:
    core = windowed_core()
    rules = core.open_session(1, AckMode.SESSION_TRANSACTED)
    assert isinstance(rules, TransactedAckRules)
    rules.transaction.work()
    rules.transaction.begin_commit()
    write(core, None, replayable=False)  # BEGIN
    commit = core.call(CallKind.END, 1, commit=True)
    write(core, commit, replayable=False)
    rules.transaction.commit_written()
    assert core.committing(1)
    assert core.reattach_possible(1)
    plan = core.failover(resumed=True, last_received=1)
    assert plan.unblock == (commit,)
    fate = rules.transaction.commit_cut()
    assert fate.code is not None and fate.code.value == "TRANSACTION_OUTCOME_UNKNOWN"


def test_f9_reattach_is_refused_when_transacted_work_never_reached_the_server() -> None:
    core = windowed_core()
    write(core, None)
    write(core, None, replayable=False)  # a transacted send the server never got
    assert not core.reattach_possible(0)
    assert core.reattach_possible(1)


def test_f4_reattach_possible_agrees_with_what_failover_plans() -> None:
    """The one decision: whenever reattach_possible says no, failover plans a reconnect
    instead of raising; whenever it says yes, failover reattaches."""
    for last in range(-3, 6):
        probe = windowed_core()
        for _ in range(3):
            write(probe, None)
        probe.confirmed_upto(0)
        possible = probe.reattach_possible(last)
        assert probe.failover(resumed=True, last_received=last).reattached is possible
        assert possible is (0 <= last <= 2), last


def test_f4_a_fresh_window_cannot_be_reattached_to_at_command_0() -> None:
    # Nothing was sent: a server that claims command 0 is not this session's.
    core = windowed_core()
    assert not core.reattach_possible(0)
    assert not core.failover(resumed=True, last_received=0).reattached
    assert core.reattach_possible(-1)


def test_f4_without_a_window_every_reattach_becomes_a_reconnect() -> None:
    core = SessionsCore(-1)
    assert not core.reattach_possible(-1)
    assert not core.failover(resumed=True, last_received=-1).reattached


def test_f3_f5_f13_reconnect_resends_stamped_sends_and_unblocks_the_rest() -> None:
    core = windowed_core()
    core.open_session(1, AckMode.CLIENT)
    rules = core.rules[1]
    assert isinstance(rules, ClientAckRules)
    rules.delivered("d1")
    stamped = core.call(CallKind.SEND, 1, resendable=True, message_id="m1")
    write(core, stamped)
    plain = core.call(CallKind.SEND, 1, message_id="m2")
    write(core, plain)
    ack = core.call(CallKind.ACK, 1)
    write(core, ack)
    unwatched = write(core, None, resendable=True)  # confirm=False, duplicate id stamped
    write(core, None)  # confirm=False, no duplicate id: in doubt
    plan = core.failover(resumed=False)
    assert not plan.reattached
    assert plan.resend == (stamped,)
    assert plan.unblock == (plain, ack)
    assert [c.command_id for c in plan.resend_frames] == [unwatched]
    part = plan.sessions[0]
    assert part.resent == ("m1",) and part.in_doubt == ("m2",)
    assert part.stale_acks == ("d1",) and part.dirty  # F8
    assert plan.outcomes[1].discard_prefetched
    assert core.window.next_id == 0  # ids start again on the new session


def test_f9_reconnect_makes_a_dirty_transaction_rollback_only() -> None:
    core = windowed_core()
    rules = core.open_session(1, AckMode.SESSION_TRANSACTED)
    assert isinstance(rules, TransactedAckRules)
    rules.transaction.work()
    plan = core.failover(resumed=False)
    assert plan.sessions[0].rolled_back
    assert rules.transaction.phase is TxPhase.ROLLBACK_ONLY


def test_flow_control_without_a_window_counts_the_confirmed_bytes() -> None:
    core = SessionsCore(100)
    assert core.has_room(1000, windowed=False)  # nothing waiting: one may always go
    token = core.call(CallKind.SEND, 1, size=60)
    assert core.has_room(40, windowed=False)
    assert not core.has_room(41, windowed=False)
    core.answered(token)
    assert core.unconfirmed_bytes == 0


class CoreUnderFailover(RuleBasedStateMachine):
    """Calls written, answered, abandoned, interleaved with reattaches and reconnects: every
    call ends exactly once, and a failover plan puts each call in exactly one place."""

    def __init__(self) -> None:
        super().__init__()
        self.core = windowed_core()
        self.core.open_session(1, AckMode.AUTO)
        self.core.open_session(2, AckMode.SESSION_TRANSACTED)
        self.waiting: dict[int, tuple[CallKind, bool, int]] = {}  # kind, resendable, size
        self.ended: set[int] = set()
        self.messages = 0

    def _ended(self, tokens: tuple[int, ...]) -> None:
        for token in tokens:
            assert token in self.waiting, f"call {token} ended twice or never existed"
            del self.waiting[token]
            self.ended.add(token)

    @rule(
        kind=st.sampled_from([CallKind.SEND, CallKind.ACK, CallKind.SUBSCRIBE]),
        resendable=st.booleans(),
        written=st.booleans(),
        size=st.integers(0, 50),
        waited_for=st.booleans(),
    )
    def call(
        self, kind: CallKind, resendable: bool, written: bool, size: int, waited_for: bool
    ) -> None:
        core = self.core
        resendable = resendable and kind is CallKind.SEND
        self.messages += 1
        token = core.call(kind, 1, resendable=resendable, size=size, message_id=f"m{self.messages}")
        self.waiting[token] = (kind, resendable, size)
        if written:
            asked = core.asks_receipt(token, windowed=True, waited_for=waited_for)
            command_id = core.window.record(token, 10, force=True)
            core.written(token, link=LINK, command_id=command_id, windowed=True, asked=asked)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), refused=st.booleans())
    def answer(self, data: st.DataObject, refused: bool) -> None:
        token = data.draw(st.sampled_from(sorted(self.waiting)))
        calls = {t: (c.cumulative, c.command_id) for t, c in self.core.calls.items()}
        answer = self.core.answered(token, ProtocolError("refused") if refused else None)
        if refused:
            assert answer.failed == (token,) and answer.done == ()
        else:
            assert token in answer.done
            cumulative, command_id = calls[token]
            for done in answer.done:
                # A cumulative receipt confirms only cumulative calls written before it.
                assert done == token or (
                    cumulative and calls[done][0] and calls[done][1] < command_id
                )
        self._ended(answer.done + answer.failed)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        token = data.draw(st.sampled_from(sorted(self.waiting)))
        assert self.core.abandon(token) is not None
        self._ended((token,))

    @rule(data=st.data())
    def reattach(self, data: st.DataObject) -> None:
        core = self.core
        window = core.window
        if window.next_id == 0:
            return
        last = data.draw(st.integers(window.last_confirmed, window.next_id - 1))
        before = {t: core.calls[t].command_id for t in self.waiting}
        plan = core.failover(resumed=True, last_received=last)
        places = [plan.complete, plan.resend, plan.unblock]
        placed = [t for place in places for t in place]
        assert len(placed) == len(set(placed)), "a call in two places"
        for token, command_id in before.items():
            if command_id > last:
                assert token not in placed  # replayed: its answer comes later
                assert token in core.calls
            else:
                assert token in placed, f"call {token} (id {command_id}) forgotten"
        for token in plan.resend:
            assert self.waiting[token][0] is CallKind.SEND
        self._ended(plan.complete)
        self.core.release(plan.unblock)
        self._ended(plan.unblock)
        for token in plan.resend:
            command_id = window.record(token, 10, force=True)
            core.resent_on(token, link=LINK + 1, command_id=command_id)

    @rule(data=st.data())
    def reattach_answered_inconsistently(self, data: st.DataObject) -> None:
        """A server that claims fewer commands than it confirmed, or more than were sent:
        the core plans a reconnect, never a fatal error, and says so beforehand."""
        window = self.core.window
        last = data.draw(
            st.integers(-5, window.last_confirmed - 1)
            | st.integers(window.next_id, window.next_id + 5)
        )
        assert not self.core.reattach_possible(last)
        self._reconnected(self.core.failover(resumed=True, last_received=last))

    @rule()
    def reconnect(self) -> None:
        self._reconnected(self.core.failover(resumed=False))

    def _reconnected(self, plan: FailoverPlan) -> None:
        core = self.core
        assert not plan.reattached
        assert set(plan.resend) | set(plan.unblock) == set(self.waiting)
        assert not set(plan.resend) & set(plan.unblock)
        for token in plan.resend:
            kind, resendable, _ = self.waiting[token]
            assert kind is CallKind.SEND and resendable
        for token in plan.unblock:
            kind, resendable, _ = self.waiting[token]
            assert not (kind is CallKind.SEND and resendable), "a stamped send given up"
        assert core.release(plan.unblock) == plan.unblock
        self._ended(plan.unblock)
        for token in plan.resend:
            command_id = core.window.record(token, 10, force=True)
            core.resent_on(token, link=LINK + 1, command_id=command_id)

    @rule()
    def disconnect(self) -> None:
        self._ended(self.core.release_all())

    @invariant()
    def the_core_waits_for_exactly_the_calls_not_ended(self) -> None:
        assert set(self.core.calls) == set(self.waiting)
        assert not set(self.core.calls) & self.ended

    @invariant()
    def flow_control_counts_exactly_what_waits(self) -> None:
        assert self.core.unconfirmed_bytes == sum(size for _, _, size in self.waiting.values())


CoreUnderFailover.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
test_core_under_failover = CoreUnderFailover.TestCase
