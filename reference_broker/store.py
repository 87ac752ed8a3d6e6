"""The store: makes engine records durable, on the live's disk and on the backup.

A persistent send, an ack or a commit is confirmed to its client only when its records
are in the live's journal *and*, while a synchronized backup is attached, acknowledged by
the backup (synchronous replication). ``persist(records)`` returns a future that resolves
at exactly that moment.

Group commit: every record submitted during one turn of the event loop is written with
one ``append_many`` and one fsync, on a single journal thread (the journal is not
thread-safe, and every journal call, including the reads of an initial synchronization,
goes through ``run``). While the backup acknowledges one batch, the next is already
being written: a future waits for both its local sequence number and the backup's.

Without a backup the store runs degraded: confirmations need only the local write. When
a backup detaches, whatever was waiting for it is confirmed on local durability alone;
that is safe because the backup cannot activate while this node holds the witness lease.

The store never confirms anything while ``may_serve()`` is false (the fencing check):
a node that lost its lease must not tell a client that a message is safe.

Disk space: every segment's blocks are reserved when it is created (reference_broker.journal),
so only a new segment needs new space. After each write, and whenever ``check_space`` is
called, the store looks at what is left: once the active segment has less than a quarter of
a segment of room and the disk cannot hold a new segment, it calls ``on_space(reason)``, and
with None once either is true again. The node then refuses new persistent messages
(``Engine.refuse_persistent_sends``) while acknowledgements, settlements and rollbacks go on
writing into that last quarter. A batch that still finds no room (``JournalFullError``) fails
the store like any write error: the engine has already applied it, so nothing after it may be
confirmed.

Compaction: ``persist_later`` takes records encoded on the journal thread, at their place in
the order (a checkpoint of a long backlog takes the event loop too long to encode), and
``compact_before(journal, seq)`` deletes the sealed segments wholly before a sequence number
(the CHECKPOINT_BEGIN of a durable checkpoint). When to checkpoint is the node's decision;
the store never reads what the records mean.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from reference_broker.journal import CompactionReport, Journal, Record

__all__ = ["FencedError", "Replica", "Store", "compact_before"]

log = logging.getLogger(__name__)

T = TypeVar("T")


# What one persist call queued: its encoded records, or a function that encodes them.
_Part = list[tuple[int, bytes]] | Callable[[], list[tuple[int, bytes]]]


class FencedError(RuntimeError):
    """This node may no longer serve: another node holds the live role."""


def compact_before(journal: Journal, seq: int) -> CompactionReport | None:
    """Delete the journal's sealed segments whose records all come before `seq`.

    Only for a `seq` at which a complete, durable checkpoint begins: recovery needs nothing
    before it. Returns None without reading anything when no sealed segment qualifies
    (`Journal.compact` reads every sealed segment, the checkpoint's included).
    """
    sealed = journal.segments[:-1]
    if not any(segment.last_seq < seq for segment in sealed):
        return None
    return journal.compact(lambda record: record.seq >= seq)


class Replica(Protocol):
    """The live's end of the link to a synchronized backup."""

    def replicate(self, records: list[Record]) -> None:
        """Send records (already in the live's journal) to the backup, without waiting."""


class Store:
    """Durability for one live node: journal, group commit, synchronous replication."""

    def __init__(
        self,
        journal: Journal,
        *,
        may_serve: Callable[[], bool] = lambda: True,
    ) -> None:
        self.journal = journal
        self._may_serve = may_serve
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="journal"
        )
        self._pending: list[_Part] = []  # one part per waiter whose seq is still -1
        self._flush_scheduled = False
        self._writing = False
        # Futures waiting for durability, in sequence order: (seq, first seq, future, whether
        # the future's result is that first seq). The seq is the last one of the batch.
        self._waiters: deque[tuple[int, int, asyncio.Future[Any], bool]] = deque()
        self.local_seq = journal.last_seq
        self.replica: Replica | None = None  # fed every batch once a backup attaches
        self.synchronous = False  # the backup is synchronized: confirmations wait for it
        self.replica_seq = 0  # highest seq the attached backup acknowledged
        self._closed = False
        # A journal write or fsync failed: this store confirms nothing more, ever. The node
        # must stop serving (its clients would wait forever) and give the role up.
        self.failed = False
        # Why new data is refused for space (None: it is not); on_space hears every change.
        self.full: str | None = None
        self.on_space: Callable[[str | None], None] | None = None
        self.space_reserve = journal.segment_size // 4

    # --- the journal thread ---------------------------------------------------------------

    async def run(self, fn: Callable[[], T]) -> T:
        """Run a journal operation on the journal thread, in submission order."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    # --- persisting -----------------------------------------------------------------------

    def persist(self, records: Iterable[tuple[int, bytes]]) -> asyncio.Future[None]:
        """Queue encoded records; the future resolves when they are durable everywhere."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue(list(records), future, with_seq=False)
        return future

    def persist_later(self, encode: Callable[[], list[tuple[int, bytes]]]) -> asyncio.Future[int]:
        """Like `persist`, for records that `encode` produces on the journal thread.

        They take their place in the order now; the loop goes on serving while they are
        encoded and written. `encode` must only read values that nothing changes meanwhile.
        The future's result is the sequence number of the first record (0 if none).
        """
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._queue(encode, future, with_seq=True)
        return future

    def _queue(self, part: _Part, future: asyncio.Future[Any], *, with_seq: bool) -> None:
        if self._closed:
            future.set_exception(FencedError("the store is closed"))
            return
        self._pending.append(part)
        # The future waits for every record submitted so far: its seq is the last one's,
        # known once the batch is written. Until then it waits on a placeholder seq.
        self._waiters.append((-1, 0, future, with_seq))
        if not self._flush_scheduled and not self._writing:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        if self._writing or self._closed:
            return
        # Every waiter queued before this flush belongs to this batch, one part each.
        parts, self._pending = self._pending, []
        self._writing = True
        asyncio.get_running_loop().create_task(self._flush(parts))

    async def _flush(self, parts: list[_Part]) -> None:
        try:
            firsts = [0] * len(parts)
            if any(callable(part) or part for part in parts):
                journal = self.journal

                def write() -> tuple[int, list[int], list[Record]]:
                    first = journal.last_seq + 1
                    batch: list[tuple[int, bytes]] = []
                    starts: list[int] = []
                    for part in parts:
                        encoded = part() if callable(part) else part
                        starts.append(first + len(batch) if encoded else 0)
                        batch += encoded
                    last = journal.append_many(batch)
                    journal.sync()
                    records = [
                        Record(type=t, seq=first + i, payload=p) for i, (t, p) in enumerate(batch)
                    ]
                    return last, starts, records, self._space()

                last, firsts, records, full = await self.run(write)
                self._set_full(full)
                self.local_seq = last
                if self.replica is not None and records:
                    self.replica.replicate(records)
            seq = self.local_seq
            # Give this batch's waiters their sequence numbers.
            assigned = 0
            for index, (s, _, future, with_seq) in enumerate(self._waiters):
                if s == -1:
                    self._waiters[index] = (seq, firsts[assigned], future, with_seq)
                    assigned += 1
                    if assigned == len(parts):
                        break
        except Exception as exc:  # a failed write or fsync: nothing after it may be confirmed
            log.exception("journal write failed; the node stops confirming")
            self._fail_all(FencedError(f"journal write failed: {exc}"))
            self._closed = True
            self.failed = True
            return
        finally:
            self._writing = False
        self._resolve()
        if self._pending and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)

    # --- disk space -----------------------------------------------------------------------

    def _space(self) -> str | None:
        """On the journal thread: why new data must be refused for space, or None."""
        journal = self.journal
        room = journal.room
        if room >= self.space_reserve:
            return None
        try:
            stat = os.statvfs(journal.directory)
        except OSError:
            return None  # cannot tell: appends will say
        free = stat.f_bavail * stat.f_frsize
        if free >= journal.segment_size:
            return None
        return (
            f"the journal's disk is full: {free} bytes free in {journal.directory}, "
            f"a new segment needs {journal.segment_size}"
        )

    async def has_room(self, size: int) -> bool:
        """Whether ``size`` more bytes can be written now, the reserve for acknowledgements
        kept: in the active segment, or in a new one the disk can hold."""

        def check() -> bool:
            journal = self.journal
            if journal.room - self.space_reserve >= size:
                return True
            try:
                stat = os.statvfs(journal.directory)
            except OSError:
                return True  # cannot tell: appends will say
            free = stat.f_bavail * stat.f_frsize
            return free >= max(journal.segment_size, size) + self.space_reserve

        return await self.run(check)

    async def check_space(self) -> str | None:
        """Look at the disk again (space may have come back with nothing written)."""
        if self._closed:
            return self.full
        self._set_full(await self.run(self._space))
        return self.full

    def _set_full(self, reason: str | None) -> None:
        if (reason is None) == (self.full is None):
            return  # no change (a refusal keeps its first reason)
        self.full = reason
        if reason is not None:
            log.warning("refusing new persistent messages: %s", reason)
        else:
            log.warning("disk space is back: accepting persistent messages again")
        if self.on_space is not None:
            self.on_space(reason)

    async def durable_barrier(self) -> None:
        """Wait until everything persisted so far is durable everywhere it must be."""
        await self.persist([])

    async def replica_caught_up(self, timeout: float) -> bool:
        """Wait until a synchronous backup acknowledged everything written or being written.

        False if there is no synchronous backup (any more) or the timeout ran out first. For a
        hand-over, once nothing new is submitted: the acknowledgements it waits for are read by
        the replication link's own task.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.replica is not None and self.synchronous and not self._closed:
            if not self._writing and not self._pending and self.replica_seq >= self.local_seq:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return False

    async def compact_before(self, seq: int) -> CompactionReport | None:
        """`compact_before` on the journal thread, after everything submitted before it."""
        journal = self.journal
        return await self.run(lambda: compact_before(journal, seq))

    # --- replication ----------------------------------------------------------------------

    def attach_replica(self, replica: Replica) -> int:
        """A backup starts synchronizing: feed it every batch written from now on.

        Returns the last sequence number already in the journal: the backup's initial
        synchronization copies the journal up to it, and the feed carries what follows.
        Confirmations do not wait for the backup until ``replica_synchronized``.
        """
        self.replica = replica
        self.synchronous = False
        self.replica_seq = 0
        return self.local_seq

    def replica_synchronized(self, acked_seq: int) -> None:
        """The backup holds everything up to ``acked_seq``: replicate synchronously."""
        self.synchronous = True
        self.replica_seq = max(self.replica_seq, acked_seq)
        log.info("backup synchronized at seq %d: replication is synchronous", acked_seq)
        self._resolve()

    def detach_replica(self, reason: str) -> None:
        """The backup is gone: run degraded (local durability only)."""
        if self.replica is not None:
            log.warning("backup detached (%s): running live-only (degraded)", reason)
        self.replica = None
        self.synchronous = False
        self._resolve()

    def backup_acknowledged(self, seq: int) -> None:
        if seq > self.replica_seq:
            self.replica_seq = seq
            self._resolve()

    @property
    def degraded(self) -> bool:
        return not self.synchronous

    # --- resolution -----------------------------------------------------------------------

    def _resolve(self) -> None:
        if not self._may_serve():
            self._fail_all(FencedError("this node lost its lease and may not confirm"))
            return
        durable = self.local_seq
        if self.synchronous:
            durable = min(durable, self.replica_seq)
        waiters = self._waiters
        while waiters:
            seq, first, future, with_seq = waiters[0]
            if seq == -1 or seq > durable:
                break
            waiters.popleft()
            if not future.done():
                future.set_result(first if with_seq else None)

    def _fail_all(self, error: Exception) -> None:
        while self._waiters:
            _, _, future, _ = self._waiters.popleft()
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        """Stop confirming, fail what waits, and close the journal on its thread."""
        self._closed = True
        self._fail_all(FencedError("the node is stopping"))
        await self.run(self.journal.close)
        self._thread.shutdown(wait=True)
