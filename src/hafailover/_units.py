"""Durations and sizes as written in connection URLs: ``100ms``, ``2s``, ``1MiB``.

A bare number is milliseconds for a duration and bytes for a size, as in the
Artemis URL parameters. Parsing raises ``ValueError`` with a short reason; the
URL parser wraps it into an error that names the option. Formatting produces
the shortest text that parses back to exactly the same value.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_duration", "format_size", "parse_duration", "parse_size"]

_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

# Seconds per unit; milliseconds are divided rather than multiplied by 0.001 so
# that "7ms" parses to exactly 7 / 1000, the value format_duration checks against.
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_MILLIS_UNITS = ("", "ms")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
}

DURATION_UNITS_TEXT = ("ms", "s", "m", "h", "a bare number of milliseconds")
SIZE_UNITS_TEXT = ("B", "KiB", "MiB", "GiB", "KB", "MB", "GB", "a bare number of bytes")


def parse_duration(text: str) -> float:
    """Return the duration in seconds; raise ValueError if it is not one."""
    match = _NUMBER_UNIT.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration")
    number, unit = match.groups()
    unit = unit.lower()
    if unit in _MILLIS_UNITS:
        seconds = float(number) / 1000.0
    elif unit in _DURATION_UNITS:
        seconds = float(number) * _DURATION_UNITS[unit]
    else:
        raise ValueError(f"{text!r} has an unknown duration unit {unit!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is too large")
    return seconds


def format_duration(seconds: float) -> str:
    """Render a duration in seconds as text that parses back to the same float."""
    millis = seconds * 1000.0
    if millis.is_integer() and int(millis) / 1000.0 == seconds:
        whole = int(millis)
        if whole % 1000 == 0 and whole:
            return f"{whole // 1000}s"
        return f"{whole}ms"
    return f"{seconds!r}s"


def parse_size(text: str) -> int:
    """Return the size in bytes; raise ValueError if it is not a whole number of bytes."""
    match = _NUMBER_UNIT.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size")
    number, unit = match.groups()
    factor = _SIZE_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"{text!r} has an unknown size unit {unit!r}")
    value = float(number) * factor
    if not value.is_integer():
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(size: int) -> str:
    """Render a byte count, using binary units when they divide it exactly."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"
