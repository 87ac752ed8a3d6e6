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

__all__ = ["Chunk", "Outbox"]

# What the outbox holds: a frame's bytes, or what a partial write left of them.
Chunk = bytes | memoryview

log = logging.getLogger(__name__)

# How long a writer that may block waits for the lock held by one that never does.
_HANDOVER = 0.05


class Outbox:
    """Frames queued in order, written by whichever thread holds the write lock."""

    __slots__ = (
        "_broken",
        "_failed",
        "_holder_waits",
        "_queue",
        "_write",
        "_write_lock",
        "_write_some",
    )

    def __init__(
        self,
        write: Callable[[Chunk], None],
        failed: Callable[[Exception], None],
        write_some: Callable[[Chunk], int] | None = None,
    ) -> None:
        """``write`` puts bytes on the wire (blocking); ``write_some`` as many as the socket
        takes at once, returning how many (for ``flush(wait=False)``); ``failed`` hears
        the first error."""
        self._queue: collections.deque[Chunk] = collections.deque()
        self._write_lock = threading.Lock()
        self._write = write
        self._write_some = write_some
        self._failed = failed
        self._broken = False
        self._holder_waits = False  # the write lock's holder may block in its write

    def put(self, data: bytes) -> None:
        """Queue one frame (or several encoded together): never blocks, never splits it."""
        self._queue.append(data)

    def offer(self, data: bytes, write_now: Callable[[Chunk], bool]) -> None:
        """For a thread that must never block (stomp.py's heart-beat thread, which also
        checks the broker's heart-beats): with nothing queued and nobody writing, write
        ``data`` (a heart-beat, all or nothing) if the socket takes it now, else drop it
        (a socket whose buffer is full is not idle: no heart-beat is due); otherwise queue
        it behind what is there, for the thread that writes (or is about to) that."""
        queue = self._queue
        if queue or not self._write_lock.acquire(blocking=False):
            queue.append(data)
            return
        error: Exception | None = None
        try:
            if not self._broken:
                try:
                    write_now(data)
                except Exception as exc:  # noqa: BLE001 - any write error is the link's loss
                    self._broken = True
                    error = exc
        finally:
            self._write_lock.release()
        if error is not None:
            self._report(error)
        elif queue:
            # Queued while the lock was held here by a thread that gave up waiting for it
            # (rare: the window is one non-blocking write, the hand-over waits _HANDOVER).
            # Its bytes are left to this thread, which must not block on them: a full
            # socket would stop it checking the broker's heart-beats. A thread of their
            # own writes them; it ends with the write (or with the socket the loss closes).
            threading.Thread(target=self.flush, name="hafailover-outbox", daemon=True).start()

    def _report(self, error: Exception) -> None:
        try:
            self._failed(error)
        except Exception:  # the loss path must not fail the caller's call
            log.exception("reporting a failed write failed")

    @property
    def pending(self) -> bool:
        """Bytes are queued that no write has taken yet."""
        return bool(self._queue)

    @property
    def writing(self) -> bool:
        """A thread holds the write lock (writing, or stuck writing)."""
        return self._write_lock.locked()

    def flush(self, *, wait: bool = True) -> None:
        """Write what is queued, unless another thread is writing (it writes these too).
        Call it with no other lock held: it may block as long as the socket does.

        ``wait=False``, for a thread that must never block and that comes back when the
        socket is writable again (the AMQP reader, which polls for it while bytes are
        pending and nobody writes): write what the socket takes now and leave the rest,
        even half a frame, first in the outbox."""
        queue = self._queue
        write_some = None if wait else self._write_some
        while queue:
            if not self._write_lock.acquire(blocking=False) and (
                write_some is not None
                or self._holder_waits
                # Held by a writer that never blocks (the AMQP reader): it lets go at once,
                # maybe leaving a remainder this thread, which queued it, should write.
                or not self._write_lock.acquire(timeout=_HANDOVER)
            ):
                return  # the writer loops until the outbox is empty (or the reader polls)
            self._holder_waits = write_some is None
            error: Exception | None = None
            full = False
            try:
                while queue:
                    data = queue.popleft()
                    if queue and write_some is None:  # what piled up goes in one write
                        parts = [data]
                        while queue:
                            parts.append(queue.popleft())
                        data = b"".join(parts)
                    if self._broken:
                        continue
                    try:
                        if write_some is None:
                            self._write(data)
                            continue
                        sent = write_some(data)
                    except Exception as exc:  # noqa: BLE001 - any write error is the link's loss
                        self._broken = True
                        error = exc
                        continue
                    if sent < len(data):
                        # Only the lock's holder takes from the left; no copy of the rest.
                        queue.appendleft(memoryview(data)[sent:])
                        full = True
                        break
            finally:
                self._holder_waits = False
                self._write_lock.release()
            if error is not None:
                self._report(error)
                return
            if full:
                return  # the caller comes back once the socket is writable
