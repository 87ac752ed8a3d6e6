"""The duplicate window's forget, which mutation testing found untested (docs/testing.md)."""

from __future__ import annotations

from hafailover.core.dedup import DuplicateWindow


def test_a_forgotten_id_is_no_longer_a_duplicate_and_the_others_stay() -> None:
    window = DuplicateWindow(3)
    window.remember(["m1", "m2"])
    window.forget("m1")
    assert "m1" not in window
    assert window.ids() == ("m2",)
    window.forget("never seen")  # nothing to forget: no error
    window.forget(None)  # a message without an id was never remembered
    assert window.ids() == ("m2",)
