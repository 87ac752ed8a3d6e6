"""One broker node: a process that is live or backup, and changes role safely.

Theory of operation
-------------------
A node runs one asyncio loop and is in one of two roles at a time:

- LIVE: it holds the witness lease (reference_broker.witness), serves STOMP and AMQP
  clients, writes the journal and streams it to the backup. Before any effect it checks
  its lease; when the lease may no longer be served (a pause past it) or a renewal is
  FENCED, it stops serving at once: listeners and client connections are closed, nothing
  more is confirmed, and it turns backup.
- BACKUP: it connects to the other node's replication port, copies its journal into a fresh
  one (initial synchronization) and follows it. Only a synchronized backup may take over,
  and only through the witness: after it lost the live past the heartbeat timeout, it
  activates when the live's lease has run out (or the live's process has provably exited).

Which node may serve after a restart is decided by the activation sequence: a node records
in its data directory the activation it last served under. At start it activates on its
own only when the witness is new, or names this node as the last holder with that very
activation; any other node joins as backup, so stale data is never served.

Failback: a node started with ``--role live`` and ``--allow-failback`` that finds the other
node active joins as backup, and once synchronized asks it to hand the role back. The claim
in the witness, not HANDOVER_READY, decides: a backup that lost its link reads the witness
before anything else, and a hand-over claim naming it is its to serve.

Compaction: the live checkpoints its engine into the journal (CHECKPOINT_BEGIN, the state,
CHECKPOINT_END; see reference_broker.records) once the journal holds ``checkpoint_segments``
sealed segments written since the last checkpoint and at least ``checkpoint_ratio`` times what
the next checkpoint should take (the last one's size, scaled by the messages stored now, which
engine statistics count cheaply); once the checkpoint is durable (on the backup too, while it
is synchronous) it deletes the segments wholly before the BEGIN. The checkpoint reaches the
backup like any batch, and the backup deletes the same way when it has stored a complete one.
A journal that ends inside a checkpoint (torn by a crash) gets a new one before anything is
served, because recovery would take later records for part of the torn one. A checkpoint
that fails is reported and tried again after a pause that doubles up to 10 s, and one the
disk has no room for is postponed the same way: compaction never stops for good. The same
loop looks at the disk four times a second, so that persistent sends refused for a full disk
(reference_broker.store) are accepted again once space returns.

The lease is renewed by ``LeaseKeeper`` on a thread of its own, so that client work on the
event loop (a login flood, a big dispatch) cannot starve it; the loop still checks the lease
before every effect and fences when it lapses. The keeper renews only while the loop shows
it is alive (a beat every 20 ms, within two leases), so a hung loop still loses the
role to the backup.

The node writes ``status.json`` in its data directory at every role change so that
harnesses (``BrokerPair``) and ``hafailover pair up`` can wait for it; while live, also
when the measured lease-renewal gap or event-loop stall grows (``lease_renewal_max_gap``,
``loop_max_stall``, in seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from reference_broker._files import PRIVATE_DIRECTORY, replace_atomically
from reference_broker.amqp.server import AmqpConnection
from reference_broker.core import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_MESSAGE_SIZE,
    BrokerCore,
    ServeConfig,
)
from reference_broker.engine import (
    DEFAULT_DEAD_LETTER_QUEUE,
    DEFAULT_DUPLICATE_ID_MAX_BYTES,
    DEFAULT_DUPLICATE_ID_RETENTION,
    DEFAULT_MAX_ADDRESS_BYTES,
    DEFAULT_MAX_DELIVERY_ATTEMPTS,
    MESSAGE_OVERHEAD,
    AddressFullPolicy,
    AddressLimit,
    Engine,
    EngineConfig,
)
from reference_broker.journal import (
    DEFAULT_SEGMENT_SIZE,
    RECORD_OVERHEAD,
    Journal,
    JournalError,
    JournalFormatError,
    Record,
    SegmentInfo,
    SyncPolicy,
    check_format,
)
from reference_broker.records import (
    RECORD_FORMAT,
    CheckpointBegin,
    CheckpointEnd,
    RecordError,
    RecordType,
    decode,
)
from reference_broker.replication import (
    HANDOVER_TIMEOUT,
    BackupLink,
    LiveReplicationServer,
    PairSecretError,
    client_tls_context,
    load_pair_secret,
)
from reference_broker.stomp.server import StompConnection
from reference_broker.store import FencedError, Store, compact_before
from reference_broker.tls import server_context
from reference_broker.users import UsersFile, login_guard
from reference_broker.witness import Lease, Outcome, Timing, Witness

__all__ = ["BackupCompactor", "Checkpointer", "LeaseKeeper", "Node", "NodeConfig", "main"]

log = logging.getLogger("reference_broker.node")

LIVE = "live"
BACKUP = "backup"

CHECKPOINT_SEGMENTS = 3
CHECKPOINT_RATIO = 2.0
_CHECKPOINT_CHECK_INTERVAL = 0.25  # seconds between looks at the journal's size
_CHECKPOINT_MAX_BACKOFF = 10.0  # the longest pause after failed checkpoints


@attrs.frozen
class NodeConfig:
    node_id: str
    role: str  # the preferred role at start: "live" or "backup"
    data_dir: Path
    pair_dir: Path
    host: str = "127.0.0.1"
    stomp_port: int = 61613
    amqp_port: int = 5672
    replication_port: int = 61700
    peer_host: str = "127.0.0.1"
    peer_replication_port: int | None = None
    peer_stomp_port: int | None = None
    peer_amqp_port: int | None = None
    users_file: Path | None = None
    allow_anonymous: bool = False
    heartbeat_timeout: float = 1.0
    lease: float = 1.5
    sync: str = "always"
    allow_failback: bool = True
    topology_extension: bool = True
    # TLS on both client listeners: this node's certificate and key; with tls_client_ca,
    # clients must present a certificate that CA signed (mutual TLS).
    tls_cert: Path | None = None
    # The host name clients are told (topology); None: ``host``. Over TLS it must be a name
    # the certificate gives, which an address may not be.
    announce_host: str | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # The pair secret both nodes prove they hold on the replication link; None: the file
    # PAIR_SECRET_NAME in pair_dir, made by the first node to start (docs/security.md).
    pair_secret_file: Path | None = None
    # AMQP: take a durable message's message-id as its duplicate id (off: _AMQ_DUPL_ID only).
    amqp_message_id_duplicates: bool = False
    # The largest message body a client may send (STOMP and AMQP); larger ones are refused.
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    # Client connections served at once, every accepted socket in all and the logged-in ones
    # per user (0: no cap).
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_user: int = 0
    max_connection_ttl: float = 300.0
    segment_size: int = DEFAULT_SEGMENT_SIZE
    checkpoint_segments: int = CHECKPOINT_SEGMENTS
    checkpoint_ratio: float = CHECKPOINT_RATIO
    # Duplicate ids (docs/broker.md): forgotten once both beyond the newest
    # duplicate_id_cache_size of their address and older than duplicate_id_retention seconds,
    # or when the address's ids exceed duplicate_id_max_bytes.
    duplicate_id_cache_size: int = 20_000
    duplicate_id_retention: float = DEFAULT_DUPLICATE_ID_RETENTION
    duplicate_id_max_bytes: int = DEFAULT_DUPLICATE_ID_MAX_BYTES
    # Poison messages (docs/client.md): a message whose delivery failed this many times goes
    # to the dead-letter queue (0: never); both nodes must agree, as the pair's options do.
    max_delivery_attempts: int = DEFAULT_MAX_DELIVERY_ATTEMPTS
    dead_letter_queue: str = DEFAULT_DEAD_LETTER_QUEUE
    # What each address may hold, and what a send to a full one meets (engine.AddressLimit);
    # address_limits: exceptions for single addresses.
    address_limit: AddressLimit = attrs.field(factory=AddressLimit)
    address_limits: tuple[tuple[str, AddressLimit], ...] = ()

    @property
    def timing(self) -> Timing:
        # The lease is checked against heartbeat_timeout + 1 s for the takeover deadline:
        # margin and grace are a fifth of it, renewals every third.
        return Timing(lease=self.lease, margin=self.lease / 5, grace=self.lease / 5)

    def topology(self) -> dict[str, tuple[str, ...]]:
        host = self.announce_host or self.host
        peer = self.announce_host or self.peer_host
        stomp = [f"{host}:{self.stomp_port}"]
        amqp = [f"{host}:{self.amqp_port}"]
        if self.peer_stomp_port:
            stomp.append(f"{peer}:{self.peer_stomp_port}")
        if self.peer_amqp_port:
            amqp.append(f"{peer}:{self.peer_amqp_port}")
        return {"stomp": tuple(stomp), "amqp": tuple(amqp)}


class Checkpointer:
    """The live's compaction: checkpoints the engine into the journal when the journal has
    grown enough, then deletes the segments before the checkpoint."""

    def __init__(
        self,
        engine: Engine,
        store: Store,
        *,
        segments: int,
        ratio: float,
        max_backoff: float = _CHECKPOINT_MAX_BACKOFF,
    ) -> None:
        if segments < 1 or not ratio >= 0:
            raise ValueError(f"checkpoint segments {segments} < 1 or ratio {ratio} < 0")
        if not max_backoff >= _CHECKPOINT_CHECK_INTERVAL:
            raise ValueError(f"checkpoint max_backoff {max_backoff} < {_CHECKPOINT_CHECK_INTERVAL}")
        self.engine = engine
        self.store = store
        self.segments = segments
        self.ratio = ratio
        self.max_backoff = max_backoff
        self.begin_seq = 0  # where the last checkpoint began
        self.size = 0  # journal bytes of the last checkpoint
        self.stored = 0  # messages stored when it was taken
        self.count = 0
        # Failed or postponed checkpoints since the last one that worked, and why the last
        # one did not: what an operator (and a test) reads to see compaction is stuck.
        self.failures = 0
        self.last_failure: str | None = None

    def due(self, segments: tuple[SegmentInfo, ...]) -> bool:
        """Enough sealed segments since the last checkpoint to delete, and a journal big
        enough that the next checkpoint costs less than what it frees."""
        sealed = sum(1 for s in segments[:-1] if s.first_seq > self.begin_seq)
        total = sum(s.size for s in segments)
        return sealed >= self.segments and total >= self.ratio * self.estimate()

    def estimate(self) -> float:
        """The next checkpoint's size: the last one's, scaled by the messages stored now (a
        drained backlog must not keep the journal at twice its old size)."""
        return self.size * (self._stored() + 1) / (self.stored + 1)

    def _stored(self) -> int:
        stats = self.engine.stats()
        return stats.messages + stats.in_flight

    async def checkpoint(self) -> None:
        """Journal a checkpoint after everything the engine did so far; once it is durable
        everywhere, delete the segments before it. Raises FencedError if it never is."""
        engine = self.engine
        # The records not yet drained come before the checkpoint, which covers their effect.
        records = engine.drain_records()
        if records:
            # The checkpoint's own future says whether these became durable too.
            before = self.store.persist([r.encode() for r in records])
            before.add_done_callback(lambda future: future.cancelled() or future.exception())
        checkpoint = engine.take_checkpoint()  # nothing awaited since the drain
        stored = self._stored()
        sizes: list[int] = []

        def encode() -> list[tuple[int, bytes]]:
            encoded = checkpoint.encode()
            sizes.append(sum(RECORD_OVERHEAD + len(payload) for _, payload in encoded))
            return encoded

        started = time.monotonic()
        begin_seq = await self.store.persist_later(encode)
        self.begin_seq = begin_seq
        self.size = sizes[0]
        self.stored = stored
        self.count += 1
        written = time.monotonic() - started
        report = await self.store.compact_before(begin_seq)
        log.info(
            "checkpoint %d: %d bytes at seq %d in %.3fs; compaction deleted %d segments (%d bytes)",
            checkpoint.checkpoint_id,
            self.size,
            begin_seq,
            written,
            0 if report is None else len(report.deleted),
            0 if report is None else report.reclaimed_bytes,
        )

    async def run(self) -> None:
        """Checkpoint whenever due, until cancelled or the store stops confirming.

        Also looks at the disk each time (``Store.check_space``), so that persistent sends
        refused for space are accepted again once space returns. A checkpoint the disk has no
        room for is postponed (writing it would fail the store); one that fails is reported
        and tried again. Either way the next try waits twice as long as the last, up to
        ``max_backoff``: compaction is never given up for good.
        """
        store = self.store
        journal = store.journal
        loop = asyncio.get_running_loop()
        next_try = 0.0
        while True:
            await asyncio.sleep(_CHECKPOINT_CHECK_INTERVAL)
            await store.check_space()  # every time: a pause of compaction is not one of sends
            if loop.time() < next_try:
                continue
            segments = await store.run(lambda: journal.segments)
            if not self.due(segments):
                continue
            # The first checkpoint is at most what the journal holds; later ones are sized
            # by the last.
            needed = int(1.5 * self.estimate()) if self.count else sum(s.size for s in segments)
            if not await store.has_room(needed):
                next_try = loop.time() + self._failed(
                    f"postponed: no room on the disk for {needed} bytes"
                )
                continue
            try:
                await self.checkpoint()
            except FencedError:
                return  # the node stops serving: it confirms nothing more
            except Exception as exc:  # reported, and tried again
                log.exception("checkpoint or compaction failed")
                next_try = loop.time() + self._failed(f"{type(exc).__name__}: {exc}")
            else:
                if self.failures:
                    log.warning("checkpoint %d taken after %d failures", self.count, self.failures)
                self.failures = 0
                self.last_failure = None

    def _failed(self, reason: str) -> float:
        """Count and report a checkpoint that did not happen; the pause before the next."""
        self.failures += 1
        self.last_failure = reason
        delay = min(self.max_backoff, _CHECKPOINT_CHECK_INTERVAL * 2**self.failures)
        log.warning(
            "journal compaction: checkpoint not taken (%s); %d in a row, next try in %.2fs",
            reason,
            self.failures,
            delay,
        )
        return delay


class BackupCompactor:
    """The backup's compaction: watches the records it stores, on its journal thread, and once
    a checkpoint is complete and durable deletes the segments before it."""

    def __init__(self) -> None:
        self.begin: tuple[int, int] | None = None  # (id, seq) of the last CHECKPOINT_BEGIN

    def __call__(self, journal: Journal, records: list[Record]) -> None:
        for record in records:
            if record.type not in (RecordType.CHECKPOINT_BEGIN, RecordType.CHECKPOINT_END):
                continue
            try:
                frame = decode(record.type, record.payload)
            except RecordError:
                # Leave the deletion to a later checkpoint rather than lose the link over it.
                log.exception("unreadable checkpoint record at seq %d", record.seq)
                continue
            if isinstance(frame, CheckpointBegin):
                self.begin = (frame.checkpoint_id, record.seq)
            elif isinstance(frame, CheckpointEnd) and self.begin is not None:
                checkpoint_id, begin_seq = self.begin
                if frame.checkpoint_id != checkpoint_id:
                    continue
                self.begin = None
                try:
                    report = compact_before(journal, begin_seq)
                except (JournalError, OSError):
                    # Kept segments cost disk only; the next checkpoint deletes them.
                    log.exception("backup journal compaction failed")
                    continue
                if report is not None:
                    log.info(
                        "checkpoint %d stored at seq %d: compaction deleted %d segments (%d bytes)",
                        checkpoint_id,
                        begin_seq,
                        len(report.deleted),
                        report.reclaimed_bytes,
                    )


class LeaseKeeper:
    """Renews the live's lease on its own thread (see the module's theory of operation).

    Renewals and the drop of the lease take one lock, so a lease the loop dropped is never
    brought back by a renewal that raced with it. The keeper renews only a lease that may
    still be served: one that lapsed (the process was paused past it) is the loop's to fence.

    A renewal that fails with OSError (the pair directory cannot be written: a full or
    read-only disk, a shared file system gone) leaves the old lease standing (the witness
    wrote nothing that counts): the keeper logs it once, says it in ``renew_error``, and tries
    again every ``_RETRY`` until the directory takes it or the lease runs out and the loop
    fences. Any other failure drops the lease at once, logged: the thread never dies silently.
    """

    _POLL = 0.01  # seconds between the thread's looks at the clock
    _RETRY = 0.05  # seconds between renewals while the pair directory refuses them

    def __init__(self, node: Node) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        # Liveness only (the loop checks the lease before every effect): long enough for a
        # loop starved of CPU (1.96 s seen at a load of 22 on two cores), short enough that a
        # hung one loses the role within 2 leases + lease + grace.
        self._stall_limit = 2 * node.config.lease
        self.loop_seen = time.monotonic()
        self.loop_max_stall = 0.0
        self.max_gap = 0.0  # longest time between two renewals (the first from the claim)
        self.renewals = 0
        self.renew_error: str | None = None  # why renewals fail now; None while they work
        self.renew_failures = 0  # renewals that failed with OSError, in all
        self._retry_at = 0.0
        lease = node.lease
        self._last = lease.renewed_at if lease is not None else time.monotonic()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._beat: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._beat = asyncio.get_running_loop().create_task(self._beat_forever())
        self._thread.start()

    def stop(self, *, keep_lease: bool = False) -> None:
        """No renewal after this returns; without keep_lease the node's lease is dropped too.
        Waits at most for one renewal in progress."""
        with self._lock:
            self._stopped.set()
            if not keep_lease:
                self._node.lease = None
        if self._beat is not None:
            self._beat.cancel()

    async def _beat_forever(self) -> None:
        period = 0.02
        while True:
            before = time.monotonic()
            self.loop_seen = before
            await asyncio.sleep(period)
            self.loop_max_stall = max(self.loop_max_stall, time.monotonic() - before - period)

    def _run(self) -> None:
        try:
            self._renew_while_due()
        except Exception:
            log.exception(
                "%s: the lease keeper failed: dropping the lease (the node fences itself)",
                self._node.config.node_id,
            )
            with self._lock:
                self._node.lease = None

    def _renew_while_due(self) -> None:
        node = self._node
        while not self._stopped.wait(self._POLL):
            with self._lock:
                if self._stopped.is_set():
                    return
                lease = node.lease
                if lease is None:
                    return
                now = time.monotonic()
                if not lease.renew_due(now) or not lease.may_serve(now):
                    continue
                if now - self.loop_seen > self._stall_limit:
                    continue  # the loop is hung: let the lease run out, the backup takes over
                if now < self._retry_at:
                    continue
                try:
                    decision = node.witness.renew(node.config.node_id, lease.activation)
                except OSError as exc:
                    self._renewal_failed(lease, now, exc)
                    continue
                if self.renew_error is not None:
                    log.warning(
                        "%s: lease renewed again after %d failed attempts",
                        node.config.node_id,
                        self.renew_failures,
                    )
                    self.renew_error = None
                if decision.outcome is Outcome.RENEWED and decision.lease is not None:
                    node.lease = decision.lease
                    self.max_gap = max(self.max_gap, decision.lease.renewed_at - self._last)
                    self._last = decision.lease.renewed_at
                    self.renewals += 1
                elif decision.outcome is Outcome.FENCED:
                    log.warning("%s fenced: %s", node.config.node_id, decision.reason)
                    node.lease = None
                    return

    def _renewal_failed(self, lease: Lease, now: float, exc: OSError) -> None:
        """The pair directory refused a renewal: the old lease stands until it runs out."""
        self.renew_failures += 1
        self._retry_at = now + self._RETRY
        if self.renew_error is None:
            log.error(
                "%s cannot renew its lease in %s: %s; retrying until the lease runs out in "
                "%.2fs, then it stops serving",
                self._node.config.node_id,
                self._node.config.pair_dir,
                exc,
                max(0.0, lease.serve_until - now),
            )
        self.renew_error = f"{type(exc).__name__}: {exc}"


class Node:
    """A node process's state across role changes."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.role = BACKUP
        self.activation = 0
        self.lease: Lease | None = None
        self.witness = Witness(config.pair_dir, config.timing)
        self.users = (
            UsersFile.load(config.users_file) if config.users_file is not None else UsersFile()
        )
        self._stopping = asyncio.Event()
        self.synchronized = False
        self.degraded = True
        self._pending_activation: int | None = None
        self.eligible: tuple[str, int] | None = None  # (live, activation) of a synced journal
        self._backup_store: Store | None = None
        self._keeper: LeaseKeeper | None = None
        # Until then (time.monotonic()) the start rule leaves the role to an eligible backup:
        # set when this live fenced itself over a failed journal (_leave_role_to_backup).
        self._start_rule_after = 0.0
        self._failback_postponed = False  # no room for a failback: said once per change
        # The newest activation this process served under, whether node.json kept it or not.
        self._activation_served = 0
        for directory in (config.data_dir, config.pair_dir):
            # Journals, leases and the pair secret: for this node's user alone, even in a
            # directory made before (mkdir's mode applies only to a new one).
            directory.mkdir(mode=PRIVATE_DIRECTORY, parents=True, exist_ok=True)
            directory.chmod(PRIVATE_DIRECTORY)
        # A journal of another record format is refused before this node takes any role: as
        # live it could not read it, and as backup it would delete it to copy the live's.
        check_format(self.journal_dir, RECORD_FORMAT, reads_unversioned=True)
        self.pair_secret = load_pair_secret(config.pair_dir, config.pair_secret_file)
        # Verified logins travel to the backup as digests under a key derived from this secret.
        self.users.verified_logins.use_pair_secret(self.pair_secret)

    @property
    def journal_dir(self) -> Path:
        return self.config.data_dir / "journal"

    def _open_journal(self) -> Journal:
        """The journal in this node's format; unversioned journals (written before formats
        were recorded) are read as this format, which decodes every record they hold."""
        return Journal.open(
            self.journal_dir,
            sync=_sync_policy(self.config.sync),
            segment_size=self.config.segment_size,
            content_format=RECORD_FORMAT,
            reads_unversioned=True,
        )

    # --- persistent identity ---------------------------------------------------------------

    @property
    def _identity_path(self) -> Path:
        return self.config.data_dir / "node.json"

    def _served_activation(self) -> int:
        """The newest activation this node served under: node.json's, or the one this
        process recorded if the file could not keep it (a full disk, a torn write)."""
        try:
            recorded = int(json.loads(self._identity_path.read_text())["activation"])
        except (OSError, ValueError, KeyError, TypeError):
            recorded = 0
        return max(recorded, self._activation_served)

    def _record_activation(self, activation: int) -> None:
        """Record the activation this node serves under (the start rule reads it back).

        Called once the witness gave this node the role: an exception here would end the
        process holding a fresh claim, and its peer, seeing the role move on, would wait for
        a live that never serves. On a full disk the file is written over in place (its own
        blocks hold it), as status.json is; if even that fails, the older record stays, which
        only makes a restart less willing to take this node for the one with the newest data.
        """
        self._activation_served = max(self._activation_served, activation)
        value = {"node_id": self.config.node_id, "activation": activation}
        try:
            _write_json(self._identity_path, value)
        except OSError as exc:
            try:
                _overwrite(self._identity_path, json.dumps(value).encode())
            except OSError as again:
                log.error(  # noqa: TRY400 - both causes are the story, not a traceback
                    "%s: cannot record activation %d in %s (%s; in place: %s): serving without "
                    "it; a restart will not count on this node having the newest data",
                    self.config.node_id,
                    activation,
                    self._identity_path,
                    exc,
                    again,
                )
            else:
                log.warning(
                    "%s: cannot replace %s (%s): activation %d written in place",
                    self.config.node_id,
                    self._identity_path.name,
                    exc,
                    activation,
                )

    def write_status(self, **extra: Any) -> None:
        config = self.config
        path = config.data_dir / "status.json"
        status = self._status(config, extra)
        try:
            _write_json(path, status)
        except OSError as exc:
            # A full disk must not take the node down, nor leave a stale status behind: write
            # over the old file's blocks (a reader may see it torn for a moment), or remove it.
            log.warning("cannot replace status.json (%s): writing it in place", exc)
            try:
                _overwrite(path, json.dumps(status).encode())
            except OSError:
                log.exception("cannot write status.json: removing the stale one")
                with contextlib.suppress(OSError):
                    path.unlink()

    def _status(self, config: NodeConfig, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "node_id": config.node_id,
            "role": self.role,
            "pid": os.getpid(),
            "host": config.host,
            "stomp_port": config.stomp_port,
            "amqp_port": config.amqp_port,
            "replication_port": config.replication_port,
            "activation": self.activation,
            "synchronized": self.synchronized,
            "degraded": self.degraded,
            # Full password derivations so far (logins the pair verified before cost none).
            "login_derivations": login_guard(self.users).derivations,
            "time": time.time(),
            **self._lease_figures(),
            **extra,
        }

    def _lease_figures(self) -> dict[str, Any]:
        keeper = self._keeper
        if keeper is None or self.role != LIVE:
            return {}
        return {
            "lease_renewal_interval": self.config.timing.renew_interval,
            "lease_renewal_max_gap": round(keeper.max_gap, 4),
            "lease_renewals": keeper.renewals,
            "loop_max_stall": round(keeper.loop_max_stall, 4),
        }

    # --- main loop -------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        self.role = LIVE if self._may_start_live() else BACKUP
        while not self._stopping.is_set():
            if self.role == LIVE:
                self.role = await self._run_live()
            else:
                self.role = await self._run_backup()
        self.write_status(stopped=True)

    def stop(self) -> None:
        self._stopping.set()

    def _may_start_live(self) -> bool:
        """Activate at start only with the newest data: a new pair, or our own last activation."""
        state = self.witness.read()
        if state is None:
            return self.config.role == LIVE
        served = self._served_activation()
        return state.holder in (self.config.node_id, None) and state.activation == served

    # --- live ------------------------------------------------------------------------------

    async def _acquire(self) -> bool:
        """Take (or resume) the live role through the witness; False if another holds it."""
        witness = self.witness
        node_id = self.config.node_id
        addresses = [f"{self.config.host}:{self.config.stomp_port}"]
        pending, self._pending_activation = self._pending_activation, None
        try:
            if pending is not None:
                decision = witness.renew(node_id, pending)
            else:
                decision = witness.try_activate(node_id, addresses)
        except OSError as exc:
            # The pair directory cannot be written (cut off, read-only, full): this node
            # cannot hold a lease, so it does not take the role, and lives on as backup to
            # try again, as when another holds it. Raised, it ended the process.
            log.error(  # noqa: TRY400 - the cause is the story, not a traceback
                "%s cannot take the live role: the witness is not writable: %s", node_id, exc
            )
            return False
        if decision.outcome not in (Outcome.ACTIVATED, Outcome.RENEWED) or decision.lease is None:
            log.info("%s not activated: %s", node_id, decision.reason)
            return False
        self.lease = decision.lease
        self.activation = decision.lease.activation
        self._record_activation(self.activation)
        if not await self._wait_not_before():
            return False
        log.info("%s is live under activation %d (%s)", node_id, self.activation, decision.reason)
        return True

    async def _wait_not_before(self) -> bool:
        """Wait out Lease.not_before (the old live renewed while we took over), renewing as due."""
        while self.lease is not None:
            now = time.monotonic()
            if self.lease.may_serve(now):
                return True
            if now >= self.lease.not_before or self.lease.renew_due(now):
                try:
                    decision = self.witness.renew(self.config.node_id, self.activation)
                except OSError as exc:
                    log.error(  # noqa: TRY400 - the cause is the story, not a traceback
                        "%s fenced before serving: cannot renew: %s", self.config.node_id, exc
                    )
                    self.lease = None
                    return False
                if decision.outcome is not Outcome.RENEWED or decision.lease is None:
                    log.warning(
                        "%s fenced before serving: %s", self.config.node_id, decision.reason
                    )
                    self.lease = None
                    return False
                self.lease = decision.lease
            await asyncio.sleep(min(0.02, max(0.0, self.lease.not_before - time.monotonic())))
        return False

    def may_serve(self) -> bool:
        lease = self.lease
        return lease is not None and lease.may_serve(time.monotonic())

    async def _run_live(self) -> str:
        config = self.config
        if not await self._acquire():
            return BACKUP
        # Recovering a long journal can take longer than the lease: the keeper renews it.
        keeper = self._keeper = LeaseKeeper(self)
        keeper.start()
        try:
            prepared = await self._prepare_store()
        except BaseException:
            keeper.stop()
            raise
        if prepared is None:
            keeper.stop()  # serve nothing; the lease runs out and the backup may take over
            return BACKUP
        engine, store, checkpointer = prepared
        core = BrokerCore(
            engine,
            store,
            self.users,
            ServeConfig(
                node_id=config.node_id,
                topology=config.topology(),
                heartbeat=config.heartbeat_timeout / 2,
                max_connection_ttl=config.max_connection_ttl,
                allow_anonymous=config.allow_anonymous,
                amqp_message_id_duplicates=config.amqp_message_id_duplicates,
                max_body_size=config.max_message_size,
                max_connections=config.max_connections,
                max_connections_per_user=config.max_connections_per_user,
                topology_extension=config.topology_extension,
            ),
            may_serve=self.may_serve,
        )
        handed_over = asyncio.Event()
        serve_again = asyncio.Event()  # a hand-over failed after the listeners were closed
        connections: set[StompConnection | AmqpConnection] = set()

        def stomp_factory() -> StompConnection:
            connection = StompConnection(core, on_lost=connections.discard)
            connections.add(connection)
            return connection

        def amqp_factory() -> AmqpConnection:
            connection = AmqpConnection(core, on_lost=connections.discard)
            connections.add(connection)
            return connection

        async def handover() -> int:
            # Failback: stop serving, let everything reach the backup, give the role away
            # in the witness, and only then tell the backup (it starts by renewing).
            await stop_serving()
            backup = replication.backup_id
            if not await store.replica_caught_up(HANDOVER_TIMEOUT) or backup is None:
                serve_again.set()  # the backup is gone or stuck: keep the role
                raise ConnectionError("the backup did not acknowledge everything in time")
            self._give_role_to(backup)
            handed_over.set()
            return store.local_seq

        replication = LiveReplicationServer(
            store,
            node_id=config.node_id,
            activation=self.activation,
            timeout=config.heartbeat_timeout,
            on_handover=handover,
            on_eligibility=self._record_eligibility,
            secret=self.pair_secret,
            tls=(
                server_context(config.tls_cert, config.tls_key, None)
                if config.tls_cert is not None and config.tls_key is not None
                else None
            ),
            certificate=_certificate_der(config.tls_cert),
            logins=self.users.verified_logins,
        )
        servers: list[asyncio.Server] = []

        async def stop_serving() -> None:
            for server in servers:
                server.close()
            for connection in list(connections):
                if connection.transport is not None:
                    connection.transport.abort()
            connections.clear()

        loop = asyncio.get_running_loop()
        tls = (
            server_context(config.tls_cert, config.tls_key, config.tls_client_ca)
            if config.tls_cert is not None and config.tls_key is not None
            else None
        )
        try:
            servers.append(
                await loop.create_server(
                    stomp_factory, config.host, config.stomp_port, reuse_address=True, ssl=tls
                )
            )
            servers.append(
                await loop.create_server(
                    amqp_factory, config.host, config.amqp_port, reuse_address=True, ssl=tls
                )
            )
            await replication.start(config.host, config.replication_port)
        except OSError as exc:
            log.error("cannot listen: %s", exc)  # noqa: TRY400 - the reason is the whole story
            for server in servers:
                server.close()
            await replication.close()
            await store.close()
            # Serve nothing and give the role up at once: the start rule (in the backup loop)
            # activates this node again when it can, unless an eligible backup takes over.
            keeper.stop()
            self.witness.release(config.node_id, self.activation)
            await asyncio.sleep(0.5)
            return BACKUP
        core.start()
        compaction = loop.create_task(checkpointer.run())
        self.synchronized = False
        self.degraded = True
        self.write_status()
        log.info(
            "%s serving STOMP on %s:%d and AMQP on %s:%d (%s)",
            config.node_id,
            config.host,
            config.stomp_port,
            config.host,
            config.amqp_port,
            "degraded: no backup yet",
        )
        next_role = BACKUP
        measured = (-1.0, -1.0, -1)
        next_report = 0.0
        try:
            while True:
                if self._stopping.is_set():
                    next_role = LIVE
                    break
                if handed_over.is_set():
                    break
                if serve_again.is_set():
                    # Listeners and connections are closed: start over under this activation.
                    log.warning("%s: hand-over abandoned: serving again", config.node_id)
                    self._pending_activation = self.activation
                    next_role = LIVE
                    break
                if store.failed:
                    # Confirms nothing more: stop serving. Every record the backup acknowledged
                    # stays there, so it keeps its eligibility and takes over once the lease
                    # runs out.
                    log.error("%s: the journal failed: fencing itself", config.node_id)
                    replication.keep_eligibility()
                    if replication.synchronized:
                        self._leave_role_to_backup(replication.backup_id)
                    keeper.stop()
                    self._fenced_status()
                    break
                now = time.monotonic()
                lease = self.lease
                if lease is None or not lease.may_serve(now):
                    log.warning(
                        "%s: lease no longer valid: fencing itself%s",
                        config.node_id,
                        ""
                        if keeper.renew_error is None
                        else f" (renewals failing: {keeper.renew_error})",
                    )
                    self._fenced_status()
                    break
                if replication.failed is not None:
                    # It could not record that the backup it lost is no longer eligible, so it
                    # must confirm nothing without it: stop serving; the backup holds every
                    # record confirmed and may take over once the lease runs out.
                    log.error("%s: %s: fencing itself", config.node_id, replication.failed)
                    keeper.stop()
                    self._fenced_status()
                    break
                if (
                    keeper.max_gap,
                    keeper.loop_max_stall,
                    keeper.renewals,
                ) != measured and now >= next_report:
                    # The figures tests and operators read (docs/security.md); not too often.
                    measured = (keeper.max_gap, keeper.loop_max_stall, keeper.renewals)
                    next_report = now + 0.25
                    self.write_status()
                # Not degraded once the backup is eligible: it holds every confirmed record.
                degraded = store.degraded or not replication.synchronized
                if degraded != self.degraded:
                    self.degraded = degraded
                    self.write_status()
                    log.info(
                        "%s: %s",
                        config.node_id,
                        "degraded (live-only)" if self.degraded else "replicating synchronously",
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 0.02)
        finally:
            keeper.stop(keep_lease=next_role != BACKUP)
            await stop_serving()
            core.stop()
            compaction.cancel()
            with contextlib.suppress(BaseException):
                await compaction
            await replication.close()
            await store.close()
            if self._stopping.is_set() and self.lease is not None:
                self.witness.release(config.node_id, self.activation)
                self.lease = None
        return next_role

    def _leave_role_to_backup(self, backup: str | None) -> None:
        """A live fenced over a failed journal: its synchronized backup holds everything
        confirmed and takes over once the lease and grace have run out. Both nodes then wait
        for the same moment (this one by the start rule, as the last holder of the newest
        data), and this one must not win that race: its disk is the one that failed, and a
        claim it made would leave the backup, seeing the role move on, following it instead.
        So the start rule waits twice as long as the backup needs, plus a heart-beat timeout;
        after that (the backup gone too) this node may serve again."""
        timing = self.config.timing
        wait = 2 * (timing.lease + timing.grace) + self.config.heartbeat_timeout
        self._start_rule_after = time.monotonic() + wait
        log.warning(
            "%s: leaving the role to backup %s: not activating again for %.1fs",
            self.config.node_id,
            backup,
            wait,
        )

    def _fenced_status(self) -> None:
        """Say at once that this node no longer serves: closing down can take a while."""
        self.role = BACKUP
        self.synchronized = False
        self.degraded = True
        self.write_status()

    async def _prepare_store(self) -> tuple[Engine, Store, Checkpointer] | None:
        """Open and recover the journal; None if it cannot be made ready to serve."""
        config = self.config
        journal = await asyncio.to_thread(self._open_journal)
        started = time.monotonic()
        engine = await asyncio.to_thread(
            lambda: Engine.recover(
                (decode(r.type, r.payload) for r in journal.replay()),
                EngineConfig(
                    node_id=config.node_id,
                    first_message_id=self.activation << 40,
                    duplicate_cache_size=config.duplicate_id_cache_size,
                    duplicate_id_retention=config.duplicate_id_retention,
                    duplicate_id_max_bytes=config.duplicate_id_max_bytes,
                    max_delivery_attempts=config.max_delivery_attempts or None,
                    dead_letter_queue=config.dead_letter_queue,
                    address_limit=config.address_limit,
                    address_limits=dict(config.address_limits),
                ),
            )
        )
        log.info("journal recovered in %.3fs", time.monotonic() - started)
        # What recovery built lives as long as the node serves: keep it out of the collector's
        # sight, so that a full collection does not walk it while the lease waits for renewal.
        gc.freeze()
        store = Store(journal, may_serve=self.may_serve)
        # A disk too full for new data refuses persistent sends; acknowledgements go on.
        store.on_space = engine.refuse_persistent_sends
        checkpointer = Checkpointer(
            engine, store, segments=config.checkpoint_segments, ratio=config.checkpoint_ratio
        )
        if engine.torn_checkpoint:
            log.warning("the journal ends inside a checkpoint: writing a new one before serving")
            try:
                await checkpointer.checkpoint()
            except (FencedError, JournalError, OSError) as exc:
                log.error("cannot checkpoint the journal: %s", exc)  # noqa: TRY400
                await store.close()
                return None
        return engine, store, checkpointer

    def _give_role_to(self, backup: str | None) -> None:
        assert backup is not None
        if self._keeper is not None:
            self._keeper.stop()
        self.lease = None
        decision = self.witness.hand_over(
            self.config.node_id,
            self.activation,
            backup,
            [f"{self.config.peer_host}:{self.config.peer_stomp_port}"],
        )
        log.info("%s: %s", self.config.node_id, decision.reason)

    # --- backup ----------------------------------------------------------------------------

    def _eligibility_path(self, activation: int) -> Path:
        return self.config.pair_dir / f"eligible-{activation}.json"

    def _record_eligibility(self, backup_id: str, eligible: bool) -> None:
        """Live side: say whether the backup may take over from this activation.

        Written (and fsynced) before the store changes mode, so a backup that lost the link
        never takes over from a live that went on confirming without it.
        """
        _write_json(
            self._eligibility_path(self.activation),
            {"backup": backup_id, "eligible": eligible, "time": time.time()},
            durable=True,
        )

    def _eligibility_recorded(self, activation: int) -> bool:
        try:
            value = json.loads(self._eligibility_path(activation).read_text())
        except (OSError, ValueError):
            return False
        return bool(value.get("eligible")) and value.get("backup") == self.config.node_id

    async def _fresh_store(self) -> Store:
        """A new, empty journal for an initial synchronization (the old one is stale)."""
        await self._close_backup_store()
        self.eligible = None
        await asyncio.to_thread(shutil.rmtree, self.journal_dir, True)
        journal = await asyncio.to_thread(self._open_journal)
        self._backup_store = Store(journal)
        return self._backup_store

    async def _close_backup_store(self) -> None:
        if self._backup_store is not None:
            await self._backup_store.close()
            self._backup_store = None

    def _synchronized(self, live_id: str, activation: int) -> None:
        self.eligible = (live_id, activation)
        self.synchronized = True
        self.write_status()

    async def _run_backup(self) -> str:
        config = self.config
        self.synchronized = False
        self.degraded = True
        self.write_status()
        if config.peer_replication_port is None:
            log.error("a backup needs --peer-replication-port; waiting to be stopped")
            await self._stopping.wait()
            return BACKUP
        try:
            while not self._stopping.is_set():
                link = BackupLink(
                    node_id=config.node_id,
                    timeout=config.heartbeat_timeout,
                    open_store=self._fresh_store,
                    on_synchronized=self._synchronized,
                    on_appended=BackupCompactor(),
                    secret=self.pair_secret,
                    tls=client_tls_context() if config.tls_cert is not None else None,
                    on_logins=self.users.absorb_logins,
                )
                follower = asyncio.get_running_loop().create_task(
                    link.follow(config.peer_host, config.peer_replication_port)
                )
                outcome = await self._watch_link(link, follower)
                if outcome is not None:
                    return outcome
                self.synchronized = False
                self.write_status()
                if self.eligible is not None and await self._take_over():
                    return LIVE
                # No live to follow: a node that fenced itself, or could not listen, with no
                # eligible backup to take over still holds the newest data, and the witness
                # says so. The start rule brings it back once its old lease has run out (later
                # after a failed journal, when the backup has its turn first).
                if (
                    time.monotonic() >= self._start_rule_after
                    and self._may_start_live()
                    and self._activate_again()
                ):
                    return LIVE
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 1.0 if link.refused else 0.1)
            return BACKUP
        finally:
            await self._close_backup_store()

    async def _watch_link(self, link: BackupLink, follower: asyncio.Task[None]) -> str | None:
        """Follow the live; LIVE after a failback hand-over, BACKUP to stop, None: link ended."""
        config = self.config
        handover: asyncio.Task[int] | None = None
        try:
            while not follower.done():
                if self._stopping.is_set():
                    return BACKUP
                if (
                    link.synchronized
                    and handover is None
                    and config.role == LIVE
                    and config.allow_failback
                    and await self._room_to_serve(link)
                ):
                    log.info(
                        "%s synchronized: asking %s to hand back", config.node_id, link.live_id
                    )
                    # Asked once per link; the live answers within HANDOVER_TIMEOUT or gives up
                    # and ends the link (then the next link asks again).
                    handover = asyncio.get_running_loop().create_task(
                        asyncio.wait_for(
                            link.request_handover(),
                            HANDOVER_TIMEOUT + 2 * config.heartbeat_timeout,
                        )
                    )
                if handover is not None and handover.done():
                    break
                # A live paused by SIGSTOP sends nothing: give up on the link after the
                # heartbeat timeout so that the backup can take over.
                if link.silent_for(time.monotonic()) > config.heartbeat_timeout:
                    log.warning("%s: live silent past the heartbeat timeout", config.node_id)
                    return None
                await asyncio.sleep(0.02)
            if handover is None:
                return None
            # The link may have ended right after HANDOVER_READY: it fails the request then.
            final: int | None = None
            with contextlib.suppress(ConnectionError, TimeoutError):
                final = await handover
            store = link.store
            while final is not None and store is not None and store.journal.last_seq < final:
                if follower.done() or self._stopping.is_set():
                    return None
                await asyncio.sleep(0.005)
            handed = self._handed_to_us(link.activation)
            if handed is not None:
                self._pending_activation = handed
                return LIVE
            if final is not None:
                log.warning("%s: handed back, but the witness does not say so", config.node_id)
            return None if follower.done() else await self._follow_on(link, follower)
        finally:
            if handover is not None and not handover.done():
                handover.cancel()
            ended_by_itself = follower.done()
            if not ended_by_itself:
                follower.cancel()
            with contextlib.suppress(BaseException):
                await follower
            if ended_by_itself and not follower.cancelled():
                failure = follower.exception()
                if failure is not None:
                    # A full disk or a protocol error ends the link from this side: say which,
                    # or the operator sees only "lost live". No live to connect to is routine
                    # (the backup loop retries ten times a second): not worth a warning.
                    log.log(
                        logging.WARNING if link.live_id is not None else logging.DEBUG,
                        "%s: the link to live %s failed: %s: %s",
                        config.node_id,
                        link.live_id,
                        type(failure).__name__,
                        failure,
                    )

    async def _follow_on(self, link: BackupLink, follower: asyncio.Task[None]) -> str | None:
        """A hand-over that did not happen: follow until the link ends (the live ends it)."""
        config = self.config
        while not follower.done():
            if self._stopping.is_set():
                return BACKUP
            if link.silent_for(time.monotonic()) > config.heartbeat_timeout:
                return None
            await asyncio.sleep(0.02)
        return None

    async def _room_to_serve(self, link: BackupLink) -> bool:
        """Whether this backup's disk takes new data as a live's must (room for the reserve
        of acknowledgements in the active segment, or for a new segment): a failback to a
        node whose disk is full moves the role to where sends are refused and the first
        writes past the reserve fail the journal. Said in the log once per change."""
        store = link.store
        room = store is None or await store.has_room(0)
        if room == self._failback_postponed:
            self._failback_postponed = not room
            log.log(
                logging.INFO if room else logging.WARNING,
                "%s: %s",
                self.config.node_id,
                "room on the disk again: may ask for the role back"
                if room
                else "not asking for the role back: no room on this node's disk for new data",
            )
        return room

    def _handed_to_us(self, activation: int) -> int | None:
        """The activation the live of `activation` handed to this node, if the witness says so.

        The live hands the role over (Witness.hand_over, the next activation, kind hand_over)
        only once this node acknowledged everything it wrote, durably: such a claim is ours
        to serve, whether HANDOVER_READY arrived or not; but only once. A claim this node has
        served already (node.json says so) is one it stopped serving, fenced: serving it
        again would repeat whatever made it stop (a full disk: fenced and back every few
        milliseconds, renewing the lease the other node waits for, and no one served).
        """
        state = self.witness.read()
        if (
            state is not None
            and state.holder == self.config.node_id
            and state.kind == "hand_over"
            and state.activation == activation + 1
            and self._served_activation() < state.activation
        ):
            return state.activation
        return None

    def _activate_again(self) -> bool:
        """The start rule from the backup loop: activate once our own old lease ran out."""
        config = self.config
        decision = self.witness.try_activate(config.node_id, [f"{config.host}:{config.stomp_port}"])
        if decision.outcome is not Outcome.ACTIVATED or decision.lease is None:
            return False
        self.lease = decision.lease
        self.activation = decision.lease.activation
        self._pending_activation = self.activation  # _run_live renews it
        self._record_activation(self.activation)
        log.warning("%s activates again with the newest data: %s", config.node_id, decision.reason)
        return True

    async def _take_over(self) -> bool:
        """The live is lost: activate when the witness allows it and we are still eligible."""
        assert self.eligible is not None
        live_id, activation = self.eligible
        config = self.config
        log.warning("%s lost live %s: waiting for its lease", config.node_id, live_id)
        last_outcome: Outcome | None = None
        while not self._stopping.is_set():
            # A hand-over whose HANDOVER_READY was lost (or still on its way when the link
            # went silent): the claim, not the link, says who serves.
            handed = self._handed_to_us(activation)
            if handed is not None:
                await self._close_backup_store()
                self._pending_activation = handed
                log.warning(
                    "%s: live %s handed activation %d to this node", config.node_id, live_id, handed
                )
                return True
            if not self._eligibility_recorded(activation):
                log.info(
                    "%s: live %s revoked our eligibility: resynchronizing", config.node_id, live_id
                )
                return False
            state = self.witness.read()
            if state is None or state.activation != activation:
                log.info(
                    "%s: the role moved on (activation %s); staying backup",
                    config.node_id,
                    None if state is None else state.activation,
                )
                self.eligible = None
                return False
            decision = self.witness.try_activate(
                config.node_id, [f"{config.host}:{config.stomp_port}"]
            )
            if decision.outcome is Outcome.ACTIVATED and decision.lease is not None:
                await self._close_backup_store()
                self.lease = decision.lease
                self.activation = decision.lease.activation
                self._pending_activation = self.activation
                self._record_activation(self.activation)
                log.warning("%s takes over: %s", config.node_id, decision.reason)
                return True
            if decision.outcome is not last_outcome:
                last_outcome = decision.outcome
                log.info("%s: %s (%s)", config.node_id, decision.outcome.value, decision.reason)
            await asyncio.sleep(0.02)
        return False


