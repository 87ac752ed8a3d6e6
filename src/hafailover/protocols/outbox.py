"""The bytes a link has to write, and the one lock they are written under.

Theory of operation
-------------------
A link never writes to its socket while the driver's lock (or the AMQP engine's) is held:
under those locks the driver decides, the window numbers the command, the frame is encoded
and its bytes are ``put`` here, in the order they were numbered. Once the locks are
released, ``flush`` writes what is queued under the outbox's own write lock, which is never
taken while either of the others is held (docs/core.md, "I/O"). So a write that blocks (a
peer that stops reading fills the socket's buffers) blocks only the thread writing: the
reader goes on delivering answers, messages and heart-beats, and noticing the loss.

``flush`` never waits for the write lock: a thread that finds it taken leaves its bytes to
the thread that holds it, which writes until the outbox is empty and looks again once it has
let go (so bytes queued just as it let go are not stranded). A write that fails is reported
once to ``failed`` (the link's loss path, which closes the socket: a write stuck on it
then returns); what is queued after that is dropped, as a dead socket would drop it.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


class Outbox:
    """Frames queued in order, written by whichever thread holds the write lock."""

    __slots__ = ("_broken", "_failed", "_queue", "_write", "_write_lock")

    def __init__(self, write: Callable[[bytes], None], failed: Callable[[Exception], None]) -> None:
        """``write`` puts bytes on the wire (blocking); ``failed`` hears the first error."""
        self._queue: collections.deque[bytes] = collections.deque()
        self._write_lock = threading.Lock()
        self._write = write
        self._failed = failed
        self._broken = False

    def put(self, data: bytes) -> None:
        """Queue one frame (or several encoded together): never blocks, never splits it."""
        self._queue.append(data)

    @property
    def pending(self) -> bool:
        """Bytes are queued that no write has taken yet."""
        return bool(self._queue)

    @property
    def writing(self) -> bool:
        """A thread holds the write lock (writing, or stuck writing)."""
        return self._write_lock.locked()

    def flush(self) -> None:
        """Write what is queued, unless another thread is writing (it writes these too).
        Call it with no other lock held: it may block as long as the socket does."""
        queue = self._queue
        while queue:
            if not self._write_lock.acquire(blocking=False):
                return  # the writer loops until the outbox is empty
            error: Exception | None = None
            try:
                while queue:
                    data = queue.popleft()
                    if queue:  # what piled up meanwhile goes in one write
                        parts = [data]
                        while queue:
                            parts.append(queue.popleft())
                        data = b"".join(parts)
                    if self._broken:
                        continue
                    try:
                        self._write(data)
                    except Exception as exc:  # noqa: BLE001 - any write error is the link's loss
                        self._broken = True
                        error = exc
            finally:
                self._write_lock.release()
            if error is not None:
                try:
                    self._failed(error)
                except Exception:  # the loss path must not fail the caller's call
                    log.exception("reporting a failed write failed")
                return
