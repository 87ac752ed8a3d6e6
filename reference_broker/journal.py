"""The broker's append-only journal: numbered segment files of checksummed records.

What it owns: one directory of segment files, the 64-bit sequence numbers of the records in it,
durability (write and fsync, by a `SyncPolicy`), crash recovery, and the deletion or rewriting of
segments the owner says are dead. Records are opaque: a type byte (1..255) and payload bytes whose
meaning (message add, ack, tx prepare/commit/rollback, duplicate id) the broker defines elsewhere.

What it never does: no threads, timers, clocks or sockets. Under `SyncPolicy.group` the owner
decides when to call `sync()`; replication sends what `records_after()` yields and the backup
stores it with `append_records()`. One process owns the directory at a time (an flock on
`journal.lock`); a `Journal` is not thread-safe.

On-disk format (all integers little-endian)
-------------------------------------------
Segment file ``journal-NNNNNNNN.seg`` (N: segment number, decimal, at least 8 digits)::

    offset  size  field
    0       8     magic b"HAFJRNL\\0"
    8       2     format version (2)
    10      2     content format: the owner's version of what its records mean (`content_format`)
    12      8     segment number, equal to the one in the file name
    20      8     prev_seq: highest sequence number assigned before this segment was created
    28      4     CRC32 of bytes 0..27
    32      ...   records, back to back

Record::

    offset  size  field
    0       4     payload length n
    4       1     record type, 1..255 (0 is never written, so zero-filled space is never a record)
    5       8     sequence number, strictly increasing through the journal (gaps allowed)
    13      2     header check: low 16 bits of CRC32 of bytes 0..12 (finds records in junk fast)
    15      n     payload
    15+n    4     CRC32 (zlib.crc32) of bytes 0..14+n: header and payload

A new segment is started when the next write would take the current one past `segment_size`;
one append or batch is never split, so a batch bigger than that makes one oversized segment.
Each segment's blocks are reserved on disk when it is created (fallocate with
FALLOC_FL_KEEP_SIZE: the file's length is what was written, so nothing below changes), so an
append into the active segment never fails for space. Only a new segment needs new space; if
the disk cannot hold one, the append raises `JournalFullError` having written nothing, and the
journal stays open (`room` says how much still fits the active segment). What a segment did
not use is given back when it is sealed and when the journal closes. Segments are created
whole (header written to a .tmp file, fsynced, renamed, directory fsynced),
so a segment file with a missing or short header did not come from a crash under a durable policy;
a .tmp file left by a crash is deleted at open. Compaction rewrites a segment the same way.

Formats
-------
The format version says how segments and records are framed; the content format, chosen by the
owner, says how it encodes its payloads (the broker passes the version of reference_broker.records),
so that code never reads records written by code that encodes them otherwise. Every segment
this journal creates or rewrites carries both. `Journal.open` checks both in every segment
before it reads a record, and refuses a segment of another format version or content format
with `JournalFormatError`, naming the file and both versions; that is not damage, so `salvage`
never sets such a segment aside. Version 1 segments, written before the content format existed
(bytes 10..11 were reserved), are *unversioned*: opened only when the owner says it reads them
(`reads_unversioned`), and never appended to (the journal starts a new segment at open), so
that an unversioned segment holds only what was written before versions existed.

Recovery rule
-------------
Segments are read in number order, whole, and every record is checked: length in bounds,
checksum, type non-zero, sequence number above everything before it (a segment's records also
above its header's prev_seq, and prev_seq never below the previous segment's last record).

- The first bad record of the LAST segment is a torn tail when it is incomplete or fails its
  checksum and no valid record (checksum good, sequence number higher) starts at any later
  byte of that segment: the segment is truncated there, `recovery.truncated` says what was
  cut, and appends continue at that offset. A crash at any byte, inside a record header
  included, recovers this way.
- Anything else is corruption: a bad record in any earlier segment, a bad record followed by a
  valid one, a record with a good checksum but type 0 or a sequence number that does not rise
  (written whole, so no tear), or a bad segment header (empty file, short header, wrong magic,
  number, checksum). `Journal.open` raises `JournalCorruptError` naming the file and
  byte offset. With `salvage=True` it keeps the records before the damage and drops the rest:
  the damaged segment is copied to ``<name>.corrupt`` and truncated (or renamed aside whole if
  its header is bad), later segments are renamed to ``<name>.corrupt``, and `recovery.salvaged`
  lists all of it. Sequence numbers then continue after the last record kept, so backups must
  resynchronize.
- Reads after open (`replay`, `records_after`, `compact`) check every checksum again; damage
  found then raises `JournalCorruptError` rather than serving the record.

Limits: if a crash persists file pages out of order (possible for writes not yet fsynced), the
unsynced tail can look like corruption; opening with `salvage=True` recovers it. Deleting a
whole segment file by hand is not detectable, because compaction deletes whole segments too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import errno
import fcntl
import math
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, ClassVar, NamedTuple, Self

import attrs

from reference_broker._files import (
    PRIVATE_DIRECTORY,
    PRIVATE_FILE,
    private_opener,
    sync_directory,
)

__all__ = [
    "DEFAULT_SEGMENT_SIZE",
    "MAX_PAYLOAD",
    "RECORD_OVERHEAD",
    "SEGMENT_HEADER_SIZE",
    "CompactionReport",
    "Dropped",
    "Journal",
    "JournalClosedError",
    "JournalCorruptError",
    "JournalError",
    "JournalFormatError",
    "JournalFullError",
    "JournalLockedError",
    "JournalSequenceError",
    "JournalUsageError",
    "Record",
    "RecoveryReport",
    "SegmentInfo",
    "SyncMode",
    "SyncPolicy",
    "check_format",
]

MAGIC = b"HAFJRNL\x00"
FORMAT_VERSION = 2
UNVERSIONED = 1  # the format version before segments said their content format
_SEGMENT_HEAD = struct.Struct("<8sHHQQ")  # magic, version, content format, number, prev_seq
MAX_CONTENT_FORMAT = 0xFFFF
_RECORD_FIELDS = struct.Struct("<IBQ")  # payload length, type, sequence number
_RECORD_HEAD = struct.Struct("<IBQH")  # the fields and their 16-bit check
_CHECK = struct.Struct("<H")
_CRC = struct.Struct("<I")
SEGMENT_HEADER_SIZE = _SEGMENT_HEAD.size + _CRC.size  # 32
RECORD_OVERHEAD = _RECORD_HEAD.size + _CRC.size  # 19
MAX_PAYLOAD = 0xFFFF_FFFF
MAX_SEQ = 0xFFFF_FFFF_FFFF_FFFF
DEFAULT_SEGMENT_SIZE = 16 * 1024 * 1024
_WRITE_BUFFER = 256 * 1024
_LOCK_NAME = "journal.lock"
_SEGMENT_NAME = re.compile(r"journal-(\d{8,})\.seg")
_TEMP_NAME = re.compile(r"journal-\d{8,}\.seg\.tmp")
# Where a record may start: its type byte is never 0 ...
_NONZERO = re.compile(rb"[^\x00]")
# ... and, if it is shorter than 16 MiB, the top byte of its length is 0 as well.
_SHORT_RECORD_LIMIT = 1 << 24
_SHORT_RECORD_START = re.compile(rb"\x00[^\x00]")  # matches 3 bytes into the record


# --- errors -------------------------------------------------------------------------------------


class JournalError(Exception):
    """Root of the journal's errors; `code` tells programs which failure it is."""

    code: ClassVar[str] = "JOURNAL"