async def _port_open(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 0.2)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


def _certificate_der(path: Path | None) -> bytes | None:
    """The first certificate of a PEM file, as DER: what the live presents over TLS."""
    if path is None:
        return None
    text = path.read_text(encoding="ascii")
    end = "-----END CERTIFICATE-----"
    return ssl.PEM_cert_to_DER_cert(text[: text.index(end) + len(end)])


def _sync_policy(name: str) -> SyncPolicy:
    return {"always": SyncPolicy.always, "group": SyncPolicy.group, "never": SyncPolicy.never}[
        name
    ]()


def _write_json(path: Path, value: dict[str, Any], *, durable: bool = False) -> None:
    replace_atomically(path, json.dumps(value).encode(), durable=durable)


def _overwrite(path: Path, data: bytes) -> None:
    """Write ``data`` over the start of an existing file, then cut it to that length: on a
    full disk the file's own blocks still hold it (a new file would need new ones)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hafailover broker run", description="Run one broker node.")
    p.add_argument("--node-id", required=True)
    p.add_argument("--role", choices=[LIVE, BACKUP], required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--pair-dir", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--stomp-port", type=int, required=True)
    p.add_argument("--amqp-port", type=int, required=True)
    p.add_argument("--replication-port", type=int, required=True)
    p.add_argument("--peer-host", default="127.0.0.1")
    p.add_argument("--peer-replication-port", type=int)
    p.add_argument("--peer-stomp-port", type=int)
    p.add_argument("--peer-amqp-port", type=int)
    p.add_argument("--users", type=Path, help="users file (hashed passwords)")
    p.add_argument("--allow-anonymous", action="store_true")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument("--lease", type=float, default=1.5)
    p.add_argument("--sync", choices=["always", "group", "never"], default="always")
    p.add_argument("--no-failback", action="store_true")
    p.add_argument("--tls-cert", type=Path, help="serve clients over TLS with this certificate")
    p.add_argument("--announce-host", help="the host name clients are told (default: --host)")
    p.add_argument("--tls-key", type=Path, help="the key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", type=Path, help="require client certificates signed by this CA"
    )
    p.add_argument(
        "--no-topology-extension",
        action="store_true",
        help="announce the AMQP topology only as the standard failover-server-list",
    )
    p.add_argument(
        "--segment-size", type=int, default=DEFAULT_SEGMENT_SIZE, help="journal segment bytes"
    )
    p.add_argument(
        "--checkpoint-segments",
        type=int,
        default=CHECKPOINT_SEGMENTS,
        help="checkpoint once this many journal segments were sealed since the last one",
    )
    p.add_argument(
        "--checkpoint-ratio",
        type=float,
        default=CHECKPOINT_RATIO,
        help="... and the journal is at least this many times the last checkpoint's size",
    )
    p.add_argument(
        "--pair-secret-file",
        type=Path,
        help="the pair secret (hex, mode 0600) for nodes that share no pair directory; "
        "default: pair.secret in --pair-dir, made by the first node",
    )
    p.add_argument(
        "--amqp-message-id-duplicates",
        action="store_true",
        help="AMQP: a durable message without _AMQ_DUPL_ID is deduplicated by its message-id",
    )
    p.add_argument(
        "--max-message-size",
        type=_positive_bytes,
        default=DEFAULT_MAX_MESSAGE_SIZE,
        help="the largest message body a client may send, in bytes (default: 64 MiB, the "
        "client's MAX_MESSAGE_BYTES); a larger one is refused with this limit named",
    )
    p.add_argument(
        "--duplicate-id-cache-size",
        type=_count,
        default=20_000,
        help="duplicate ids each address keeps whatever their age (0: no duplicate detection)",
    )
    p.add_argument(
        "--duplicate-id-retention",
        type=_seconds,
        default=DEFAULT_DUPLICATE_ID_RETENTION,
        help="seconds a duplicate id is kept beyond that count (default: 3600)",
    )
    p.add_argument(
        "--duplicate-id-max-bytes",
        type=_positive_bytes,
        default=DEFAULT_DUPLICATE_ID_MAX_BYTES,
        help="the most bytes of duplicate ids one address keeps, retention or not "
        "(default: 64 MiB); reaching it is logged once per address",
    )
    p.add_argument(
        "--max-delivery-attempts",
        type=delivery_attempts,
        default=DEFAULT_MAX_DELIVERY_ATTEMPTS,
        help="failed deliveries after which a message goes to the dead-letter queue "
        "(default: 10; 0: never)",
    )
    p.add_argument(
        "--dead-letter-queue",
        type=dead_letter_queue,
        default=DEFAULT_DEAD_LETTER_QUEUE,
        help="where messages go after their last failed delivery or when a client rejects "
        "them (default: queue://DLQ)",
    )
    p.add_argument(
        "--max-connections",
        type=_cap,
        default=DEFAULT_MAX_CONNECTIONS,
        help="client connections served at once, both protocols together, logged in or not "
        f"(default: {DEFAULT_MAX_CONNECTIONS}; 0: no cap)",
    )
    p.add_argument(
        "--max-connections-per-user",
        type=_cap,
        default=0,
        help="logged-in client connections one user may hold at once (default 0: no cap)",
    )
    p.add_argument(
        "--max-address-bytes",
        type=_limit,
        default=DEFAULT_MAX_ADDRESS_BYTES,
        help="the most one address may hold, in bytes: each message counted as its body and "
        f"headers plus {MESSAGE_OVERHEAD} (default: 1 GiB; 0: no limit)",
    )
    p.add_argument(
        "--max-address-messages",
        type=_limit,
        default=0,
        help="the most messages one address may hold (default 0: no limit)",
    )
    p.add_argument(
        "--address-full-policy",
        type=_policy,
        default=AddressFullPolicy.FAIL,
        help="what a send to a full address meets: FAIL (refused with the address and its "
        "limit named; the default) or BLOCK (the producer waits until there is room)",
    )
    p.add_argument(
        "--address-limit",
        type=_address_limit,
        action="append",
        default=[],
        metavar="ADDRESS=BYTES,MESSAGES[,POLICY]",
        help="another limit for one address, e.g. queue://orders=1048576,0,BLOCK (0: no "
        "limit; without POLICY, --address-full-policy's); may be given more than once",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def _limit(text: str) -> int:
    return _count(text, "0 (no limit)")


def _policy(text: str) -> AddressFullPolicy:
    try:
        return AddressFullPolicy(text.upper())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not FAIL or BLOCK: {text!r}") from None


def _address_limit(text: str) -> tuple[str, int, int, AddressFullPolicy | None]:
    address, sep, rest = text.rpartition("=")
    fields = rest.split(",")
    if not sep or not address.startswith(("queue://", "topic://")) or len(fields) not in (2, 3):
        raise argparse.ArgumentTypeError(
            f"not ADDRESS=BYTES,MESSAGES[,POLICY] with a queue:// or topic:// address: {text!r}"
        )
    policy = _policy(fields[2]) if len(fields) == 3 else None
    return address, _limit(fields[0]), _limit(fields[1]), policy


def _count(text: str, zero: str = "0") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be {zero} or more, not {value}")
    return value


def delivery_attempts(text: str) -> int:
    """--max-delivery-attempts (also checked by ``pair up``, which passes it on)."""
    return _count(text)


def dead_letter_queue(text: str) -> str:
    """--dead-letter-queue (also checked by ``pair up``, which passes it on)."""
    if not text.startswith("queue://") or len(text) == len("queue://") or "::" in text:
        raise argparse.ArgumentTypeError(f"must be a queue://NAME, not {text!r}")
    return text


def _cap(text: str) -> int:
    return _count(text, "0 (no cap)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < 1e12:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, not {text}")
    return value


def _positive_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, not {value}")
    return value


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        node_id=args.node_id,
        role=args.role,
        data_dir=args.data_dir,
        pair_dir=args.pair_dir,
        host=args.host,
        stomp_port=args.stomp_port,
        amqp_port=args.amqp_port,
        replication_port=args.replication_port,
        peer_host=args.peer_host,
        peer_replication_port=args.peer_replication_port,
        peer_stomp_port=args.peer_stomp_port,
        peer_amqp_port=args.peer_amqp_port,
        users_file=args.users,
        allow_anonymous=args.allow_anonymous,
        heartbeat_timeout=args.heartbeat_timeout,
        lease=args.lease,
        sync=args.sync,
        allow_failback=not args.no_failback,
        topology_extension=not args.no_topology_extension,
        tls_cert=args.tls_cert,
        announce_host=args.announce_host,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        segment_size=args.segment_size,
        checkpoint_segments=args.checkpoint_segments,
        checkpoint_ratio=args.checkpoint_ratio,
        pair_secret_file=args.pair_secret_file,
        amqp_message_id_duplicates=args.amqp_message_id_duplicates,
        max_message_size=args.max_message_size,
        max_connections=args.max_connections,
        max_connections_per_user=args.max_connections_per_user,
        duplicate_id_cache_size=args.duplicate_id_cache_size,
        duplicate_id_retention=args.duplicate_id_retention,
        duplicate_id_max_bytes=args.duplicate_id_max_bytes,
        max_delivery_attempts=args.max_delivery_attempts,
        dead_letter_queue=args.dead_letter_queue,
        address_limit=AddressLimit(
            args.max_address_bytes, args.max_address_messages, args.address_full_policy
        ),
        address_limits=tuple(
            (address, AddressLimit(size, count, policy or args.address_full_policy))
            for address, size, count, policy in args.address_limit
        ),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.node_id} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The journal thread runs CPU-bound Python (encoding a checkpoint, compaction's scans)
    # while the event loop drops the GIL at every socket write. With the default 5 ms switch
    # interval the loop waits that long to get it back after each write (the convoy effect):
    # a dispatch of a thousand deliveries then holds up the lease renewal past the lease.
    sys.setswitchinterval(0.0001)
    try:
        node = Node(config_from_args(args))
    except (PairSecretError, JournalFormatError) as exc:
        log.error("%s", exc)  # noqa: TRY400 - the reason is the whole story
        return 2
    asyncio.run(node.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
