"""Reading a destination back with raw stomp.py: the broker's view, not the sink's."""

from __future__ import annotations

import threading
import time

import attrs
import stomp

from reference_broker.pair import BrokerPair

USER = "app"
PASSWORD = "secret"


@attrs.frozen
class Received:
    body: bytes
    headers: dict[str, str]


class _Collector(stomp.ConnectionListener):
    def __init__(self) -> None:
        self.frames: list[Received] = []
        self.lock = threading.Lock()

    def on_message(self, frame: stomp.utils.Frame) -> None:
        body = frame.body if isinstance(frame.body, bytes) else frame.body.encode("utf-8")
        with self.lock:
            self.frames.append(Received(body, dict(frame.headers)))


def consume_all(
    pair: BrokerPair, destination: str, *, expected: int, idle: float = 1.0, limit: float = 60.0
) -> list[Received]:
    """Every message on ``destination`` (a queue), from whichever node is live: waits for
    ``expected`` and then ``idle`` seconds more, so extra (duplicate) messages show too."""
    node = pair.wait_active(timeout=15)
    listener = _Collector()
    connection = stomp.Connection12([("127.0.0.1", node.stomp_port)], heartbeats=(0, 0))
    connection.set_listener("collect", listener)
    connection.connect(USER, PASSWORD, wait=True)
    try:
        connection.subscribe(destination, id="all", ack="auto")
        deadline = time.monotonic() + limit
        last_change, seen = time.monotonic(), -1
        while time.monotonic() < deadline:
            with listener.lock:
                count = len(listener.frames)
            if count != seen:
                seen, last_change = count, time.monotonic()
            quiet = time.monotonic() - last_change
            if (count >= expected and quiet > idle) or quiet > max(idle, 5.0):
                break
            time.sleep(0.02)
    finally:
        connection.disconnect()
    with listener.lock:
        return list(listener.frames)
