"""Consumer-side duplicate suppression: the ids of the messages a consumer has had
delivered and acknowledged, the last ``size`` of them.

Brokers without duplicate detection (RabbitMQ, ActiveMQ Classic, a plain STOMP broker) store
again what a failover resent (F13 stamps the same id on the resend) and deliver again what a
stale acknowledge left unacknowledged (F6-F8). A consumer with a window acknowledges and
drops a message whose id it has already had delivered and acknowledged (or delivered, and the
application still holds it: the driver keeps those), so the application sees it once, as
long as the first copy is among the last ``size`` ids remembered.

When an id counts as acknowledged is the acknowledge mode's matter (``remembered_at``): at
delivery where the acknowledge is automatic or absent, at a successful ``acknowledge()`` in
the CLIENT modes, at a successful commit in a transacted session. What is rolled back,
recovered or given back is never remembered: its redelivery is a delivery. Pure: no
threads, clocks or I/O.

A window can be kept in a file (``consumer_dedup_file``), so that it survives a restart of
the consumer's process. The file is a journal, and this module owns its format and its
rules; the driver only writes the bytes it is given (``DedupJournal``):

- each change is one record, a line ``<crc32 of the rest, 8 hex digits> <JSON [op, id]>``,
  op ``+`` (remembered) or ``-`` (forgotten), appended as it happens;
- reading (``replay``) keeps every record whose checksum holds and skips any other (a
  write torn by a crash leaves at most the last record incomplete), so a torn write never
  loses the ids before it;
- the journal is bounded: once it holds more than ``size`` records beyond the window
  (``compaction_due``), it is rewritten as a snapshot of the window (one ``+`` record per
  id, oldest first), which the driver writes to a new file and renames over the old one,
  so a crash leaves either the old journal or the new one, whole. A journal just read is
  rewritten the same way before anything is appended, so that no record is ever appended
  behind a torn one.
"""

from __future__ import annotations

import enum
import json
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from hafailover.ack_modes import AckMode
from hafailover.errors import ConfigurationError

__all__ = [
    "DedupJournal",
    "DuplicateWindow",
    "Remembered",
    "encode_record",
    "remembered_at",
    "replay",
]


class Remembered(enum.Enum):
    """When a delivered message's id joins the window."""

    AT_DELIVERY = "at delivery"  # AUTO, DUPS_OK, NO_ACKNOWLEDGE
    AT_ACKNOWLEDGE = "at acknowledge"  # CLIENT, CLIENT_INDIVIDUAL
    AT_COMMIT = "at commit"  # SESSION_TRANSACTED


def remembered_at(mode: AckMode) -> Remembered:
    if mode is AckMode.SESSION_TRANSACTED:
        return Remembered.AT_COMMIT
    if mode in (AckMode.CLIENT, AckMode.CLIENT_INDIVIDUAL):
        return Remembered.AT_ACKNOWLEDGE
    return Remembered.AT_DELIVERY


class DedupJournal(Protocol):
    """Where a kept window's records go (the driver's file)."""

    def append(self, data: bytes) -> None:
        """Add records at the end."""
        ...

    def rewrite(self, data: bytes) -> None:
        """Replace the whole journal with ``data``, atomically."""
        ...


def encode_record(op: str, message_id: str) -> bytes:
    """One journal record: ``op`` is ``+`` (remembered) or ``-`` (forgotten)."""
    body = json.dumps([op, message_id], ensure_ascii=True, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _decode_record(line: bytes) -> tuple[str, str] | None:
    checksum, _, body = line.partition(b" ")
    if len(checksum) != 8:
        return None
    try:
        if int(checksum, 16) != zlib.crc32(body):
            return None
        op, message_id = json.loads(body)
    except (ValueError, TypeError):
        return None
    if op not in ("+", "-") or not isinstance(message_id, str):
        return None
    return op, message_id


def replay(data: bytes, size: int) -> tuple[tuple[str, ...], int]:
    """The ids a journal leaves in a window of ``size`` (oldest first), and how many of its
    records were skipped as damaged (a torn last write, or anything not a record)."""
    window = DuplicateWindow(size)
    skipped = 0
    lines = data.split(b"\n")
    # What follows the last newline is a record whose write never finished (or nothing).
    for number, line in enumerate(lines):
        if number == len(lines) - 1:
            skipped += 1 if line else 0
            break
        record = _decode_record(line)
        if record is None:
            skipped += 1
            continue
        op, message_id = record
        if op == "+":
            window.remember((message_id,))
        else:
            window.forget(message_id)
    return window.ids(), skipped


class DuplicateWindow:
    """The last ``size`` distinct ids remembered, oldest first out. Remembering an id again
    makes it the newest. With a ``journal`` every change is also written there as a
    record, and the journal is compacted to a snapshot when it grows past twice the
    window."""

    __slots__ = ("_ids", "_journal", "_records", "size")

    def __init__(
        self, size: int, *, journal: DedupJournal | None = None, kept: Iterable[str] = ()
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(
                f"a duplicate window holds a whole number of ids >= 1, not {size!r}"
            )
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._journal: DedupJournal | None = None
        self._records = 0
        self.remember(kept)
        self._journal = journal
        if journal is not None:
            self._compact()  # start from a whole snapshot: nothing appended after a torn record

    @property
    def compaction_due(self) -> bool:
        """The journal holds more than ``size`` records beyond the window's ids."""
        return self._records > len(self._ids) + self.size

    def _compact(self) -> None:
        assert self._journal is not None
        self._journal.rewrite(b"".join(encode_record("+", i) for i in self._ids))
        self._records = len(self._ids)

    def _write(self, data: bytes, records: int) -> None:
        journal = self._journal
        if journal is None or not data:
            return
        self._records += records
        if self.compaction_due:
            self._compact()
        else:
            journal.append(data)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, message_ids: Iterable[str | None]) -> None:
        ids = self._ids
        records: list[bytes] = []
        for message_id in message_ids:
            if message_id is None:
                continue  # a message without an id cannot be told from another
            ids[message_id] = None
            ids.move_to_end(message_id)
            if len(ids) > self.size:
                ids.popitem(last=False)
            records.append(encode_record("+", message_id))
        self._write(b"".join(records), len(records))

    def forget(self, message_id: str | None) -> None:
        """The message never reached the application after all: a copy is a delivery."""
        if message_id is not None and message_id in self._ids:
            del self._ids[message_id]
            self._write(encode_record("-", message_id), 1)

    def ids(self) -> tuple[str, ...]:
        """Oldest first."""
        return tuple(self._ids)
