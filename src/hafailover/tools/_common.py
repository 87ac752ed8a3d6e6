"""What the command-line clients share: options checking, the record file, the progress
line, and the summary.

Checks here raise ``OptionError`` naming the command-line option, so ``hafailover`` can exit
with status 2 and say which option was wrong before any connection is tried.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Final

from hafailover.ack_modes import AckMode
from hafailover.connection import Connection
from hafailover.destination import Destination, parse_destination
from hafailover.errors import ConfigurationError
from hafailover.url import FailoverPolicy, parse_url

__all__ = [
    "ACK_MODES",
    "OptionError",
    "Progress",
    "Recorder",
    "check_destination",
    "check_url",
    "connection_summary",
]

# Command-line names of the acknowledge modes (the Artemis CLI spells them this way).
ACK_MODES: Final[Mapping[str, AckMode]] = {
    "auto": AckMode.AUTO,
    "dups-ok": AckMode.DUPS_OK,
    "client": AckMode.CLIENT,
    "client-individual": AckMode.CLIENT_INDIVIDUAL,
    "transacted": AckMode.SESSION_TRANSACTED,
}


class OptionError(ConfigurationError):
    """A command-line option has a bad value; ``option`` names it (``--url``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


def check_url(url: str) -> FailoverPolicy:
    try:
        return parse_url(url)
    except ConfigurationError as exc:
        raise OptionError("--url", str(exc)) from exc


def check_destination(name: str) -> Destination:
    try:
        return parse_destination(name)
    except ConfigurationError as exc:
        raise OptionError("--destination", str(exc)) from exc


class Recorder:
    """One JSON object per line, flushed at once so a reader sees every line written even
    if this process dies. Thread-safe. ``Recorder(None)`` records nothing."""

    def __init__(self, path: str | Path | None) -> None:
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        if path is not None:
            try:
                self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
            except OSError as exc:
                raise OptionError("--record", f"cannot write {path}: {exc.strerror}") from exc

    def write(self, entry: Mapping[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class Progress:
    """A single progress line on stderr, rewritten in place; silent unless stderr is a
    terminal, so piped and recorded output stays clean."""

    INTERVAL: Final = 0.2

    def __init__(self, stream: IO[str] | None = None, *, enabled: bool | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.enabled = self._stream.isatty() if enabled is None else enabled
        self._last = 0.0
        self._width = 0

    def update(self, text: str, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.INTERVAL:
            return
        self._last = now
        padding = " " * max(0, self._width - len(text))
        self._width = len(text)
        self._stream.write(f"\r{text}{padding}")
        self._stream.flush()

    def close(self) -> None:
        if self.enabled and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0


def connection_summary(connection: Connection) -> dict[str, Any]:
    """What the library did for this connection: failovers and their work."""
    statistics = connection.statistics()
    reports = connection.reports
    return {
        "failovers": statistics.failovers,
        "reattached": statistics.reattached,
        "replayed": statistics.replayed,
        "resent": statistics.resent,
        "in_doubt_released": statistics.in_doubt,
        "failover_seconds": [round(r.duration, 3) for r in reports],
        "transactions_rolled_back_by_failover": sum(
            len(r.transactions_rolled_back) for r in reports
        ),
    }


def rate(count: int, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else 0.0


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, int(fraction * len(sorted_values)))
    return sorted_values[index]