class JournalCorruptError(JournalError, ValueError):
    """A segment holds bytes that are neither valid records nor a torn tail."""

    code = "CORRUPT"

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        super().__init__(f"{path}: offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class JournalFormatError(JournalError, ValueError):
    """A segment written in another format, or another content format, than this journal
    reads: written by other code. Not damage: never salvaged, and never read."""

    code = "FORMAT"

    def __init__(self, path: Path, found: str, expected: str) -> None:
        super().__init__(
            f"{path}: written in {found}, but this journal reads {expected}: it was written by "
            f"another version of the code; run that version, or move the journal aside"
        )
        self.path = path
        self.found = found
        self.expected = expected


class JournalUsageError(JournalError, ValueError):
    """The caller broke the journal's contract (bad argument, type or size)."""

    code = "USAGE"


class JournalSequenceError(JournalUsageError):
    """A replicated record's sequence number does not follow the journal's last one."""

    code = "SEQUENCE"


class JournalClosedError(JournalUsageError):
    """The journal was closed, by `close()` or after an I/O error made its state unknown."""

    code = "CLOSED"


class JournalFullError(JournalError, OSError):
    """No room on the disk for the next segment. Nothing of the append that needed it was
    written and the journal stays open: appends that fit the current segment still work, and
    the same append succeeds once space returns."""

    code = "FULL"

    def __init__(self, directory: Path, cause: OSError) -> None:
        super().__init__(errno.ENOSPC, f"no space left for a new journal segment in {directory}")
        self.__cause__ = cause


class JournalLockedError(JournalError, OSError):
    """Another open journal (in this or another process) holds the directory."""

    code = "LOCKED"


# --- values -------------------------------------------------------------------------------------


@attrs.frozen
class Record:
    """One journal record: the caller's type byte, its sequence number, its payload."""

    type: int
    seq: int
    payload: bytes


class SyncMode(enum.Enum):
    ALWAYS = "always"
    GROUP = "group"
    NEVER = "never"


def _sync_mode(value: SyncMode | str) -> SyncMode:
    try:
        return SyncMode(value)
    except ValueError:
        names = ", ".join(mode.value for mode in SyncMode)
        raise JournalUsageError(f"sync mode must be one of {names}, got {value!r}") from None


@attrs.frozen
class SyncPolicy:
    """When the journal fsyncs.

    always: every append/append_many/append_records is on disk before it returns.
    group:  appends reach the OS only; the owner calls `sync()` (one fsync for all of them),
            ideally every `interval` seconds. The journal keeps no clock; `interval` is the
            owner's setting carried with the policy.
    never:  no fsync at all, `sync()` only hands buffered bytes to the OS. Tests and benchmarks.
    """

    mode: SyncMode = attrs.field(converter=_sync_mode)
    interval: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.mode is SyncMode.GROUP:
            if not (math.isfinite(self.interval) and self.interval > 0):
                raise JournalUsageError(f"group sync needs an interval > 0, got {self.interval}")
        elif self.interval != 0.0:
            raise JournalUsageError(f"interval applies to group sync only, not {self.mode.value}")

    @classmethod
    def always(cls) -> SyncPolicy:
        return cls(SyncMode.ALWAYS)

    @classmethod
    def group(cls, interval: float = 0.005) -> SyncPolicy:
        return cls(SyncMode.GROUP, interval)

    @classmethod
    def never(cls) -> SyncPolicy:
        return cls(SyncMode.NEVER)

    @property
    def durable(self) -> bool:
        return self.mode is not SyncMode.NEVER


_ALWAYS = SyncPolicy.always()


@attrs.frozen
class Dropped:
    """Bytes recovery removed from the journal, and where the original bytes were kept."""

    path: Path
    offset: int
    length: int
    reason: str
    kept_as: Path | None = None


@attrs.frozen
class RecoveryReport:
    """What `Journal.open` found: records kept, a torn tail cut, corruption salvaged."""

    records: int
    segments: int
    last_seq: int
    truncated: Dropped | None = None
    salvaged: tuple[Dropped, ...] = ()

    @property
    def clean(self) -> bool:
        return self.truncated is None and not self.salvaged


@attrs.frozen
class SegmentInfo:
    """One segment as the journal sees it; the seq fields are 0 when it holds no records."""

    number: int
    path: Path
    size: int
    records: int
    first_seq: int
    last_seq: int


@attrs.frozen
class CompactionReport:
    deleted: tuple[int, ...]
    rewritten: tuple[int, ...]
    reclaimed_bytes: int


# --- encoding and scanning ----------------------------------------------------------------------


def _segment_name(number: int) -> str:
    return f"journal-{number:08d}.seg"


def _segment_header(number: int, prev_seq: int, content_format: int) -> bytes:
    head = _SEGMENT_HEAD.pack(MAGIC, FORMAT_VERSION, content_format, number, prev_seq)
    return head + _CRC.pack(zlib.crc32(head))


def _encode_into(parts: list[bytes], rtype: int, seq: int, payload: bytes) -> int:
    """Append one record's pieces to `parts` (joined once per write); return its size."""
    if not (isinstance(rtype, int) and 1 <= rtype <= 255):
        raise JournalUsageError(f"record type must be an int in 1..255, got {rtype!r}")
    if seq > MAX_SEQ:
        raise JournalUsageError("sequence numbers exhausted")
    size = len(payload)
    if size > MAX_PAYLOAD:
        raise JournalUsageError(f"payload of {size} bytes exceeds the {MAX_PAYLOAD} limit")
    fields = _RECORD_FIELDS.pack(size, rtype, seq)
    head = fields + _CHECK.pack(zlib.crc32(fields) & 0xFFFF)
    parts += (head, payload, _CRC.pack(zlib.crc32(payload, zlib.crc32(head))))
    return size + RECORD_OVERHEAD


class _Scan(NamedTuple):
    end: int  # offset of the first byte that is not part of a valid record
    records: int
    first_seq: int  # 0 when records == 0
    last_seq: int  # after_seq when records == 0
    problem: str | None  # why the bytes at `end` are not a record; None if end == len(buf)
    tearable: bool = False  # a crash mid-write can explain it: short, or checksum wrong


def _scan(buf: bytes, start: int, after_seq: int, out: list[Record] | None = None) -> _Scan:
    """Check records from `start`; collect them into `out` if given. The hot loop of recovery.

    The header check is not read here: the record's CRC covers it.
    """
    unpack_head = _RECORD_FIELDS.unpack_from
    unpack_crc = _CRC.unpack_from
    crc32 = zlib.crc32
    view = memoryview(buf)
    size = len(buf)
    offset = start
    count = first = 0
    last = after_seq
    while offset < size:
        if offset + _RECORD_HEAD.size > size:
            return _Scan(offset, count, first, last, "incomplete record header", True)
        length, rtype, seq = unpack_head(buf, offset)
        body_end = offset + _RECORD_HEAD.size + length
        if body_end + _CRC.size > size:
            return _Scan(offset, count, first, last, "incomplete record", True)
        if crc32(view[offset:body_end]) != unpack_crc(buf, body_end)[0]:
            return _Scan(offset, count, first, last, "record checksum mismatch", True)
        # A record with a good checksum but impossible content was written whole: no tear.
        if rtype == 0:
            return _Scan(offset, count, first, last, "record type 0")
        if seq <= last:
            return _Scan(offset, count, first, last, f"sequence number {seq} after {last}")
        if out is not None:
            out.append(Record(rtype, seq, buf[offset + _RECORD_HEAD.size : body_end]))
        if not count:
            first = seq
        count += 1
        last = seq
        offset = body_end + _CRC.size
    return _Scan(offset, count, first, last, None)


def _valid_record_from(buf: bytes, start: int, after_seq: int) -> int | None:
    """Offset of the first valid record at or after `start` (any alignment), or None.

    This is what tells a torn tail (nothing valid after the damage) from corruption. It runs
    only past a bad record, usually over one partial write, but must stay fast over a whole
    segment of junk: regular expressions skip, in C, the offsets where no record can start,
    and the header check rejects all but 1 in 65536 of the rest before a CRC over the claimed
    length is paid (without it, junk costs time cubic in its size).
    """
    unpack_head = _RECORD_HEAD.unpack_from
    unpack_crc = _CRC.unpack_from
    view = memoryview(buf)
    size = len(buf)
    near_end = size - RECORD_OVERHEAD - _SHORT_RECORD_LIMIT + 1  # from here lengths < 16 MiB
    offset = start
    while offset + RECORD_OVERHEAD <= size:
        if offset >= near_end:
            found = _SHORT_RECORD_START.search(buf, offset + 3)
            if found is None:
                return None
            offset = found.start() - 3
            if offset + RECORD_OVERHEAD > size:
                return None
        elif buf[offset + 4] == 0:
            found = _NONZERO.search(buf, offset + 5)
            if found is None:
                return None
            offset = found.start() - 4
            continue
        length, _, seq, check = unpack_head(buf, offset)
        body_end = offset + _RECORD_HEAD.size + length
        if (
            seq > after_seq
            and zlib.crc32(view[offset : offset + _RECORD_FIELDS.size]) & 0xFFFF == check
            and body_end + _CRC.size <= size
            and zlib.crc32(view[offset:body_end]) == unpack_crc(buf, body_end)[0]
        ):
            return offset
        offset += 1
    return None


def _format_name(version: int, content_format: int) -> str:
    if version == UNVERSIONED:
        return f"journal format {version} (unversioned: written before content formats)"
    return f"journal format {version}, content format {content_format}"


def _check_format(
    path: Path, buf: bytes, content_format: int, *, reads_unversioned: bool
) -> int | None:
    """The format version of a segment whose header is whole and sealed (None otherwise: the
    header check names the damage); JournalFormatError if this journal does not read it."""
    if len(buf) < SEGMENT_HEADER_SIZE:
        return None
    magic, version, found, _, _ = _SEGMENT_HEAD.unpack_from(buf)
    if magic != MAGIC:
        return None
    if zlib.crc32(buf[: _SEGMENT_HEAD.size]) != _CRC.unpack_from(buf, _SEGMENT_HEAD.size)[0]:
        return None
    readable = version == FORMAT_VERSION and found == content_format
    if version == UNVERSIONED and found == 0 and reads_unversioned:
        readable = True
    if not readable:
        expected = _format_name(FORMAT_VERSION, content_format)
        if reads_unversioned:
            expected += f" (and {_format_name(UNVERSIONED, 0)})"
        raise JournalFormatError(path, _format_name(version, found), expected)
    return int(version)


def check_format(
    directory: str | os.PathLike[str], content_format: int, *, reads_unversioned: bool = False
) -> None:
    """Raise JournalFormatError if a segment in `directory` is of a format `Journal.open`
    with the same arguments would refuse. Reads only the segments' headers, takes no lock and
    changes nothing: a check before anything else runs (a missing directory passes)."""
    _check_content_format(content_format)
    path = Path(directory)
    if not path.is_dir():
        return
    for name in sorted(os.listdir(path)):
        if _SEGMENT_NAME.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):  # compacted away meanwhile
                with (path / name).open("rb") as file:
                    head = file.read(SEGMENT_HEADER_SIZE)
                _check_format(
                    path / name, head, content_format, reads_unversioned=reads_unversioned
                )


