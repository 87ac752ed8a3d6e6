"""Journal replication between the live and its backup.

Theory of operation
-------------------
Before anything else the two ends prove to each other that they belong to the pair: both
hold the pair secret (``load_pair_secret``), and neither sends it. The backup says HELLO with
its node id and a fresh random nonce; the live answers CHALLENGE with its own id and nonce
and ``HMAC(secret, "live" | transcript)``; the backup checks it and answers PROOF with
``HMAC(secret, "backup" | transcript)``, which the live checks. The transcript holds both
ids, both nonces and, over TLS, the SHA-256 of the live's certificate as each end sees it
(RFC 5929's tls-server-end-point), so an end in the middle that terminates TLS itself gets
proofs that fit nowhere. A wrong proof ends the connection with a log line that says so; a
connection that has not proved itself holds no slot and gets no journal byte. With TLS the
link is encrypted: the live listens with the node's certificate, the backup connects with TLS
and needs no CA, since the proof covers the certificate.

HELLO and CHALLENGE also say which record format (reference_broker.records.RECORD_FORMAT) each
end's journal holds. Once the proofs check, each end refuses a peer of another format, with a
log line naming both: a backup must never store records it could not read after a takeover.
A live that does not say (it predates record formats) is followed: its records are what an
unversioned journal holds, which this format reads. A backup that does not say is refused: it
may not read what this live writes (so upgrade the backup first, then the live).

Once both proved themselves the backup is attached (one at a time). The live answers
SYNC_BEGIN with the last sequence number already in its journal, streams every record up
to it (initial synchronization), then SYNC_END. From the moment it said SYNC_BEGIN, every
batch the live writes is also sent, in order, after the synchronization part. The backup
appends everything to a fresh journal with the live's own sequence numbers and
acknowledges (ACK seq) every batch once it is on its disk.

At SYNC_END the live's store turns synchronous at once (nothing more is confirmed to a
client before the backup's ACK) and the live notes its last written sequence number, the
target: the records confirmed during the copy (the backlog) are at or below it. The backup
acknowledges nothing before SYNC_END, then every batch once it is on its disk. It is
*eligible* to take over only once it acknowledged the target: then it holds every record
confirmed before SYNC_END, and synchronous replication covers every one after. A backup
that loses the link is no longer eligible for anything written after the loss; when it
reconnects it synchronizes again from scratch.

Both ends send PING every quarter heart-beat timeout; a link silent for the timeout is
dead. Frames are ``u32 length, u8 kind, payload``; a RECORDS payload is a run of
``u64 seq, u8 type, u32 length, bytes``, cut into frames of about FRAME_RECORD_BYTES that a
sender task writes as the socket drains (a batch holding a checkpoint can be hundreds of MiB,
more than a frame may hold or the event loop may copy at once). The backup hands every run
it made durable to ``on_appended`` on its journal thread, where the node compacts the
backup's journal when a checkpoint completes; the time the backup spends storing does not
count as the live's silence, as it reads nothing meanwhile. HANDOVER asks the live to step
down for a synchronized former live (failback); the live answers HANDOVER_READY with its
final sequence number once it has stopped serving and the backup has acknowledged everything.

LOGINS carries logins the live verified (``reference_broker.users.VerifiedLogins``: user, record
version, a digest keyed from the pair secret; never a password, never a failed login): all it
holds when a backup attaches, then each new one as it is verified. The backup keeps those that
fit its users file, so that after a failover a known login costs it one HMAC, not a derivation.

This module moves records; it never decides roles (the node does, with the witness).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
import json
import logging
import os
import secrets
import ssl
import stat
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Final

from reference_broker.journal import Journal, Record
from reference_broker.records import RECORD_FORMAT
from reference_broker.store import Store
from reference_broker.users import SharedLogin, VerifiedLogins

__all__ = [
    "HANDOVER_TIMEOUT",
    "PAIR_SECRET_NAME",
    "BackupLink",
    "Kind",
    "LiveReplicationServer",
    "PairSecretError",
    "ReplicationAuthError",
    "ReplicationFormatError",
    "backup_handshake",
    "client_tls_context",
    "live_handshake",
    "load_pair_secret",
    "read_frame",
    "record_frames",
    "write_frame",
    "write_records",
]

log = logging.getLogger(__name__)

_HEAD: Final = struct.Struct("<IB")
_RECORD: Final = struct.Struct("<QBI")
_SEQ: Final = struct.Struct("<Q")
MAX_FRAME: Final = 64 * 1024 * 1024
# How long a live that stopped serving for a hand-over waits for the backup to acknowledge
# everything; past it, it serves again. The backup waits a little longer for HANDOVER_READY.
HANDOVER_TIMEOUT: Final = 10.0
SYNC_CHUNK: Final = 2000  # records per executor call while copying the journal
# What the live keeps for a backup that is still copying: past it, the copy is abandoned (the
# backup starts again) rather than the live's memory growing with its traffic.
MAX_BACKLOG_BYTES: Final = 256 * 1024 * 1024
DRAIN_TIMEOUTS: Final = 5  # heart-beat timeouts a copy waits for the backup to read a chunk
FRAME_RECORD_BYTES: Final = 1024 * 1024  # a RECORDS frame is cut after this many bytes
# In the pair directory, unless a file is given; a file name, not a secret.
PAIR_SECRET_NAME: Final = "pair.secret"  # noqa: S105
_MIN_SECRET_BYTES: Final = 16
_NONCE_BYTES: Final = 32


class Kind(enum.IntEnum):
    HELLO = 1
    SYNC_BEGIN = 2
    RECORDS = 3
    SYNC_END = 4
    ACK = 5
    PING = 6
    HANDOVER = 7
    HANDOVER_READY = 8
    CHALLENGE = 9
    PROOF = 10
    LOGINS = 11


class ReplicationProtocolError(ConnectionError):
    """The peer sent something this end cannot accept."""


class ReplicationAuthError(ReplicationProtocolError):
    """The peer did not prove that it holds the pair secret."""


class ReplicationFormatError(ReplicationProtocolError):
    """The peer's journal holds records of another format than this end's."""

    def __init__(self, peer: str, found: object, expected: int) -> None:
        said = (
            "does not say which record format it holds (it predates record formats)"
            if found is None
            else f"holds journal records in format {found!r}"
        )
        super().__init__(
            f"{peer} {said}, this node format {expected}: refusing to replicate "
            f"(run the same broker version on both nodes)"
        )


def _check_peer_format(peer: str, found: object, expected: int | None) -> None:
    if expected is not None and found != expected:
        raise ReplicationFormatError(peer, found, expected)


class PairSecretError(ValueError):
    """The pair secret file is missing, unsafe or malformed; the message names the file."""


# --- the pair secret --------------------------------------------------------------------------


def load_pair_secret(pair_dir: Path, secret_file: Path | None = None) -> bytes:
    """The pair secret: from ``secret_file`` if given (it must exist), else from the pair
    directory, where the first node to start creates it (0600, 32 random bytes in hex). The
    file appears complete or not at all (written aside, then linked), so both nodes agree."""
    if secret_file is None:
        secret_file = pair_dir / PAIR_SECRET_NAME
        if not secret_file.exists():
            _create_secret(secret_file)
    elif not secret_file.exists():
        raise PairSecretError(f"pair secret file {secret_file} does not exist")
    mode = secret_file.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PairSecretError(
            f"pair secret file {secret_file} is readable by others (mode {stat.filemode(mode)}): "
            f"chmod 600 it"
        )
    text = secret_file.read_text(encoding="ascii", errors="replace").strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise PairSecretError(f"pair secret file {secret_file} must hold hex digits") from None
    if len(secret) < _MIN_SECRET_BYTES:
        raise PairSecretError(
            f"pair secret in {secret_file} is {len(secret)} bytes; at least "
            f"{_MIN_SECRET_BYTES} are needed"
        )
    return secret


def _create_secret(path: Path) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temp, path)  # fails if the other node made it first: then both read its file
    except FileExistsError:
        pass
    finally:
        temp.unlink()


def _proof(secret: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, role + b"\0" + transcript, hashlib.sha256).digest()


def _transcript(backup: dict[str, Any], live: dict[str, Any], binding: bytes) -> bytes:
    return json.dumps(
        [backup["node_id"], backup["nonce"], live["live"], live["nonce"], binding.hex()]
    ).encode()


def _nonce(value: object) -> str:
    if not isinstance(value, str) or len(value) != 2 * _NONCE_BYTES:
        raise ReplicationProtocolError("HELLO and CHALLENGE need a 64-hex-digit nonce")
    return value


def _certificate_binding(der: bytes | None) -> bytes:
    """tls-server-end-point (RFC 5929): the hash of the live's certificate; empty without TLS."""
    return b"" if der is None else hashlib.sha256(der).digest()


