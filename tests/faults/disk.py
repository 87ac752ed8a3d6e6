"""A small file system a test can fill: a size-limited tmpfs mounted on a directory.

``small_disk(path, size)`` mounts a tmpfs of ``size`` bytes on ``path`` (made if missing)
and unmounts it by that path when the block ends, even when the test failed. ``DiskHog``
keeps such a disk full: a thread that grows one file until ENOSPC, again and again, so that
whatever the broker frees (a deleted journal, a compaction) is taken at once; ``release()``
deletes the file and gives the space back. Needs root (mount), as CI runs; without it the
mount fails with an error that says so, never a skip.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DiskHog", "free_bytes", "small_disk"]

_CHUNK = 64 * 1024


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


@contextlib.contextmanager
def small_disk(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes on ``path`` for the block's duration."""
    path.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(path):
        raise RuntimeError(f"{path} is a mount point already")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "hafailover-test-disk", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if mounted.returncode != 0:
        raise RuntimeError(
            f"cannot mount a {size}-byte tmpfs on {path} (root needed): {mounted.stderr.strip()}"
        )
    try:
        yield path
    finally:
        # By path, lazily if something (a node still stopping) keeps it busy.
        result = subprocess.run(
            ["umount", str(path)], capture_output=True, text=True, timeout=30, check=False
        )
        if result.returncode != 0 and os.path.ismount(path):
            subprocess.run(["umount", "-l", str(path)], timeout=30, check=True)


class DiskHog:
    """Keeps the file system of ``directory`` full until ``release()``."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "disk-hog"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.full = threading.Event()  # set once the disk was first found full

    def start(self) -> DiskHog:
        self._thread = threading.Thread(target=self._run, name="disk-hog", daemon=True)
        self._thread.start()
        if not self.full.wait(30):
            raise RuntimeError(f"could not fill the disk of {self.path}")
        return self

    def _run(self) -> None:
        chunk = b"\xff" * _CHUNK
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while not self._stop.is_set():
                size = _CHUNK
                while size and not self._stop.is_set():
                    try:
                        os.write(fd, chunk[:size])
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        size //= 2  # take the last pages too
                self.full.set()
                self._stop.wait(0.02)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Stop filling and give the space back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