def _check_content_format(content_format: int) -> None:
    if not (isinstance(content_format, int) and 0 <= content_format <= MAX_CONTENT_FORMAT):
        raise JournalUsageError(
            f"content_format must be an int in 0..{MAX_CONTENT_FORMAT}, got {content_format!r}"
        )


def _check_header(buf: bytes, number: int, min_prev_seq: int) -> tuple[int, int, str | None]:
    """Return (prev_seq, offset, problem) for a segment's header whose format was checked
    (`_check_format`); problem None if it is good."""
    if len(buf) < SEGMENT_HEADER_SIZE:
        what = "empty segment file" if not buf else f"segment header cut at {len(buf)} bytes"
        return 0, 0, f"{what} (a header is {SEGMENT_HEADER_SIZE} bytes)"
    magic, _, _, head_number, prev_seq = _SEGMENT_HEAD.unpack_from(buf)
    if magic != MAGIC:
        return 0, 0, "bad magic: not a journal segment"
    if zlib.crc32(buf[: _SEGMENT_HEAD.size]) != _CRC.unpack_from(buf, _SEGMENT_HEAD.size)[0]:
        return 0, _SEGMENT_HEAD.size, "segment header checksum mismatch"
    if head_number != number:
        return 0, 12, f"header says segment {head_number}, the file name says {number}"
    if prev_seq < min_prev_seq:
        return 0, 20, f"segment starts after seq {prev_seq}, earlier segments reach {min_prev_seq}"
    return prev_seq, 0, None


