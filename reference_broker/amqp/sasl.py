"""Sans-IO server side of the AMQP 1.0 SASL layer (AMQP 1.0 part 5.3): bytes in, events out.

The PyPI build of python-qpid-proton has no Cyrus SASL, so a proton server transport cannot
offer PLAIN (DESIGN.md section 8). The broker therefore runs the SASL exchange itself, with
this machine, checks the credentials against the users file that STOMP uses too, and hands
the byte stream that follows to a proton transport with SASL off.

Theory of operation
-------------------
Every transition is in ``_TRANSITIONS``; a (state, input) pair missing from it is a
protocol error (from the peer) or a usage error (from the caller)::

    AWAIT_HEADER  --SASL header-->  AWAIT_INIT     sends the SASL header and sasl-mechanisms
    AWAIT_HEADER  --AMQP header-->  DONE           reports AmqpHeaderReceived: the client
                                                   skipped SASL; the caller decides
    AWAIT_INIT    --sasl-init-->    AWAIT_VERDICT  reports SaslInitReceived; bytes that follow
                                                   it (a pipelining client) are kept
    AWAIT_VERDICT --accept()-->     DONE           sends sasl-outcome ok; returns those bytes
    AWAIT_VERDICT --refuse()-->     FAILED         sends sasl-outcome with the code given
    any           --peer error-->   FAILED         sticky: every later receive() raises again

On a peer error the machine still queues what the spec wants said before the socket closes:
its own protocol header after a header it does not speak (part 2.2), a sasl-outcome with
code sys-perm after a malformed frame. The caller writes ``data_to_send()`` and closes.

Frames are decoded with ``proton.Data`` (a codec, no I/O). SASL frames are limited to
``max_frame_size`` bytes; the spec's minimum is 512, and the default here is larger because
a PLAIN response with long credentials may exceed it. The machine never does I/O, reads a
clock or checks a password: that is the caller's business.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Final, TypeAlias

import attrs
from proton import UNDESCRIBED, Array, Data, DataException, Described, symbol, ubyte, ulong

if TYPE_CHECKING:
    from proton._data import PythonAMQPData  # the type proton's own codec accepts

__all__ = [
    "AMQP_HEADER",
    "SASL_HEADER",
    "AmqpHeaderReceived",
    "PlainCredentialsError",
    "SaslCode",
    "SaslEvent",
    "SaslInitReceived",
    "SaslProtocolError",
    "SaslServer",
    "SaslState",
    "SaslUsageError",
    "encode_sasl_frame",
    "parse_plain",
]

#: Protocol headers (AMQP 1.0 part 2.2 and 5.3.1): "AMQP", protocol id, 1.0.0.
AMQP_HEADER: Final = b"AMQP\x00\x01\x00\x00"
SASL_HEADER: Final = b"AMQP\x03\x01\x00\x00"
_HEADER_SIZE: Final = 8

_FRAME_TYPE_SASL: Final = 0x01
_FRAME_HEADER: Final = struct.Struct(">IBBH")  # size, data offset (words), type, ignored

# Performative descriptors (part 5.3.3): numeric codes, and the symbolic names a peer may
# send instead.
SASL_MECHANISMS: Final = 0x40
SASL_INIT: Final = 0x41
SASL_OUTCOME: Final = 0x44
_INIT_NAMES: Final = (ulong(SASL_INIT), symbol("amqp:sasl-init:list"))

DEFAULT_MAX_FRAME_SIZE: Final = 64 * 1024
# What a pipelining client may send after its sasl-init before it hears the outcome.
_MAX_EARLY_BYTES: Final = 1024 * 1024


class SaslCode(enum.IntEnum):
    """sasl-code (part 5.3.3.6)."""

    OK = 0
    AUTH = 1
    SYS = 2
    SYS_PERM = 3
    SYS_TEMP = 4


class SaslState(enum.Enum):
    AWAIT_HEADER = "await-header"
    AWAIT_INIT = "await-init"
    AWAIT_VERDICT = "await-verdict"
    DONE = "done"
    FAILED = "failed"


class SaslProtocolError(ValueError):
    """The peer broke the SASL layer; the message says how (for the broker's log)."""

    code: ClassVar[str] = "SASL_PROTOCOL_ERROR"


class SaslUsageError(RuntimeError):
    """The caller asked for a step the machine's state does not allow."""

    code: ClassVar[str] = "SASL_USAGE_ERROR"


class PlainCredentialsError(ValueError):
    """A PLAIN initial response that is not ``authzid NUL authcid NUL password`` in UTF-8."""

    code: ClassVar[str] = "SASL_PLAIN_MALFORMED"


@attrs.frozen
class SaslInitReceived:
    """The client chose a mechanism; answer with ``accept()`` or ``refuse()``."""

    mechanism: str
    initial_response: bytes | None
    hostname: str | None


@attrs.frozen
class AmqpHeaderReceived:
    """The client skipped SASL: ``data`` (the AMQP header and what followed it) belongs to
    the AMQP layer, if the caller lets it in."""

    data: bytes


SaslEvent: TypeAlias = SaslInitReceived | AmqpHeaderReceived


class _Input(enum.Enum):
    SASL_HEADER = "sasl-header"
    AMQP_HEADER = "amqp-header"
    SASL_INIT = "sasl-init"
    ACCEPT = "accept"
    REFUSE = "refuse"


_S = SaslState
_I = _Input
_TRANSITIONS: Final[dict[tuple[SaslState, _Input], SaslState]] = {
    (_S.AWAIT_HEADER, _I.SASL_HEADER): _S.AWAIT_INIT,
    (_S.AWAIT_HEADER, _I.AMQP_HEADER): _S.DONE,
    (_S.AWAIT_INIT, _I.SASL_INIT): _S.AWAIT_VERDICT,
    (_S.AWAIT_VERDICT, _I.ACCEPT): _S.DONE,
    (_S.AWAIT_VERDICT, _I.REFUSE): _S.FAILED,
}
# Inputs that come from the caller, not the peer: a missing pair is the caller's mistake.
_LOCAL_INPUTS: Final = frozenset({_I.ACCEPT, _I.REFUSE})


def encode_sasl_frame(descriptor: int, fields: list[PythonAMQPData]) -> bytes:
    """A SASL frame whose body is the performative ``descriptor`` with ``fields``."""
    body = Data()
    body.put_object(Described(ulong(descriptor), fields))
    payload = body.encode()
    return _FRAME_HEADER.pack(_FRAME_HEADER.size + len(payload), 2, _FRAME_TYPE_SASL, 0) + payload


def _mechanisms_frame(mechanisms: Sequence[str]) -> bytes:
    # sasl-server-mechanisms is "symbol multiple": an array of symbols. proton types an
    # array's descriptor as a value, but UNDESCRIBED is its documented "no descriptor".
    offered = Array(UNDESCRIBED, Data.SYMBOL, *(symbol(m) for m in mechanisms))  # type: ignore[arg-type]
    return encode_sasl_frame(SASL_MECHANISMS, [offered])


def _outcome_frame(code: SaslCode) -> bytes:
    return encode_sasl_frame(SASL_OUTCOME, [ubyte(int(code))])


def _decode_init(body: bytes) -> SaslInitReceived:
    data = Data()
    try:
        used = data.decode(body)
        data.rewind()
        data.next()
        value = data.get_object()
    except (DataException, KeyError, TypeError, ValueError) as exc:
        raise SaslProtocolError(f"undecodable SASL frame body: {exc}") from None
    if used != len(body):
        raise SaslProtocolError(f"{len(body) - used} bytes after the SASL performative")
    if not isinstance(value, Described) or not isinstance(value.value, list):
        raise SaslProtocolError("a SASL frame must hold one described list")
    if value.descriptor not in _INIT_NAMES:
        raise SaslProtocolError(
            f"expected sasl-init, got a frame described by {value.descriptor!r}"
        )
    fields = [*value.value, None, None, None][:3]
    mechanism, response, hostname = fields
    if not isinstance(mechanism, str) or not mechanism:
        raise SaslProtocolError("sasl-init needs a mechanism symbol")
    if response is not None and not isinstance(response, bytes | memoryview):
        raise SaslProtocolError("sasl-init initial-response must be binary")
    if hostname is not None and not isinstance(hostname, str):
        raise SaslProtocolError("sasl-init hostname must be a string")
    return SaslInitReceived(str(mechanism), None if response is None else bytes(response), hostname)


def parse_plain(response: bytes | None) -> tuple[str, str, str]:
    """Split a PLAIN initial response (RFC 4616) into (authzid, authcid, password)."""
    if response is None:
        raise PlainCredentialsError("PLAIN needs an initial response")
    parts = response.split(b"\0")
    if len(parts) != 3:
        raise PlainCredentialsError("PLAIN response must be authzid NUL authcid NUL password")
    try:
        authzid, authcid, password = (p.decode("utf-8") for p in parts)
    except UnicodeDecodeError:
        raise PlainCredentialsError("PLAIN response is not UTF-8") from None
    if not authcid:
        raise PlainCredentialsError("PLAIN response names no user")
    return authzid, authcid, password


class SaslServer:
    """The server's half of one connection's SASL exchange."""

    def __init__(
        self, mechanisms: Sequence[str], *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    ) -> None:
        if not mechanisms:
            raise ValueError("offer at least one mechanism")
        self.mechanisms = tuple(mechanisms)
        self.max_frame_size = max_frame_size
        self._state = SaslState.AWAIT_HEADER
        self._buffer = bytearray()
        self._out = bytearray()
        self._error: SaslProtocolError | None = None

    @property
    def state(self) -> SaslState:
        return self._state

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    # --- transitions -------------------------------------------------------------------------

    def _step(self, what: _Input) -> None:
        next_state = _TRANSITIONS.get((self._state, what))
        if next_state is None:
            if what in _LOCAL_INPUTS:
                raise SaslUsageError(f"{what.value} is not allowed in state {self._state.value}")
            self._fail(SaslProtocolError(f"unexpected {what.value} in state {self._state.value}"))
        else:
            self._state = next_state

    def _fail(self, error: SaslProtocolError, *, reply: bytes | None = None) -> None:
        if self._state is SaslState.AWAIT_HEADER:
            self._out += SASL_HEADER if reply is None else reply
        elif self._state in (SaslState.AWAIT_INIT, SaslState.AWAIT_VERDICT):
            self._out += _outcome_frame(SaslCode.SYS_PERM)
        self._state = SaslState.FAILED
        self._error = error
        self._buffer.clear()
        raise error

    # --- from the peer -----------------------------------------------------------------------

    def receive(self, data: bytes) -> list[SaslEvent]:
        """Feed bytes from the peer; returns what happened. Raises SaslProtocolError (and
        keeps raising it) once the peer broke the protocol."""
        if self._error is not None:
            raise self._error
        if self._state is SaslState.DONE:
            raise SaslUsageError("the SASL layer is done: give the bytes to the AMQP layer")
        if self._state is SaslState.FAILED:
            raise SaslUsageError("the SASL exchange failed: close the connection")
        self._buffer += data
        events: list[SaslEvent] = []
        while True:
            state = self._state
            if state is SaslState.AWAIT_HEADER:
                if not self._header(events):
                    break
            elif state is SaslState.AWAIT_INIT:
                if not self._init(events):
                    break
            else:  # AWAIT_VERDICT or DONE: what follows is the AMQP layer's
                if len(self._buffer) > _MAX_EARLY_BYTES:
                    self._fail(SaslProtocolError("too many bytes before the SASL outcome"))
                break
        return events

    def _header(self, events: list[SaslEvent]) -> bool:
        buffer = self._buffer
        if len(buffer) < _HEADER_SIZE:
            # Refuse a wrong prefix at once rather than wait for eight bytes that never come.
            if not SASL_HEADER.startswith(buffer[:4]):
                self._fail(SaslProtocolError(f"not an AMQP protocol header: {bytes(buffer)!r}"))
            return False
        header = bytes(buffer[:_HEADER_SIZE])
        if header == SASL_HEADER:
            del buffer[:_HEADER_SIZE]
            self._step(_I.SASL_HEADER)
            self._out += SASL_HEADER + _mechanisms_frame(self.mechanisms)
            return True
        if header == AMQP_HEADER:
            self._step(_I.AMQP_HEADER)
            events.append(AmqpHeaderReceived(bytes(buffer)))
            buffer.clear()
            return False
        self._fail(SaslProtocolError(f"unsupported protocol header {header!r}"))
        return False  # pragma: no cover - _fail raised

    def _init(self, events: list[SaslEvent]) -> bool:
        buffer = self._buffer
        if len(buffer) < _FRAME_HEADER.size:
            return False
        size, doff, frame_type, _ = _FRAME_HEADER.unpack_from(buffer)
        if size > self.max_frame_size:
            self._fail(SaslProtocolError(f"SASL frame of {size} bytes, over {self.max_frame_size}"))
        if doff < 2 or size < doff * 4:
            self._fail(SaslProtocolError(f"bad frame header: size {size}, data offset {doff}"))
        if frame_type != _FRAME_TYPE_SASL:
            self._fail(SaslProtocolError(f"frame type {frame_type} during SASL, expected 1"))
        if len(buffer) < size:
            return False
        body = bytes(buffer[doff * 4 : size])
        del buffer[:size]
        if not body:
            self._fail(SaslProtocolError("empty SASL frame"))
        try:
            init = _decode_init(body)
        except SaslProtocolError as exc:
            self._fail(exc)
        self._step(_I.SASL_INIT)
        events.append(init)
        return True

    # --- from the caller ---------------------------------------------------------------------

    def accept(self) -> bytes:
        """Authentication succeeded: queue sasl-outcome ok; returns the bytes the client
        already sent after its sasl-init, which belong to the AMQP layer."""
        self._step(_I.ACCEPT)
        self._out += _outcome_frame(SaslCode.OK)
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest

    def refuse(self, code: SaslCode = SaslCode.AUTH) -> None:
        """Authentication failed: queue sasl-outcome with ``code``; then close."""
        if code is SaslCode.OK:
            raise SaslUsageError("refuse() needs a failure code")
        self._step(_I.REFUSE)
        self._out += _outcome_frame(code)
        self._buffer.clear()
