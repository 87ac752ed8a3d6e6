"""Small file-system helpers that durability depends on, written once.

Files the broker writes hold message bodies, leases and secrets: they are created readable
and writable by their owner only (``PRIVATE_FILE``, 0600), in directories only their owner
may enter (``PRIVATE_DIRECTORY``, 0700); ``private_opener`` lets ``open()`` do the same.

What they guarantee: ``replace_atomically`` leaves either the old file or the whole new one
under ``path`` after a crash, never a torn one; with ``durable`` the new content and its
name are on disk when it returns (``sync_directory``: a file's own fsync does not cover its
name, so creates, renames and deletes need the directory synced too).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "PRIVATE_DIRECTORY",
    "PRIVATE_FILE",
    "private_opener",
    "replace_atomically",
    "sync_directory",
]

PRIVATE_FILE = 0o600
PRIVATE_DIRECTORY = 0o700


def private_opener(path: str, flags: int) -> int:
    """An ``opener`` for ``open()`` that creates the file 0600."""
    return os.open(path, flags, PRIVATE_FILE)


def sync_directory(directory: Path) -> None:
    """Make creates, renames and deletes in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, data: bytes, *, durable: bool, mode: int = PRIVATE_FILE) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)
    if durable:
        sync_directory(path.parent)