# --- file-system helpers ------------------------------------------------------------------------


def _flush_to_disk(fd: int) -> None:
    # fdatasync skips timestamps, which recovery never reads; size changes are still flushed.
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover - platforms without fdatasync
        os.fsync(fd)


_FALLOC_FL_KEEP_SIZE = 1
_libc_fallocate: Any = None


def _preallocate(fd: int, size: int) -> None:
    """Reserve disk blocks for the file's first ``size`` bytes without changing its length
    (fallocate with FALLOC_FL_KEEP_SIZE), so that writes up to there cannot fail for space.

    Raises OSError(ENOSPC) when the disk cannot hold them; where the file system or the
    platform cannot preallocate, it does nothing (writes may then fail for space).
    """
    global _libc_fallocate
    if _libc_fallocate is None:
        name = ctypes.util.find_library("c")
        function = getattr(ctypes.CDLL(name, use_errno=True), "fallocate", None) if name else None
        if function is not None:
            function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
            function.restype = ctypes.c_int
        _libc_fallocate = function or False
    if not _libc_fallocate or size <= 0:
        return
    if _libc_fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        code = ctypes.get_errno()
        if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise OSError(code, os.strerror(code))


def _release_reserve(file: BinaryIO, size: int) -> None:
    """Give back the blocks reserved past a segment's end (it is sealed, or the journal
    closes): cutting the file to its own length frees them. Only after a flush that worked,
    so that ``size`` is the file's length; best effort."""
    with contextlib.suppress(OSError, ValueError):
        os.ftruncate(file.fileno(), size)


