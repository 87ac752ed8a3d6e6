"""The confirmation window (F4): replay is exactly the missing suffix, memory is bounded."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hafailover.core.window import (
    ConfirmationWindow,
    ReattachImpossibleError,
    WindowFullError,
    command_flags,
)
from hafailover.message import stamps_duplicate_id


def test_record_confirm_and_replay() -> None:
    w: ConfirmationWindow[str] = ConfirmationWindow(100)
    ids = [w.record(f"c{i}", 10) for i in range(5)]
    assert ids == [0, 1, 2, 3, 4]
    assert w.buffered_bytes == 50
    assert w.confirm(1) == 2
    assert w.buffered_bytes == 30
    plan = w.reattach(last_received=2)
    assert [c.payload for c in plan.replay] == ["c3", "c4"]
    assert plan.lost_unreplayable == ()
    assert w.last_confirmed == 2


def test_full_window_makes_the_sender_wait() -> None:
    w: ConfirmationWindow[None] = ConfirmationWindow(25)
    w.record(None, 10)
    w.record(None, 10)
    assert not w.has_room(10)
    with pytest.raises(WindowFullError, match="must wait"):
        w.record(None, 10)
    w.confirm(0)
    assert w.has_room(10)


def test_a_command_larger_than_the_window_is_admitted_alone() -> None:
    w: ConfirmationWindow[None] = ConfirmationWindow(10)
    assert w.has_room(1000)
    w.record(None, 1000)
    assert not w.has_room(1)


def test_transacted_commands_are_numbered_but_never_replayed() -> None:
    w: ConfirmationWindow[str] = ConfirmationWindow(1000)
    w.record("plain", 1)
    w.record("tx-send", 1, replayable=False)
    w.record("plain-2", 1)
    plan = w.reattach(last_received=0)
    assert [c.payload for c in plan.replay] == ["plain-2"]
    assert plan.lost_unreplayable == (1,)
    assert [c.command_id for c in w] == [2]


def test_reconnect_splits_resendable_from_in_doubt_and_restarts_ids() -> None:
    w: ConfirmationWindow[str] = ConfirmationWindow(1000)
    w.record("persistent-with-dup-id", 5, resendable=True)
    w.record("non-persistent", 5)
    plan = w.reconnect()
    assert [c.payload for c in plan.resend] == ["persistent-with-dup-id"]
    assert [c.payload for c in plan.in_doubt] == ["non-persistent"]
    assert len(w) == 0 and w.buffered_bytes == 0 and w.next_id == 0


def test_disabled_window_keeps_nothing_and_cannot_reattach() -> None:
    w: ConfirmationWindow[str] = ConfirmationWindow(-1)
    assert not w.enabled
    assert [w.record("x", 10**9) for _ in range(3)] == [0, 1, 2]
    assert len(w) == 0 and w.buffered_bytes == 0
    with pytest.raises(ReattachImpossibleError, match="off"):
        w.reattach(last_received=1)


@pytest.mark.parametrize("last_received", [-1, 0, 5])
def test_reattach_rejects_an_impossible_server_view(last_received: int) -> None:
    w: ConfirmationWindow[None] = ConfirmationWindow(100)
    for _ in range(3):
        w.record(None, 1)
    w.confirm(1)
    if last_received < 1 or last_received >= 3:
        with pytest.raises(ReattachImpossibleError):
            w.reattach(last_received=last_received)


def test_confirmations_of_unsent_commands_are_protocol_errors() -> None:
    w: ConfirmationWindow[None] = ConfirmationWindow(100)
    w.record(None, 1)
    with pytest.raises(ReattachImpossibleError, match="only 1 were sent"):
        w.confirm(1)
    assert w.confirm(0) == 1
    assert w.confirm(0) == 0  # repeated confirmation is harmless


def test_bad_sizes_are_rejected() -> None:
    for size in (0, -2):
        with pytest.raises(ValueError, match="must be -1 or positive"):
            ConfirmationWindow(size)


class WindowReplay(RuleBasedStateMachine):
    """Random sends, confirmations, disconnects, reattaches with any last-received id."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0
        self.window: ConfirmationWindow[int] = ConfirmationWindow(1)
        # Model: unconfirmed commands as (id, size, replayable, resendable), in order.
        self.model: list[tuple[int, int, bool, bool]] = []
        self.server_received = -1  # highest id the server holds
        self.wire: list[int] = []  # ids sent but not yet received by the server
        self.largest = 0
        self.expected_id = 0

    @rule(size=st.integers(1, 4096))
    def configure(self, size: int) -> None:
        # Only at the start: a window's size never changes under it.
        if self.window.next_id == 0 and not self.model:
            self.size = size
            self.window = ConfirmationWindow(size)

    @rule(size=st.integers(0, 2048), replayable=st.booleans(), resendable=st.booleans())
    def send(self, size: int, replayable: bool, resendable: bool) -> None:
        buffered = sum(m[1] for m in self.model)
        room = not self.model or buffered + size <= self.window.size
        assert self.window.has_room(size) == room
        if not room:
            with pytest.raises(WindowFullError):
                self.window.record(0, size)
            return
        command_id = self.window.record(size, size, replayable=replayable, resendable=resendable)
        assert command_id == self.expected_id
        self.expected_id += 1
        self.model.append((command_id, size, replayable, resendable))
        self.wire.append(command_id)
        self.largest = max(self.largest, size)

    @rule(count=st.integers(1, 10))
    def server_receives(self, count: int) -> None:
        taken, self.wire = self.wire[:count], self.wire[count:]
        if taken:
            self.server_received = max(self.server_received, taken[-1])

    @precondition(lambda self: self.server_received > self.window.last_confirmed)
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        up_to = data.draw(st.integers(self.window.last_confirmed + 1, self.server_received))
        freed = self.window.confirm(up_to)
        expected = [m for m in self.model if m[0] <= up_to]
        assert freed == len(expected)
        self.model = [m for m in self.model if m[0] > up_to]

    @rule(data=st.data())
    def disconnect_and_reattach(self, data: st.DataObject) -> None:
        next_id = self.window.next_id
        last_received = data.draw(st.integers(-2, next_id + 1))
        possible = self.window.last_confirmed <= last_received < next_id
        if not possible:
            with pytest.raises(ReattachImpossibleError):
                self.window.reattach(last_received)
            return
        plan = self.window.reattach(last_received)
        missing = [m for m in self.model if m[0] > last_received]
        # Replay is exactly the missing suffix, in order, less transacted work.
        assert [c.command_id for c in plan.replay] == [m[0] for m in missing if m[2]]
        assert [c.size for c in plan.replay] == [m[1] for m in missing if m[2]]
        assert list(plan.lost_unreplayable) == [m[0] for m in missing if not m[2]]
        self.model = [m for m in missing if m[2]]
        self.server_received = last_received
        self.wire = [m[0] for m in self.model]

    @rule()
    def disconnect_and_reconnect(self) -> None:
        plan = self.window.reconnect()
        assert [c.command_id for c in plan.resend] == [m[0] for m in self.model if m[3]]
        assert [c.command_id for c in plan.in_doubt] == [m[0] for m in self.model if not m[3]]
        self.model = []
        self.wire = []
        self.server_received = -1
        self.expected_id = 0

    @invariant()
    def memory_is_bounded(self) -> None:
        buffered = self.window.buffered_bytes
        assert buffered == sum(m[1] for m in self.model)
        assert [c.command_id for c in self.window] == [m[0] for m in self.model]
        # Never more than the window plus one command.
        assert buffered <= self.window.size + self.largest
        assert buffered <= self.window.size or len(self.window) == 1