async def live_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    node_id: str,
    secret: bytes,
    timeout: float,
    binding: bytes = b"",
    record_format: int | None = RECORD_FORMAT,
) -> str:
    """The live's half of HELLO, CHALLENGE, PROOF (module docstring): the backup's id once it
    proved itself; ReplicationAuthError if it did not. ``binding``: _certificate_binding of
    the certificate the live presents, over TLS. ``record_format`` is sent, and a backup that
    does not say the same raises ReplicationFormatError (None: neither; older code's half)."""
    kind, payload = await read_frame(reader, timeout, limit=4096)
    if kind is not Kind.HELLO:
        raise ReplicationAuthError(f"expected HELLO, got {kind.name}")
    hello = _json(payload)
    if not isinstance(hello.get("node_id"), str):
        raise ReplicationAuthError("HELLO without a node id")
    hello["nonce"] = _nonce(hello.get("nonce"))
    challenge: dict[str, Any] = {"live": node_id, "nonce": secrets.token_hex(_NONCE_BYTES)}
    if record_format is not None:
        challenge["format"] = record_format
    transcript = _transcript(hello, challenge, binding)
    challenge["proof"] = _proof(secret, b"live", transcript).hex()
    write_frame(writer, Kind.CHALLENGE, json.dumps(challenge).encode())
    await writer.drain()
    kind, payload = await read_frame(reader, timeout, limit=4096)
    if kind is not Kind.PROOF:
        raise ReplicationAuthError(f"expected PROOF, got {kind.name}")
    expected = _proof(secret, b"backup", transcript).hex()
    if not hmac.compare_digest(expected, payload.decode("ascii", "replace")):
        raise ReplicationAuthError(
            f"node {hello['node_id']!r} does not hold this pair's secret (wrong proof)"
        )
    _check_peer_format(f"backup {hello['node_id']!r}", hello.get("format"), record_format)
    return str(hello["node_id"])


