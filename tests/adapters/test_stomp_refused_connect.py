"""A refused STOMP connection fails its attempt at once: the reconnect schedule waits, not
stomp.py. stomp.py slept 0.2 s after every refused connect even with one attempt allowed,
which put 0.2 s into every failover whose first attempt met the killed live."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import stomp.transport

from hafailover.errors import NotConnectedError
from hafailover.protocols.stomp.transport import StompTransport
from hafailover.url import BrokerAddress

pytestmark = [pytest.mark.timeout(60)]


class Events:
    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


def refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_refused_connect_fails_without_sleeping(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    caller = threading.get_ident()
    real_sleep = time.sleep

    def recording_sleep(seconds: float) -> None:
        if threading.get_ident() == caller:
            slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(stomp.transport.time, "sleep", recording_sleep)
    broker = BrokerAddress("stomp", "127.0.0.1", refused_port())
    transport = StompTransport(Events(), connect_timeout=5.0)
    with pytest.raises(NotConnectedError, match="cannot connect"):
        transport.open(broker)
    assert slept == []
