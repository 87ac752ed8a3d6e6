"""The consumer's duplicate window: bounded, oldest out, and when an id joins it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover.ack_modes import AckMode
from hafailover.core.dedup import DuplicateWindow, Remembered, remembered_at
from hafailover.errors import ConfigurationError

IDS = st.lists(st.one_of(st.none(), st.sampled_from([f"id-{n}" for n in range(12)])), max_size=60)


@given(size=st.integers(1, 8), batches=st.lists(IDS, max_size=6))
def test_the_window_holds_the_last_distinct_ids_remembered(
    size: int, batches: list[list[str | None]]
) -> None:
    window = DuplicateWindow(size)
    recency: list[str] = []  # the model: distinct ids, least recently remembered first
    for batch in batches:
        window.remember(batch)
        for message_id in batch:
            if message_id is None:
                continue
            if message_id in recency:
                recency.remove(message_id)
            recency.append(message_id)
        expected = recency[-size:]
        assert window.ids() == tuple(expected)
        assert len(window) == len(expected) <= size
        for message_id in (f"id-{n}" for n in range(12)):
            assert (message_id in window) == (message_id in expected)
        assert None not in window


def test_an_id_remembered_again_is_kept_longest() -> None:
    window = DuplicateWindow(2)
    window.remember(["a", "b"])
    window.remember(["a"])  # seen again: now the newest
    window.remember(["c"])  # evicts b, the oldest
    assert "a" in window and "c" in window and "b" not in window


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "10"])
def test_a_window_of_no_whole_size_is_refused(size: object) -> None:
    with pytest.raises(ConfigurationError, match="whole number"):
        DuplicateWindow(size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "when"),
    [
        (AckMode.AUTO, Remembered.AT_DELIVERY),
        (AckMode.DUPS_OK, Remembered.AT_DELIVERY),
        (AckMode.NO_ACKNOWLEDGE, Remembered.AT_DELIVERY),
        (AckMode.CLIENT, Remembered.AT_ACKNOWLEDGE),
        (AckMode.CLIENT_INDIVIDUAL, Remembered.AT_ACKNOWLEDGE),
        (AckMode.SESSION_TRANSACTED, Remembered.AT_COMMIT),
    ],
)
def test_an_id_counts_once_the_mode_says_it_was_acknowledged(
    mode: AckMode, when: Remembered
) -> None:
    assert remembered_at(mode) is when