async def backup_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    node_id: str,
    secret: bytes,
    timeout: float,
    where: str = "the live",
    record_format: int | None = RECORD_FORMAT,
) -> str:
    """The backup's half: the live's id once it proved itself; ReplicationAuthError if it did
    not (the live closes the link if this end does not). ``record_format`` is sent, and a live
    that says another raises ReplicationFormatError (one that says none is followed; None:
    neither, as older code did)."""
    hello: dict[str, Any] = {"node_id": node_id, "nonce": secrets.token_hex(_NONCE_BYTES)}
    if record_format is not None:
        hello["format"] = record_format
    write_frame(writer, Kind.HELLO, json.dumps(hello).encode())
    kind, payload = await read_frame(reader, timeout, limit=4096)
    if kind is not Kind.CHALLENGE:
        raise ReplicationAuthError(f"expected CHALLENGE from {where}, got {kind.name}")
    challenge = _json(payload)
    challenge["nonce"] = _nonce(challenge.get("nonce"))
    if not isinstance(challenge.get("live"), str):
        raise ReplicationAuthError(f"CHALLENGE from {where} without the live's id")
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    transcript = _transcript(hello, challenge, _certificate_binding(der))
    expected = _proof(secret, b"live", transcript).hex()
    # Our proof goes out even to a live whose proof is wrong: it reveals nothing of the
    # secret (fresh nonces), and the live then logs the refusal for what it is.
    write_frame(writer, Kind.PROOF, _proof(secret, b"backup", transcript).hex().encode())
    with contextlib.suppress(ConnectionError, OSError):
        await writer.drain()
    if not hmac.compare_digest(expected, str(challenge.get("proof", ""))):
        raise ReplicationAuthError(
            f"the live at {where} does not hold this pair's secret (wrong proof): "
            f"refusing to follow it"
        )
    if "format" in challenge:
        _check_peer_format(f"the live at {where}", challenge["format"], record_format)
    return str(challenge["live"])


