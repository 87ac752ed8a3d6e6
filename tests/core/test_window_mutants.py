"""The confirmation window's edges that mutation testing found unguarded (docs/testing.md).

Each test names the behaviour it pins; the mutant it kills is noted in docs/testing.md.
"""

from __future__ import annotations

from hafailover.core.window import ConfirmationWindow


def test_nothing_is_confirmed_before_the_first_confirmation() -> None:
    window: ConfirmationWindow[str] = ConfirmationWindow(100)
    assert window.last_confirmed == -1


def test_a_reconnect_forgets_every_confirmation() -> None:
    window: ConfirmationWindow[str] = ConfirmationWindow(100)
    for payload in ("a", "b", "c"):
        window.record(payload, 1)
    window.confirm(1)
    window.reconnect()
    assert window.last_confirmed == -1
    assert window.next_id == 0


def test_a_command_that_fills_the_window_exactly_is_admitted() -> None:
    window: ConfirmationWindow[str] = ConfirmationWindow(10)
    window.record("a", 4)
    assert window.has_room(6)  # 4 + 6 == 10: within the window
    assert not window.has_room(7)
    window.record("b", 6)
    assert window.buffered_bytes == 10


def test_an_off_window_says_why_it_cannot_reattach() -> None:
    window: ConfirmationWindow[str] = ConfirmationWindow(-1)
    window.record("a", 1)
    # The reason is logged as the end of a sentence: it must read as one.
    assert window.reattach_refusal(0) == "the confirmation window is off (size -1)"