def _lock_directory(directory: Path) -> int:
    fd = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise JournalLockedError(f"{directory} is held by another open journal") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def _aside_path(path: Path) -> Path:
    candidate = path.with_name(path.name + ".corrupt")
    counter = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.corrupt.{counter}")
        counter += 1
    return candidate


def _write_file(path: Path, data: bytes, *, durable: bool) -> None:
    with open(path, "xb", opener=private_opener) as file:
        file.write(data)
        file.flush()
        if durable:
            _flush_to_disk(file.fileno())


# --- the journal --------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Segment:
    number: int
    path: Path
    prev_seq: int
    size: int
    count: int = 0
    first_seq: int = 0
    last_seq: int = 0
    generation: int = 0  # bumped on rewrite: readers holding an offset into it must restart

    def info(self) -> SegmentInfo:
        return SegmentInfo(
            self.number, self.path, self.size, self.count, self.first_seq, self.last_seq
        )


class Journal:
    """An open journal directory. Create it with `Journal.open`."""

    def __init__(
        self,
        directory: Path,
        segment_size: int,
        policy: SyncPolicy,
        lock_fd: int,
        segments: list[_Segment],
        last_seq: int,
        next_number: int,
        recovery: RecoveryReport,
        file: BinaryIO,
        content_format: int,
    ) -> None:
        self._directory = directory
        self._content_format = content_format
        self._segment_size = segment_size
        self._policy = policy
        self._lock_fd: int | None = lock_fd
        self._segments = segments  # in number order; the last one is the active segment
        self._last_seq = last_seq
        self._next_number = next_number
        self._recovery = recovery
        self._file = file
        self._unsynced = 0
        self._closed_reason: str | None = None

    # --- opening and recovery -------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        sync: SyncPolicy = _ALWAYS,
        salvage: bool = False,
        content_format: int = 0,
        reads_unversioned: bool = False,
    ) -> Journal:
        """Open (creating if needed) and recover the journal in `directory`.

        `content_format` (0..65535) is the version of the owner's payload encoding: written
        into every segment made, required of every segment read; `reads_unversioned`: the
        owner reads segments written before content formats (see "Formats").

        Raises JournalFormatError for a segment of another format (whatever `salvage`),
        JournalCorruptError for damage that is not a torn tail unless `salvage` is set, and
        JournalLockedError if another open journal holds the directory.
        """
        if segment_size < SEGMENT_HEADER_SIZE + RECORD_OVERHEAD:
            raise JournalUsageError(f"segment_size {segment_size} is too small")
        _check_content_format(content_format)
        path = Path(directory)
        if not path.is_dir():
            path.mkdir(mode=PRIVATE_DIRECTORY, parents=True)
            if sync.durable:
                sync_directory(path.parent)  # or a crash can lose the new directory itself
        lock_fd = _lock_directory(path)
        try:
            return cls._recover(
                path,
                segment_size,
                sync,
                lock_fd,
                salvage=salvage,
                content_format=content_format,
                reads_unversioned=reads_unversioned,
            )
        except BaseException:
            os.close(lock_fd)
            raise

    @classmethod
    def _recover(
        cls,
        directory: Path,
        segment_size: int,
        policy: SyncPolicy,
        lock_fd: int,
        *,
        salvage: bool,
        content_format: int,
        reads_unversioned: bool,
    ) -> Journal:
        durable = policy.durable
        found: list[tuple[int, Path]] = []
        for name in os.listdir(directory):
            if match := _SEGMENT_NAME.fullmatch(name):
                found.append((int(match[1]), directory / name))
            elif _TEMP_NAME.fullmatch(name):
                # A segment being created or rewritten when the process died: never renamed in.
                (directory / name).unlink()
        found.sort()
        # Every format first: a journal of other code is refused before anything is changed
        # (a torn tail cut, a segment salvaged), as a whole, and before a record is read.
        versions = [
            _check_format(
                path,
                _read_head(path),
                content_format,
                reads_unversioned=reads_unversioned,
            )
            for _, path in found
        ]

        segments: list[_Segment] = []
        last_seq = 0
        truncated: Dropped | None = None
        salvaged: list[Dropped] = []
        for index, (number, path) in enumerate(found):
            data = path.read_bytes()
            problem: str | None
            if segments and number == segments[-1].number:
                prev_seq, offset, problem = 0, 0, "a second file for the same segment number"
            else:
                prev_seq, offset, problem = _check_header(data, number, last_seq)
            if problem is not None:  # nothing in a file with a bad header can be trusted
                if not salvage:
                    raise JournalCorruptError(path, offset, problem)
                salvaged += _set_aside(found[index:], None, data, problem)
                break
            scan = _scan(data, SEGMENT_HEADER_SIZE, prev_seq)
            if (
                scan.problem is not None
                and scan.tearable
                and index == len(found) - 1
                and _valid_record_from(data, scan.end + 1, scan.last_seq) is None
            ):
                truncated = Dropped(path, scan.end, len(data) - scan.end, scan.problem)
                with path.open("r+b") as torn:
                    torn.truncate(scan.end)
                    if durable:
                        _flush_to_disk(torn.fileno())
                scan = scan._replace(problem=None)
            if scan.problem is not None:
                if not salvage:
                    raise JournalCorruptError(path, scan.end, scan.problem)
                salvaged += _set_aside(found[index:], scan.end, data, scan.problem)
            last = scan.last_seq if scan.records else 0
            segments.append(
                _Segment(number, path, prev_seq, scan.end, scan.records, scan.first_seq, last)
            )
            last_seq = scan.last_seq
            if scan.problem is not None:
                break
        if salvaged:
            sync_directory(directory)

        next_number = found[-1][0] + 1 if found else 1
        # Appends never go into an unversioned segment: it holds only what older code wrote.
        unversioned_tail = bool(segments) and versions[len(segments) - 1] == UNVERSIONED
        if segments and not unversioned_tail:
            active = segments[-1]
            file = open(active.path, "r+b", buffering=_WRITE_BUFFER)  # noqa: SIM115 - kept open
            file.seek(active.size)
            # Best effort: without it, appends to this segment may fail for space.
            with contextlib.suppress(OSError):
                _preallocate(file.fileno(), segment_size)
        else:
            try:
                active, file = _create_segment(
                    directory,
                    next_number,
                    last_seq,
                    content_format,
                    durable=durable,
                    preallocate=segment_size,
                )
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise JournalFullError(directory, exc) from exc
                raise
            segments.append(active)
            next_number += 1
        report = RecoveryReport(
            records=sum(segment.count for segment in segments),
            segments=len(segments),
            last_seq=last_seq,
            truncated=truncated,
            salvaged=tuple(salvaged),
        )
        return cls(
            directory,
            segment_size,
            policy,
            lock_fd,
            segments,
            last_seq,
            next_number,
            report,
            file,
            content_format,
        )

    # --- appending ------------------------------------------------------------------------------

    def append(self, type: int, payload: bytes) -> int:
        """Append one record; return its sequence number."""
        self._check_open()
        seq = self._last_seq + 1
        parts: list[bytes] = []
        _encode_into(parts, type, seq, payload)
        self._write(b"".join(parts), 1, seq, seq)
        return seq

    def append_many(self, items: Iterable[tuple[int, bytes]]) -> int:
        """Append records as one write and (under `always`) one fsync; return the last seq.

        Not atomic across a crash: a prefix of the batch may survive, each record whole.
        """
        self._check_open()
        parts: list[bytes] = []
        first = seq = self._last_seq + 1
        for rtype, payload in items:
            _encode_into(parts, rtype, seq, payload)
            seq += 1
        if seq > first:
            self._write(b"".join(parts), seq - first, first, seq - 1)
        return self._last_seq

    def append_records(self, records: Iterable[Record]) -> int:
        """Store records verbatim, sequence numbers included (the backup's replication path).

        Sequence numbers must rise strictly and start above `last_seq`; gaps are allowed
        (a live's compaction leaves them). Nothing is written if any record is refused.
        The batch becomes one bytes object and one write: send an initial synchronization
        in batches of a few MiB, not as one. Returns the last sequence number.
        """
        self._check_open()
        parts: list[bytes] = []
        first = 0
        last = self._last_seq
        count = 0
        for record in records:
            if not (isinstance(record.seq, int) and last < record.seq <= MAX_SEQ):
                raise JournalSequenceError(
                    f"record seq {record.seq!r} does not follow seq {last} (must be higher)"
                )
            _encode_into(parts, record.type, record.seq, record.payload)
            first = first or record.seq
            last = record.seq
            count += 1
        if count:
            self._write(b"".join(parts), count, first, last)
        return self._last_seq

    def sync(self) -> None:
        """Make every append so far durable (one fsync); hand them to the OS under `never`."""
        self._check_open()
        if not self._unsynced:
            return
        try:
            self._file.flush()
            if self._policy.durable:
                _flush_to_disk(self._file.fileno())
        except OSError as exc:
            self._fail(exc)
            raise
        self._unsynced = 0

    def _write(self, data: bytes, count: int, first_seq: int, last_seq: int) -> None:
        segment = self._segments[-1]
        try:
            if segment.count and segment.size + len(data) > self._segment_size:
                segment = self._rotate()
            self._file.write(data)
            if self._policy.mode is SyncMode.ALWAYS:
                self._file.flush()
                _flush_to_disk(self._file.fileno())
            else:
                self._unsynced += len(data)
        except JournalFullError:
            raise  # no segment for it: nothing of it was written, the journal stays usable
        except OSError as exc:
            # The bytes may be partly written: stop here rather than append after them.
            self._fail(exc)
            raise
        segment.size += len(data)
        if not segment.count:
            segment.first_seq = first_seq
        segment.count += count
        segment.last_seq = last_seq
        self._last_seq = last_seq

    def _rotate(self) -> _Segment:
        # The old segment is made durable before the next exists, so only the last segment can
        # ever hold a torn tail. It stays open until the next one exists: a disk too full for
        # the next (its blocks are reserved whole) leaves this journal as it was.
        durable = self._policy.durable
        self._file.flush()
        if durable:
            _flush_to_disk(self._file.fileno())
        self._unsynced = 0
        try:
            segment, file = _create_segment(
                self._directory,
                self._next_number,
                self._last_seq,
                self._content_format,
                durable=durable,
                preallocate=self._segment_size,
            )
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise JournalFullError(self._directory, exc) from exc
            raise
        _release_reserve(self._file, self._segments[-1].size)
        self._file.close()
        self._file = file
        self._next_number += 1
        self._segments.append(segment)
        return segment

    # --- reading --------------------------------------------------------------------------------

    def replay(self) -> Iterator[Record]:
        """Every record in the journal, in sequence order (same as `records_after(0)`)."""
        return self.records_after(0)

    def records_after(self, seq: int) -> Iterator[Record]:
        """Records with a sequence number above `seq`, in order, read from disk and checked.

        Lazy, one segment in memory at a time. Records appended while iterating are yielded
        too, synced or not; segments compacted away meanwhile are skipped (their records
        were dead).
        """
        self._check_open()
        if seq < 0:
            raise JournalUsageError(f"seq must be >= 0, got {seq}")
        return self._records_after(seq)

    def _records_after(self, cursor: int) -> Iterator[Record]:
        resume: tuple[_Segment, int, int] | None = None  # (segment, generation, offset) read to
        while True:
            self._check_open()
            segment = next((s for s in self._segments if s.count and s.last_seq > cursor), None)
            if segment is None:
                return
            start = SEGMENT_HEADER_SIZE
            if resume is not None and resume[0] is segment and resume[1] == segment.generation:
                start = resume[2]
            end = segment.size
            records = self._read_records(segment, start, end)
            resume = (segment, segment.generation, end)
            if not records or records[-1].seq <= cursor:
                # The table promised a record above the cursor here; without this check a
                # file changed behind the journal's back would make this loop spin forever.
                raise JournalCorruptError(segment.path, end, f"no record above seq {cursor}")
            for record in records:
                if record.seq > cursor:
                    cursor = record.seq
                    yield record

    def _read_records(self, segment: _Segment, start: int, end: int) -> list[Record]:
        if segment is self._segments[-1]:
            try:
                self._file.flush()
            except OSError as exc:
                self._fail(exc)
                raise
        with segment.path.open("rb") as file:
            file.seek(start)
            data = file.read(end - start)
        if len(data) != end - start:
            raise JournalCorruptError(
                segment.path, start + len(data), f"segment is shorter than the {end} bytes written"
            )
        records: list[Record] = []
        scan = _scan(data, 0, 0, records)
        if scan.problem is not None:
            raise JournalCorruptError(segment.path, start + scan.end, scan.problem)
        return records

    # --- compaction -----------------------------------------------------------------------------

    def compact(
        self, is_live: Callable[[Record], bool], *, rewrite_below: float = 0.0
    ) -> CompactionReport:
        """Delete sealed segments holding no live record; optionally rewrite sparse ones.

        `is_live` is asked about every record of every sealed segment, all of which are read
        (the active one is never touched). A segment whose live records take less than
        `rewrite_below` of its record bytes is rewritten with only those (same number, same
        sequence numbers). Segments are handled oldest first, each change durable (unless the
        policy is `never`) before the next, so a crash midway leaves the older segments
        compacted and never brings an older record back without a newer one.
        """
        self._check_open()
        if not 0.0 <= rewrite_below <= 1.0:
            raise JournalUsageError(f"rewrite_below must be in 0..1, got {rewrite_below}")
        durable = self._policy.durable
        deleted: list[int] = []
        rewritten: list[int] = []
        reclaimed = 0
        for segment in self._segments[:-1]:
            records = self._read_records(segment, SEGMENT_HEADER_SIZE, segment.size)
            live = [record for record in records if is_live(record)]
            if not live:
                segment.path.unlink()
                self._segments.remove(segment)
                if durable:
                    sync_directory(self._directory)
                deleted.append(segment.number)
                reclaimed += segment.size
            elif len(live) < len(records) and rewrite_below > 0.0:
                live_bytes = sum(RECORD_OVERHEAD + len(record.payload) for record in live)
                if live_bytes < rewrite_below * (segment.size - SEGMENT_HEADER_SIZE):
                    reclaimed += self._rewrite(segment, live)
                    rewritten.append(segment.number)
        return CompactionReport(tuple(deleted), tuple(rewritten), reclaimed)

    def _rewrite(self, segment: _Segment, live: list[Record]) -> int:
        parts = [_segment_header(segment.number, segment.prev_seq, self._content_format)]
        for record in live:
            _encode_into(parts, record.type, record.seq, record.payload)
        data = b"".join(parts)
        temp = segment.path.with_name(segment.path.name + ".tmp")
        durable = self._policy.durable
        try:
            _write_file(temp, data, durable=durable)
            os.replace(temp, segment.path)  # atomic: a crash leaves the old file or the new one
        except BaseException:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        if durable:
            sync_directory(self._directory)
        reclaimed = segment.size - len(data)
        segment.size = len(data)
        segment.count = len(live)
        segment.first_seq = live[0].seq
        segment.last_seq = live[-1].seq
        segment.generation += 1
        return reclaimed

    # --- state and lifetime ---------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def content_format(self) -> int:
        return self._content_format

    @property
    def sync_policy(self) -> SyncPolicy:
        return self._policy

    @property
    def segment_size(self) -> int:
        return self._segment_size

    @property
    def last_seq(self) -> int:
        """The highest sequence number ever assigned (0 for a new journal)."""
        return self._last_seq

    @property
    def room(self) -> int:
        """Bytes that still fit the active segment, in blocks reserved for it: appends that
        fit need no new disk space."""
        return max(0, self._segment_size - self._segments[-1].size)

    @property
    def unsynced_bytes(self) -> int:
        """Bytes appended since the last fsync (always 0 under `always`)."""
        return self._unsynced

    @property
    def recovery(self) -> RecoveryReport:
        return self._recovery

    @property
    def segments(self) -> tuple[SegmentInfo, ...]:
        return tuple(segment.info() for segment in self._segments)

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    def close(self) -> None:
        """Sync (unless the policy is `never`), close the active segment, release the lock."""
        if self._closed_reason is not None:
            return
        self._closed_reason = "the journal is closed"
        try:
            self._file.flush()
            if self._policy.durable:
                _flush_to_disk(self._file.fileno())
            _release_reserve(self._file, self._segments[-1].size)
        finally:
            with contextlib.suppress(OSError):
                self._file.close()
            self._release_lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"last_seq={self._last_seq}"
        return f"<Journal {str(self._directory)!r} {state}>"

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise JournalClosedError(self._closed_reason)

    def _fail(self, exc: OSError) -> None:
        # Sticky: after a failed write or fsync the file's state is unknown (and a retried
        # fsync can report success for lost data), so only a reopen, which recovers, is safe.
        self._closed_reason = f"the journal closed after an I/O error ({exc}); reopen it"
        with contextlib.suppress(OSError, ValueError):
            self._file.close()
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None