WindowReplay.TestCase.settings = settings(max_examples=200, stateful_step_count=60)
test_window_replay = WindowReplay.TestCase


def test_window_replay_with_small_windows_hits_flow_control() -> None:
    w: ConfirmationWindow[int] = ConfirmationWindow(64)
    waits = 0
    for i in range(1000):
        size = (i * 37) % 50
        if not w.has_room(size):
            waits += 1
            w.confirm(w.next_id - 1)
        w.record(i, size)
        assert w.buffered_bytes <= 64 + 50
    assert waits > 0


def test_forced_commands_are_numbered_past_a_full_window() -> None:
    """Control commands already on the wire are numbered even when sends must wait."""
    w: ConfirmationWindow[str] = ConfirmationWindow(20)
    w.record("send", 15)
    assert not w.has_room(10)
    with pytest.raises(WindowFullError):
        w.record("another send", 10)
    assert w.record("ack", 10, force=True) == 1
    assert w.buffered_bytes == 25
    assert w.confirm(1) == 2
    assert w.buffered_bytes == 0


@pytest.mark.parametrize("transacted", [False, True])
@pytest.mark.parametrize("stamped", [False, True])
def test_f9_f13_which_commands_are_replayed_and_resent(transacted: bool, stamped: bool) -> None:
    replayable, resendable = command_flags(transacted=transacted, stamped=stamped)
    assert replayable is not transacted  # F9: transacted work is never repaired
    assert resendable is (stamped and not transacted)  # F13: only what a broker can drop


def test_f13_only_persistent_sends_with_duplicate_detection_are_stamped() -> None:
    assert stamps_duplicate_id(persistent=True, duplicate_detection=True)
    assert not stamps_duplicate_id(persistent=False, duplicate_detection=True)
    assert not stamps_duplicate_id(persistent=True, duplicate_detection=False)