def client_tls_context() -> ssl.SSLContext:
    """The backup's TLS: encrypted, no CA needed (the HMAC proof covers the certificate)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def encode_records(records: list[Record]) -> bytes:
    parts: list[bytes] = []
    for record in records:
        parts.append(_RECORD.pack(record.seq, record.type, len(record.payload)))
        parts.append(record.payload)
    return b"".join(parts)


def record_frames(records: list[Record]) -> Iterator[bytes]:
    """RECORDS payloads of about FRAME_RECORD_BYTES each, encoded one at a time."""
    start = size = 0
    for index, record in enumerate(records):
        size += _RECORD.size + len(record.payload)
        if size >= FRAME_RECORD_BYTES:
            yield encode_records(records[start : index + 1])
            start, size = index + 1, 0
    if start < len(records):
        yield encode_records(records[start:])


def write_records(writer: asyncio.StreamWriter, records: list[Record]) -> None:
    """Send records as RECORDS frames of about FRAME_RECORD_BYTES each."""
    for payload in record_frames(records):
        write_frame(writer, Kind.RECORDS, payload)


def decode_records(payload: bytes) -> list[Record]:
    records: list[Record] = []
    offset = 0
    view = memoryview(payload)
    while offset < len(payload):
        if offset + _RECORD.size > len(payload):
            raise ReplicationProtocolError("truncated record header in RECORDS")
        seq, rtype, length = _RECORD.unpack_from(payload, offset)
        offset += _RECORD.size
        if offset + length > len(payload):
            raise ReplicationProtocolError("truncated record payload in RECORDS")
        records.append(Record(type=rtype, seq=seq, payload=bytes(view[offset : offset + length])))
        offset += length
    return records


def write_frame(writer: asyncio.StreamWriter, kind: Kind, payload: bytes = b"") -> None:
    writer.write(_HEAD.pack(len(payload) + 1, kind) + payload)


async def read_frame(
    reader: asyncio.StreamReader, timeout: float, *, limit: int = MAX_FRAME
) -> tuple[Kind, bytes]:
    head = await asyncio.wait_for(reader.readexactly(4), timeout)
    (length,) = struct.unpack("<I", head)
    if not 1 <= length <= limit:
        raise ReplicationProtocolError(f"replication frame of {length} bytes")
    body = await asyncio.wait_for(reader.readexactly(length), timeout)
    try:
        kind = Kind(body[0])
    except ValueError:
        raise ReplicationProtocolError(f"unknown replication frame kind {body[0]}") from None
    return kind, body[1:]


def encode_logins(logins: list[SharedLogin]) -> bytes:
    return json.dumps(logins).encode()


def decode_logins(payload: bytes) -> list[SharedLogin]:
    try:
        value = json.loads(payload)
    except ValueError:
        raise ReplicationProtocolError("malformed JSON in a LOGINS frame") from None
    if not isinstance(value, list) or not all(
        isinstance(item, list) and len(item) == 3 and all(isinstance(f, str) for f in item)
        for item in value
    ):
        raise ReplicationProtocolError("a LOGINS frame must be a list of [user, version, digest]")
    return [(name, version, digest) for name, version, digest in value]


def _json(payload: bytes) -> dict[str, Any]:
    try:
        value = json.loads(payload)
    except ValueError:
        raise ReplicationProtocolError("malformed JSON in a replication frame") from None
    if not isinstance(value, dict):
        raise ReplicationProtocolError("a replication JSON frame must be an object")
    return value


# --- the live's end -----------------------------------------------------------------------


class LiveReplicationServer:
    """Accepts one backup at a time and keeps it in step with the live's store."""

    def __init__(
        self,
        store: Store,
        *,
        node_id: str,
        activation: int,
        timeout: float,
        on_handover: Callable[[], Awaitable[int]],
        on_eligibility: Callable[[str, bool], None],
        secret: bytes,
        tls: ssl.SSLContext | None = None,
        certificate: bytes | None = None,
        logins: VerifiedLogins | None = None,
        record_format: int = RECORD_FORMAT,
    ) -> None:
        if len(secret) < _MIN_SECRET_BYTES:
            raise ValueError(f"the pair secret must be at least {_MIN_SECRET_BYTES} bytes")
        self.store = store
        self.record_format = record_format
        self._logins = logins  # shared with the attached backup (LOGINS)
        self._secret = secret
        self._tls = tls
        # The DER of the certificate the live presents over TLS, for the proofs' binding.
        self._binding = _certificate_binding(certificate)
        self.node_id = node_id
        self.activation = activation
        self.timeout = timeout
        self._on_handover = on_handover
        # Called before the store changes mode: the backup may take over only while the
        # live has recorded it as eligible, and the live revokes that before it confirms
        # anything without the backup.
        self._on_eligibility = on_eligibility
        self._writer: asyncio.StreamWriter | None = None
        self._syncing = False
        self._backlog: list[Record] = []
        self._backlog_bytes = 0
        # Batches for the sender task, which writes them frame by frame as the socket drains:
        # a batch holding a checkpoint can be hundreds of MiB, too much to hand the transport
        # at once without holding up the event loop.
        self._outbox: deque[list[Record]] = deque()
        self._outbox_ready = asyncio.Event()
        self.backup_id: str | None = None
        self.synchronized = False
        self.server: asyncio.Server | None = None
        self._handover: asyncio.Task[None] | None = None  # at most one per live
        self._link: asyncio.Task[Any] | None = None  # the task serving the attached backup
        self._keep_eligibility = False
        # The pair directory may say the attached backup is eligible: set before the record
        # is written (a write that fails may still have landed), cleared once it is revoked.
        self._maybe_eligible = False
        # Why this live may confirm nothing more (None: it may): the revocation of a lost
        # backup's eligibility could not be recorded. The node reads it and fences itself.
        self.failed: str | None = None

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(
            self._accept, host, port, reuse_address=True, ssl=self._tls
        )
        return int(self.server.sockets[0].getsockname()[1])

    def keep_eligibility(self) -> None:
        """The live stops confirming for good (its journal failed): a synchronized backup
        holds everything confirmed, so the end of the link need not revoke its eligibility."""
        self._keep_eligibility = True

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._writer is not None:
            self._writer.close()
        self.store.detach_replica("live stopping")

    # Called by the store for every batch written while a backup is attached.
    def replicate(self, records: list[Record]) -> None:
        if self._syncing:
            self._backlog.extend(records)
            self._backlog_bytes += sum(_RECORD.size + len(r.payload) for r in records)
        elif self._writer is not None and not self._writer.is_closing():
            self._outbox.append(records)
            self._outbox_ready.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Not capped: a cap on connections still proving themselves would let an impostor that
        # holds that many keep the real backup out. Each one is bounded by the link timeout.
        peer = writer.get_extra_info("peername")
        try:
            backup_id = await live_handshake(
                reader,
                writer,
                node_id=self.node_id,
                secret=self._secret,
                timeout=self.timeout,
                binding=self._binding,
                record_format=self.record_format,
            )
        except (ReplicationAuthError, ReplicationFormatError) as exc:
            log.error("replication: refused a backup connection from %s: %s", peer, exc)  # noqa: TRY400
            writer.close()
            return
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
            log.warning(
                "replication connection from %s ended before it proved itself: %r", peer, exc
            )
            writer.close()
            return
        if self.failed is not None:
            log.warning("backup %s refused: %s", backup_id, self.failed)
            writer.close()
            return
        # One link at a time: the sync state below is the link's. A connection that arrives
        # while the previous link is still alive, or still ending, is refused; the backup
        # tries again.
        if self._writer is not None or (self._link is not None and not self._link.done()):
            log.warning("a second backup connection while one is attached; refused")
            writer.close()
            return
        self._writer = writer
        self._link = asyncio.current_task()
        self.backup_id = backup_id
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
            log.warning("replication link to backup %s lost: %r", self.backup_id, exc)
        finally:
            self.synchronized = False
            self._syncing = False
            self._backlog = []
            self._backlog_bytes = 0
            self._outbox.clear()
            self._writer = None
            if self._revoke_eligibility():
                self.store.detach_replica(f"link to backup {self.backup_id} lost")
            writer.close()

    def _revoke_eligibility(self) -> bool:
        """Record that the lost backup may no longer take over; True once the live may
        confirm without it. When the record cannot be written (the pair directory refuses
        it) and the backup may be recorded eligible, the replica stays attached, so nothing
        is confirmed without it, and ``failed`` tells the node to stop serving."""
        if self.backup_id is None or self._keep_eligibility:
            return True
        try:
            self._on_eligibility(self.backup_id, False)
        except OSError as exc:
            if not self._maybe_eligible:
                log.warning(
                    "cannot record backup %s as not eligible (%s); it never was",
                    self.backup_id,
                    exc,
                )
                return True
            self.failed = (
                f"cannot record in the pair directory that backup {self.backup_id} is no "
                f"longer eligible ({exc}), so may confirm nothing without it"
            )
            log.error("%s", self.failed)  # noqa: TRY400 - the cause is the whole story
            return False
        self._maybe_eligible = False
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        log.info("backup %s attached: initial synchronization starts", self.backup_id)
        self._syncing = True
        upto = self.store.attach_replica(self)
        begin = {"live": self.node_id, "activation": self.activation, "upto": upto}
        write_frame(writer, Kind.SYNC_BEGIN, json.dumps(begin).encode())
        loop = asyncio.get_running_loop()
        pinger = loop.create_task(self._ping(writer))
        sender: asyncio.Task[None] | None = None
        unsubscribe = self._share_logins(writer)
        try:
            await self._copy_journal(writer, upto)
            self._check_backlog()
            write_frame(writer, Kind.SYNC_END, _SEQ.pack(upto))
            # Everything written since SYNC_BEGIN follows, in order. From here on nothing is
            # confirmed before the backup acknowledged it (synchronous at once); the records
            # confirmed during the copy are the backlog, so the backup is eligible only once
            # it acknowledged everything written so far, the backlog included.
            backlog, self._backlog, self._syncing = self._backlog, [], False
            self._backlog_bytes = 0
            target = self.store.local_seq
            self.store.replica_synchronized(0)
            if backlog:
                self._outbox.append(backlog)
                self._outbox_ready.set()
            sender = loop.create_task(self._send(writer))
            await self._read_acks(reader, writer, target)
        finally:
            unsubscribe()
            pinger.cancel()
            if sender is not None:
                sender.cancel()

    def _share_logins(self, writer: asyncio.StreamWriter) -> Callable[[], None]:
        """Send the backup every login verified so far, then each new one (LOGINS frames
        are whole, so they go between any two others); returns how to stop."""
        logins = self._logins
        if logins is None:
            return lambda: None
        loop = asyncio.get_running_loop()

        def send(batch: list[SharedLogin]) -> None:
            if not writer.is_closing():
                write_frame(writer, Kind.LOGINS, encode_logins(batch))

        def verified(login: SharedLogin) -> None:
            # On the login worker thread: handed to the loop, unless it has closed (the node
            # is stopping), which must not fail the login.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(send, [login])

        # Subscribed before the snapshot: a login verified in between is sent twice, not lost.
        unsubscribe = logins.subscribe(verified)
        snapshot = logins.snapshot()
        if snapshot:
            send(snapshot)
        return unsubscribe

    async def _send(self, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._outbox_ready.wait()
                self._outbox_ready.clear()
                while self._outbox:
                    for payload in record_frames(self._outbox.popleft()):
                        write_frame(writer, Kind.RECORDS, payload)
                        await writer.drain()
        except (ConnectionError, OSError):
            writer.close()  # the ack reader sees the link end

    async def _copy_journal(self, writer: asyncio.StreamWriter, upto: int) -> None:
        """Send the journal up to `upto`, reading it once: one iterator, one segment in memory
        at a time, SYNC_CHUNK records per trip to the journal thread."""
        journal = self.store.journal
        records_iter: Iterator[Record] | None = None

        def chunk() -> list[Record]:
            nonlocal records_iter
            if records_iter is None:
                records_iter = journal.records_after(0)
            out: list[Record] = []
            for record in records_iter:
                if record.seq > upto:
                    break
                out.append(record)
                if record.seq == upto or len(out) >= SYNC_CHUNK:
                    break
            return out

        while True:
            records = await self.store.run(chunk)
            if not records:
                return
            write_records(writer, records)
            await self._drain(writer)
            if records[-1].seq >= upto:
                return

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        """Wait for the backup to read what was written, for a bounded time: the backup's
        PINGs are not read during the copy, so a backup that stopped would hold it forever."""
        await asyncio.wait_for(writer.drain(), DRAIN_TIMEOUTS * self.timeout)
        self._check_backlog()

    def _check_backlog(self) -> None:
        if self._backlog_bytes > MAX_BACKLOG_BYTES:
            raise ConnectionError(
                f"{self._backlog_bytes} bytes written since SYNC_BEGIN are waiting for the "
                f"copy to end, more than {MAX_BACKLOG_BYTES}: synchronization abandoned"
            )

    async def _read_acks(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: int
    ) -> None:
        handover_asked = False
        while True:
            kind, payload = await read_frame(reader, self.timeout)
            if kind is Kind.ACK:
                (seq,) = _SEQ.unpack(payload)
                self.store.backup_acknowledged(seq)
                if not self.synchronized and seq >= target:
                    # The backup holds every record confirmed so far, and the store confirms
                    # nothing more without it: from now on it may take over.
                    assert self.backup_id is not None
                    self._maybe_eligible = True
                    try:
                        self._on_eligibility(self.backup_id, True)
                    except OSError as exc:
                        raise ConnectionError(
                            f"cannot record backup {self.backup_id} as eligible in the pair "
                            f"directory: {exc}"
                        ) from exc
                    self.synchronized = True
                    log.info(
                        "backup %s holds everything up to seq %d: eligible", self.backup_id, seq
                    )
            elif kind is Kind.PING:
                continue
            elif kind is Kind.HANDOVER:
                # The backup asks once it has SYNC_END; it may not be eligible yet (the
                # backlog is still on its way): then the hand-over waits for that.
                handover_asked = True
            else:
                raise ReplicationProtocolError(f"unexpected {kind.name} from the backup")
            if handover_asked and self.synchronized and self._handover is None:
                # Its own task: the hand-over waits for ACKs that only this loop reads.
                handover_asked = False
                self._handover = asyncio.get_running_loop().create_task(self._hand_over(writer))

    async def _hand_over(self, writer: asyncio.StreamWriter) -> None:
        try:
            final = await self._on_handover()
        except Exception as exc:  # noqa: BLE001 - any failure ends this attempt the same way
            # The live serves on; the backup learns it from the link ending and resynchronizes.
            log.warning("hand-over to backup %s failed: %s", self.backup_id, exc)
            writer.close()
            return
        write_frame(writer, Kind.HANDOVER_READY, _SEQ.pack(final))
        with contextlib.suppress(ConnectionError, OSError):
            await writer.drain()

    async def _ping(self, writer: asyncio.StreamWriter) -> None:
        while not writer.is_closing():
            write_frame(writer, Kind.PING)
            await asyncio.sleep(self.timeout / 4)


# --- the backup's end ---------------------------------------------------------------------


class BackupLink:
    """The backup's connection to the live: copies its journal and follows it."""

    def __init__(
        self,
        *,
        node_id: str,
        timeout: float,
        open_store: Callable[[], Awaitable[Store]],
        on_synchronized: Callable[[str, int], None],
        on_appended: Callable[[Journal, list[Record]], None] | None = None,
        secret: bytes,
        tls: ssl.SSLContext | None = None,
        on_logins: Callable[[list[SharedLogin]], None] | None = None,
        record_format: int = RECORD_FORMAT,
    ) -> None:
        if len(secret) < _MIN_SECRET_BYTES:
            raise ValueError(f"the pair secret must be at least {_MIN_SECRET_BYTES} bytes")
        self._secret = secret
        self.record_format = record_format
        self._tls = tls
        self._on_logins = on_logins  # logins the live verified (LOGINS)
        # The pair secret or the record format did not match: worth a longer pause.
        self.refused = False
        self.node_id = node_id
        self.timeout = timeout
        self.store: Store | None = None  # a fresh journal, opened at SYNC_BEGIN
        self._open_store = open_store
        self._on_synchronized = on_synchronized
        # Called on the journal thread once records are durable, before they are acknowledged.
        self._on_appended = on_appended
        self.synchronized = False
        self.live_id: str | None = None
        self.activation = 0
        self.last_seen = time.monotonic()
        self._storing = False
        self._writer: asyncio.StreamWriter | None = None
        self._handover: asyncio.Future[int] | None = None

    async def follow(self, host: str, port: int) -> None:
        """Connect, synchronize and follow until the link dies (then return or raise)."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=self._tls), self.timeout
        )
        try:
            await backup_handshake(
                reader,
                writer,
                node_id=self.node_id,
                secret=self._secret,
                timeout=self.timeout,
                where=f"{host}:{port}",
                record_format=self.record_format,
            )
        except (ReplicationAuthError, ReplicationFormatError) as exc:
            log.error("replication: %s", exc)  # noqa: TRY400 - the reason is the whole story
            self.refused = True
            writer.close()
            raise
        except BaseException:
            writer.close()
            raise
        self._writer = writer
        self.last_seen = time.monotonic()
        pinger = asyncio.get_running_loop().create_task(self._ping(writer))
        try:
            kind, payload = await read_frame(reader, self.timeout)
            if kind is not Kind.SYNC_BEGIN:
                raise ReplicationProtocolError(f"expected SYNC_BEGIN, got {kind.name}")
            begin = _json(payload)
            self.live_id = str(begin.get("live"))
            self.activation = int(begin.get("activation", 0))
            upto = int(begin.get("upto", 0))
            store = self.store = await self._open_store()
            log.info("synchronizing from live %s up to seq %d", self.live_id, upto)
            journal = store.journal
            while True:
                kind, payload = await read_frame(reader, self.timeout)
                self.last_seen = time.monotonic()
                if kind is Kind.RECORDS:
                    records = decode_records(payload)
                    if records:

                        def append(records: list[Record] = records) -> int:
                            journal.append_records(records)
                            journal.sync()
                            if self._on_appended is not None:
                                self._on_appended(journal, records)
                            return journal.last_seq

                        # Frames wait in the socket meanwhile: the live is not silent, we are
                        # busy (a compaction after a checkpoint can take seconds).
                        self._storing = True
                        try:
                            last = await store.run(append)
                        finally:
                            self._storing = False
                            self.last_seen = time.monotonic()
                        # Nothing is acknowledged before SYNC_END: the live takes an ACK as
                        # "holds everything written so far", and only after SYNC_END is what
                        # it wrote during the copy on its way here.
                        if self.synchronized:
                            write_frame(writer, Kind.ACK, _SEQ.pack(last))
                elif kind is Kind.SYNC_END:
                    last = await store.run(lambda: journal.last_seq)
                    write_frame(writer, Kind.ACK, _SEQ.pack(max(last, upto)))
                    self.synchronized = True
                    self._on_synchronized(self.live_id, self.activation)
                    log.info(
                        "copied the journal of live %s: eligible once it has acknowledged "
                        "what the live wrote meanwhile",
                        self.live_id,
                    )
                elif kind is Kind.PING:
                    continue
                elif kind is Kind.LOGINS:
                    logins = decode_logins(payload)
                    if self._on_logins is not None:
                        self._on_logins(logins)
                elif kind is Kind.HANDOVER_READY:
                    (final,) = _SEQ.unpack(payload)
                    if self._handover is not None and not self._handover.done():
                        self._handover.set_result(final)
                else:
                    raise ReplicationProtocolError(f"unexpected {kind.name} from the live")
        finally:
            pinger.cancel()
            self._writer = None
            writer.close()
            if self._handover is not None and not self._handover.done():
                self._handover.set_exception(ConnectionError("the link to the live ended"))

    def silent_for(self, now: float) -> float:
        """How long the live has been silent: 0 while this end is storing records, as
        it reads nothing then."""
        return 0.0 if self._storing else now - self.last_seen

    async def request_handover(self) -> int:
        """Failback: ask the live to step down; returns its final sequence number.

        Raises ConnectionError if the link ends first: the live may have handed the role over
        all the same (the witness says), having seen this end acknowledge everything.
        """
        if self._writer is None or not self.synchronized:
            raise ConnectionError("not synchronized with a live")
        self._handover = asyncio.get_running_loop().create_future()
        write_frame(self._writer, Kind.HANDOVER)
        return await self._handover

    async def _ping(self, writer: asyncio.StreamWriter) -> None:
        while not writer.is_closing():
            write_frame(writer, Kind.PING)
            await asyncio.sleep(self.timeout / 4)
