"""The file that keeps a consumer's duplicate window across restarts (consumer_dedup_file).

The journal's format and rules (what a record is, what a torn write leaves, when to compact)
are ``core/dedup.py``'s; this module only does the file's I/O: it takes an exclusive lock on
the file for as long as the consumer lives (two consumers writing one journal would
interleave their windows; a process that dies lets go of the lock with it), reads it once,
appends records as the window changes (each written through to the kernel at once, so a
killed process loses nothing it reported), and replaces it atomically when the window
compacts it (written to a new file, flushed to disk, renamed over the old one).

A write that fails (a full disk, an I/O error) is logged, once until one succeeds again, and
never raised: the window in memory goes on, the message is handed out as it would be, and
only the ids not written would be missing after a restart (their copies delivered again).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os

from hafailover.errors import ConfigurationError

__all__ = ["DedupFile"]

log = logging.getLogger(__name__)


class DedupFile:
    """One consumer's journal file, locked while open (a ``DedupJournal``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise ConfigurationError(
                f"consumer_dedup_file {path}: cannot open it ({exc.strerror})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigurationError(
                f"consumer_dedup_file {path} is in use by another consumer; "
                "each consumer needs a file of its own (create_consumer(dedup_file=...))"
            ) from None
        self._fd = fd
        self._failing = False  # the last write failed (logged once)

    def read(self) -> bytes:
        chunks: list[bytes] = []
        os.lseek(self._fd, 0, os.SEEK_SET)
        while chunk := os.read(self._fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)

    def append(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as exc:
            self._write_failed(exc)
        else:
            self._failing = False

    def rewrite(self, data: bytes) -> None:
        """A new file with ``data``, on disk, renamed over the journal; the lock moves to
        it (taken before the rename, so no other consumer can slip in between)."""
        try:
            self._rewrite(data)
        except OSError as exc:
            self._write_failed(exc)  # the old file, still whole and locked, stays
        else:
            self._failing = False

    def _write_failed(self, error: OSError) -> None:
        if not self._failing:
            self._failing = True
            log.warning(
                "consumer_dedup_file %s: cannot write it (%s); the window goes on in memory, "
                "and ids handed out until a write succeeds are not kept across a restart",
                self.path,
                error.strerror or error,
            )

    def _rewrite(self, data: bytes) -> None:
        temporary = f"{self.path}.new"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.replace(temporary, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        # Renamed: the new file is the journal from now on, whatever the directory's sync.
        os.close(self._fd)
        self._fd = fd
        directory = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.fsync(fd)
            os.close(fd)
