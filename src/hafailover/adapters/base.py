"""What every protocol adapter shares: the value an open returns and the topology header.

Pure: no I/O.
"""

from __future__ import annotations

import attrs

from hafailover.url import BrokerAddress

__all__ = ["Opened", "parse_topology"]


@attrs.frozen
class Opened:
    """What the broker said when the connection opened."""

    broker: BrokerAddress
    session_id: str | None  # for a later reattach; None when the broker lacks the extension
    resumed: bool  # the broker still held the session asked for (reattach)
    last_received: int  # with resumed: the last command id the broker received
    topology: tuple[tuple[str, int], ...]  # announced client addresses, empty if none
    reattach_refused: bool = False  # a reattach was asked for and the session is gone


def parse_topology(value: str | None) -> tuple[tuple[str, int], ...]:
    """The (host, port) pairs of a topology announcement: "h1:p1,[::1]:p2"."""
    endpoints: list[tuple[str, int]] = []
    for item in (value or "").split(","):
        host, _, port = item.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if host and port.isdigit():
            endpoints.append((host, int(port)))
    return tuple(endpoints)