def _read_head(path: Path) -> bytes:
    with path.open("rb") as file:
        return file.read(SEGMENT_HEADER_SIZE)


def _create_segment(
    directory: Path,
    number: int,
    prev_seq: int,
    content_format: int,
    *,
    durable: bool,
    preallocate: int = 0,
) -> tuple[_Segment, BinaryIO]:
    """Create a segment whole (header in a temp file, fsync, rename) and open it to append,
    its first ``preallocate`` bytes reserved on disk (OSError ENOSPC if they cannot be)."""
    path = directory / _segment_name(number)
    if path.exists():
        raise FileExistsError(f"{path} exists already")
    temp = path.with_name(path.name + ".tmp")
    # Left by an attempt that failed without cleaning up (only this journal, under its lock,
    # makes them): a full disk retried must not find it in the way.
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    file = open(temp, "x+b", buffering=_WRITE_BUFFER, opener=private_opener)  # noqa: SIM115
    renamed = False
    try:
        file.write(_segment_header(number, prev_seq, content_format))
        file.flush()
        _preallocate(file.fileno(), preallocate)
        if durable:
            _flush_to_disk(file.fileno())
        temp.rename(path)  # the open handle follows the file
        renamed = True
        if durable:
            sync_directory(directory)
    except BaseException:
        # Closing flushes what is buffered, which fails again on a full disk: the file is
        # closed all the same, and must still be removed.
        with contextlib.suppress(OSError):
            file.close()
        with contextlib.suppress(OSError):
            (path if renamed else temp).unlink()
        raise
    return _Segment(number, path, prev_seq, SEGMENT_HEADER_SIZE), file


def _set_aside(
    found: list[tuple[int, Path]], keep_upto: int | None, data: bytes, reason: str
) -> list[Dropped]:
    """Salvage: move the damaged segment (found[0]) and all later ones out of the journal.

    With `keep_upto`, the damaged segment's header is good: its original bytes are copied
    aside and it is truncated to its records before the damage. Without, it moves whole.
    """
    dropped: list[Dropped] = []
    path = found[0][1]
    aside = _aside_path(path)
    if keep_upto is not None:
        _write_file(aside, data, durable=True)
        with path.open("r+b") as file:
            file.truncate(keep_upto)
            _flush_to_disk(file.fileno())
        dropped.append(Dropped(path, keep_upto, len(data) - keep_upto, reason, aside))
    else:
        path.rename(aside)
        dropped.append(Dropped(path, 0, len(data), reason, aside))
    for _, later in found[1:]:
        aside = _aside_path(later)
        size = later.stat().st_size
        later.rename(aside)
        dropped.append(Dropped(later, 0, size, f"follows the damage in {path.name}", aside))
    return dropped
