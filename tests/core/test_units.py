"""Durations and sizes in URL option values."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hafailover._units import format_duration, format_size, parse_duration, parse_size


@given(st.floats(0, 1e9, allow_nan=False, allow_infinity=False))
def test_duration_round_trip(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


@given(st.integers(0, 2**50))
def test_size_round_trip(size: int) -> None:
    assert parse_size(format_size(size)) == size


@pytest.mark.parametrize("text", ["", "ms", "-5ms", "1e3e3s", "1 2s", "fast", "1.5.2s", "3 days"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("text", ["", "KiB", "1.3B", "1 TB", "-1"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_readable_forms() -> None:
    assert format_duration(0.1) == "100ms"
    assert format_duration(2.0) == "2s"
    assert format_size(1 << 20) == "1MiB"
    assert format_size(1000) == "1000B"
