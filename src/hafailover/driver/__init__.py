"""The threaded driver: the public API's classes and the only place with threads and locks.

``connection`` holds the lock, the threads and the executor of what the pure core decides;
``calls`` admits and waits, ``link_events`` takes what links report; ``session``,
``producer``, ``consumer``, ``browser`` and ``transactions`` are the API's thin classes;
``completions`` and ``notifier`` are how calls wait and how listeners are told. The
socket, reader thread and lock under the sans-I/O AMQP engine are protocol code:
``hafailover.protocols.amqp.transport``.
"""

from hafailover.driver.browser import Browser
from hafailover.driver.completions import SendCompletion
from hafailover.driver.connection import Connection, connect
from hafailover.driver.consumer import Consumer
from hafailover.driver.events import (
    ConnectionEvent,
    ConnectionStatistics,
    FailoverCompleted,
    FailoverFailed,
    FailureDetected,
)
from hafailover.driver.producer import MAX_MESSAGE_BYTES, Producer
from hafailover.driver.session import Session
from hafailover.driver.transactions import TransactionBlock

__all__ = [
    "MAX_MESSAGE_BYTES",
    "Browser",
    "Connection",
    "ConnectionEvent",
    "ConnectionStatistics",
    "Consumer",
    "FailoverCompleted",
    "FailoverFailed",
    "FailureDetected",
    "Producer",
    "SendCompletion",
    "Session",
    "TransactionBlock",
    "connect",
]
