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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from reference_broker.journal import Journal, Record

__all__ = ["FencedError", "Replica", "Store"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class FencedError(RuntimeError):
    """This node may no longer serve: another node holds the live role."""


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
        self._pending: list[tuple[int, bytes]] = []
        self._flush_scheduled = False
        self._writing = False
        # Futures waiting for durability, in sequence order: (seq, future).
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.local_seq = journal.last_seq
        self.replica: Replica | None = None  # fed every batch once a backup attaches
        self.synchronous = False  # the backup is synchronized: confirmations wait for it
        self.replica_seq = 0  # highest seq the attached backup acknowledged
        self._closed = False

    # --- the journal thread ---------------------------------------------------------------

    async def run(self, fn: Callable[[], T]) -> T:
        """Run a journal operation on the journal thread, in submission order."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    # --- persisting -----------------------------------------------------------------------

    def persist(self, records: Iterable[tuple[int, bytes]]) -> asyncio.Future[None]:
        """Queue encoded records; the future resolves when they are durable everywhere."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if self._closed:
            future.set_exception(FencedError("the store is closed"))
            return future
        self._pending.extend(records)
        # The future waits for every record submitted so far: its seq is the last one's,
        # known once the batch is written. Until then it waits on a placeholder seq.
        self._waiters.append((-1, future))
        if not self._flush_scheduled and not self._writing:
            self._flush_scheduled = True
            loop.call_soon(self._start_flush)
        return future

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        if self._writing or self._closed:
            return
        batch, self._pending = self._pending, []
        # Every waiter queued before this flush belongs to this batch.
        waiting = [i for i, (seq, _) in enumerate(self._waiters) if seq == -1]
        self._writing = True
        asyncio.get_running_loop().create_task(self._flush(batch, len(waiting)))

    async def _flush(self, batch: list[tuple[int, bytes]], waiter_count: int) -> None:
        try:
            if batch:
                journal = self.journal

                def write() -> tuple[int, list[Record]]:
                    first = journal.last_seq + 1
                    last = journal.append_many(batch)
                    journal.sync()
                    return last, [
                        Record(type=t, seq=first + i, payload=p) for i, (t, p) in enumerate(batch)
                    ]

                last, records = await self.run(write)
                self.local_seq = last
                if self.replica is not None:
                    self.replica.replicate(records)
            seq = self.local_seq
            # Give this batch's waiters their sequence number.
            assigned = 0
            for index, (s, future) in enumerate(self._waiters):
                if s == -1:
                    self._waiters[index] = (seq, future)
                    assigned += 1
                    if assigned == waiter_count:
                        break
        except Exception as exc:  # a failed write or fsync: nothing after it may be confirmed
            log.exception("journal write failed; the node stops confirming")
            self._fail_all(FencedError(f"journal write failed: {exc}"))
            self._closed = True
            return
        finally:
            self._writing = False
        self._resolve()
        if self._pending and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)

    async def durable_barrier(self) -> None:
        """Wait until everything persisted so far is durable everywhere it must be."""
        await self.persist([])

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
            seq, future = waiters[0]
            if seq == -1 or seq > durable:
                break
            waiters.popleft()
            if not future.done():
                future.set_result(None)

    def _fail_all(self, error: Exception) -> None:
        while self._waiters:
            _, future = self._waiters.popleft()
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        """Stop confirming, fail what waits, and close the journal on its thread."""
        self._closed = True
        self._fail_all(FencedError("the node is stopping"))
        await self.run(self.journal.close)
        self._thread.shutdown(wait=True)
