"""Sans-IO STOMP frame codec (1.0, 1.1 and 1.2): bytes in, frames out; frames in, bytes out.

Theory of operation
-------------------
This module owns the STOMP wire format and nothing else; the client (``transport.py``)
and the reference broker both use it. It never does I/O: no sockets, threads, clocks or
logging. The broker's connection code feeds it whatever bytes arrived and gets back complete
frames and heart-beats; it hands it frames and gets back bytes to write. Session rules
(CONNECT first, receipts, subscriptions, transactions, what an ACK names) live above it.

The versions differ here only in header escaping: 1.2 escapes CR, LF, colon and backslash;
1.1 the same but CR (which it cannot carry); 1.0 nothing (a value may not hold an EOL). The
parser starts at 1.2 rules, which CONNECT frames do not use anyway, and is told the
version once it is negotiated (``negotiate_version``).

`FrameParser` is incremental. Its buffer is a bytearray searched with bytearray.find and one
compiled pattern for the blank line, never walked byte by byte in Python, and each feed resumes
its search where the last one stopped, so a frame that trickles in one byte at a time still
costs linear time. Per frame it moves through:

    COMMAND --command line--> HEADERS --blank line--> BODY --NUL--> COMMAND
    COMMAND --empty line--> COMMAND, reporting a Heartbeat
    any state --protocol error--> failed (sticky: every later call raises again)

Spec points enforced (https://stomp.github.io/stomp-specification-1.2.html):

- A line ends with LF or CRLF, chosen per line; any other CR in the header section is an error.
- EOLs between frames are heart-beats; they also cover the optional EOLs after a frame's NUL.
- Only the commands of the spec, and only those the other side may send.
- Header names and values are UTF-8. They are escaped (backslash with r, n, c or a backslash)
  in every frame except CONNECT and CONNECTED, and STOMP, which is CONNECT under another name
  and which clients (stomp.py among them) send unescaped. Any other escape is a fatal error.
- Repeated headers are kept in order; the first occurrence is the one that counts.
- content-length, when present, is the body size (so bodies may hold NULs) and the byte after
  the body must be NUL; without it the body ends at the first NUL.
- A NUL before the blank line that ends the headers is an error: it is how a frame that lost
  its blank line shows, and the parsers of other peers (stomp.py's among them) end a frame at
  the first NUL, so a header holding one could not be forwarded faithfully.
- Only SEND, MESSAGE and ERROR frames may carry a body, except on 1.0, whose grammar allows a
  body on every frame (the receiver ignores it): a 1.0 frame, and a CONNECT or STOMP that
  negotiates 1.0 (no accept-version, or 1.0 alone), may carry one up to the body limit.
- Limits on the command line, the header section, the header count and the body, so that a
  peer cannot make the broker buffer without bound (`ParserLimits`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar, Final, TypeAlias, overload

import attrs
from attrs.validators import ge, instance_of

__all__ = [
    "ALL_COMMANDS",
    "CLIENT_COMMANDS",
    "DEFAULT_LIMITS",
    "HEARTBEAT",
    "HEARTBEAT_BYTES",
    "SERVER_COMMANDS",
    "VERSIONS",
    "Event",
    "Frame",
    "FrameParser",
    "HeartBeatIntervals",
    "Heartbeat",
    "ParserLimits",
    "Side",
    "StompProtocolError",
    "encode",
    "encode_frame",
    "encode_header",
    "encode_headers",
    "encode_message",
    "format_heart_beat",
    "negotiate_heart_beat",
    "negotiate_version",
    "parse_heart_beat",
]

CLIENT_COMMANDS: Final = frozenset(
    {
        "CONNECT",
        "STOMP",
        "SEND",
        "SUBSCRIBE",
        "UNSUBSCRIBE",
        "ACK",
        "NACK",
        "BEGIN",
        "COMMIT",
        "ABORT",
        "DISCONNECT",
    }
)
SERVER_COMMANDS: Final = frozenset({"CONNECTED", "MESSAGE", "RECEIPT", "ERROR"})
# The protocol versions this codec speaks, oldest first.
VERSIONS: Final = ("1.0", "1.1", "1.2")
ALL_COMMANDS: Final = CLIENT_COMMANDS | SERVER_COMMANDS

# The frames that may carry a body, and the frames whose headers travel unescaped.
_BODY_COMMANDS: Final = frozenset({"SEND", "MESSAGE", "ERROR"})
_RAW_HEADER_COMMANDS: Final = frozenset({"CONNECT", "STOMP", "CONNECTED"})
_CONNECT_COMMANDS: Final = frozenset({"CONNECT", "STOMP"})

# An EOL on its own: what a peer writes as a heart-beat.
HEARTBEAT_BYTES: Final = b"\n"

_LONGEST_COMMAND: Final = max(len(command) for command in ALL_COMMANDS)
# Longer than any body limit can be; checked before int() so a huge digit string is refused
# as "too large" instead of tripping Python's int-parsing limit.
_MAX_LENGTH_DIGITS: Final = 19


class StompProtocolError(ValueError):
    """The peer broke the STOMP 1.2 wire format; the message says how.

    The message is written to be sent back verbatim as the ERROR frame's `message` header
    before the connection is closed. `events` holds what the same `feed` call parsed before
    the error, so a server can still act on complete frames that preceded it.
    """

    code: ClassVar[str] = "STOMP_PROTOCOL_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.events: list[Event] = []


class Side(enum.Enum):
    """Which end of the connection a parser serves, and so which commands it accepts."""

    SERVER = "server"  # parses what clients send
    CLIENT = "client"  # parses what servers send


_is_int: Final = instance_of(int)


@attrs.frozen
class ParserLimits:
    """How much a peer may make the parser buffer; exceeding any is a protocol error.

    max_command_length: bytes in the command line, EOL excluded; at least 11 (UNSUBSCRIBE).
    max_headers: header lines per frame.
    max_header_size: bytes of all header lines of a frame as received (escaped, with their
        EOLs; the command line and the blank line excluded). One bound for the whole section
        lets the parser find its end with a single bounded search.
    max_body_size: bytes in a body, with or without content-length.
    """

    max_command_length: int = attrs.field(default=32, validator=[_is_int, ge(_LONGEST_COMMAND)])
    max_headers: int = attrs.field(default=1000, validator=[_is_int, ge(0)])
    max_header_size: int = attrs.field(default=64 * 1024, validator=[_is_int, ge(0)])
    max_body_size: int = attrs.field(default=16 * 1024 * 1024, validator=[_is_int, ge(0)])


DEFAULT_LIMITS: Final = ParserLimits()


@attrs.frozen
class Frame:
    """One STOMP frame. `headers` keeps wire order and repeats; the first occurrence wins."""

    # Frozen although the broker makes one per message: a delivered frame may be shared by
    # several subscribers and the journal, and the frozen __init__ costs about 0.2 us more
    # than a mutable slotted class, under 10% of parsing a small SEND.

    command: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...
    @overload
    def get(self, name: str, default: None) -> str | None: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        """The value of the first header called `name`, else `default`."""
        for key, value in self.headers:
            if key == name:
                return value
        return default

    @property
    def header_map(self) -> dict[str, str]:
        """The headers as a dict in wire order, each name holding its first value."""
        result: dict[str, str] = {}
        for key, value in self.headers:
            if key not in result:
                result[key] = value
        return result


@attrs.frozen
class Heartbeat:
    """An EOL received between frames: the peer is alive."""


HEARTBEAT: Final = Heartbeat()

Event: TypeAlias = Frame | Heartbeat

# Parser states; plain ints because they are compared on every frame.
_COMMAND: Final = 0
_HEADERS: Final = 1
_BODY: Final = 2

# The EOL that ends the last header line (or the command line) and the blank line after it.
# (Adding "|\x00" to catch a NUL in the same pass would cost the pattern its fast literal-prefix
# scan, several times slower; a separate find for NUL is cheaper.)
_HEADER_END: Final = re.compile(b"\n\r?\n")
_ESCAPE_SEQUENCE: Final = re.compile(r"\\(.?)", re.DOTALL)
_UNESCAPES_1_1: Final = {"n": "\n", "c": ":", "\\": "\\"}
_UNESCAPES: Final = {"1.1": _UNESCAPES_1_1, "1.2": {**_UNESCAPES_1_1, "r": "\r"}}


def _unescaper(version: str) -> Callable[[re.Match[str]], str]:
    table = _UNESCAPES[version]

    def unescape_one(match: re.Match[str]) -> str:
        try:
            return table[match.group(1)]
        except KeyError:
            char = match.group(1)
            if not char:
                raise StompProtocolError("header ends with an incomplete escape sequence") from None
            shown = char if char.isprintable() else repr(char)[1:-1]
            raise StompProtocolError(
                f"undefined escape sequence \\{shown} in a STOMP {version} header"
            ) from None

    return unescape_one


_UNESCAPE_ONE: Final = {version: _unescaper(version) for version in _UNESCAPES}


def _unescape(text: str, version: str = "1.2") -> str:
    # Split at each escaped backslash (left to right, as a reader pairs them), then every
    # backslash left in a part must start \n, \c or (1.2) \r: str.replace is C, where the
    # regex calls a Python function for each sequence (a JSON header holds dozens of \c).
    # Anything else takes the regex, which names what is wrong.
    parts = text.split("\\\\")
    for index, part in enumerate(parts):
        if "\\" in part:
            part = part.replace("\\n", "\n").replace("\\c", ":")
            if version != "1.1":
                part = part.replace("\\r", "\r")
            if "\\" in part:
                return _ESCAPE_SEQUENCE.sub(_UNESCAPE_ONE[version], text)
            parts[index] = part
    return "\\".join(parts)


def negotiate_version(accept_version: str | None) -> str | None:
    """The version a server speaks with a client whose CONNECT said ``accept-version``:
    the highest both speak; no header means 1.0 (STOMP 1.2, "Protocol Negotiation").
    None when there is none in common."""
    if accept_version is None:
        return "1.0"
    offered = {v.strip() for v in accept_version.split(",")}
    common = [v for v in VERSIONS if v in offered]
    return common[-1] if common else None


def _shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class FrameParser:
    """Turns the byte stream from one peer into `Frame` and `Heartbeat` events.

    `feed` returns the events completed by the bytes given so far; partial frames stay
    buffered. A `StompProtocolError` leaves the parser failed for good.
    """

    __slots__ = (
        "_body_limit",
        "_body_start",
        "_buf",
        "_command",
        "_commands",
        "_content_length",
        "_error",
        "_header_start",
        "_headers",
        "_limits",
        "_scan",
        "_side",
        "_state",
        "version",
    )

    def __init__(
        self,
        side: Side = Side.SERVER,
        limits: ParserLimits = DEFAULT_LIMITS,
        version: str = "1.2",
    ) -> None:
        if version not in VERSIONS:
            raise ValueError(f"not a STOMP version: {version!r} (speaks {', '.join(VERSIONS)})")
        # Header escaping follows the negotiated version; set it once it is known.
        self.version = version
        self._side = side
        self._limits = limits
        accepted = CLIENT_COMMANDS if side is Side.SERVER else SERVER_COMMANDS
        self._commands = {command.encode("ascii"): command for command in accepted}
        self._buf = bytearray()
        self._error: StompProtocolError | None = None
        self._state = _COMMAND
        # The frame in progress. Offsets are relative to the frame's first byte, which is
        # always the start of the buffer between feeds.
        self._command = ""
        self._scan = 0  # where the next search resumes
        self._header_start = 0
        self._headers: tuple[tuple[str, str], ...] = ()
        self._body_start = 0
        self._content_length = -1
        self._body_limit = 0

    @property
    def side(self) -> Side:
        return self._side

    @property
    def limits(self) -> ParserLimits:
        return self._limits

    @property
    def error(self) -> StompProtocolError | None:
        """The error that failed the parser, if any."""
        return self._error

    @property
    def buffered(self) -> int:
        """Bytes received that are not yet part of a complete event."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Event]:
        """Add bytes from the peer; return the frames and heart-beats they complete."""
        if self._error is not None:
            raise StompProtocolError(self._error.message)
        self._buf += data
        events: list[Event] = []
        try:
            consumed = self._parse(events)
        except StompProtocolError as error:
            self._fail(error)
            error.events = events
            raise
        if consumed:
            del self._buf[:consumed]
        return events

    def feed_eof(self) -> None:
        """The peer closed the connection; an unfinished frame is a protocol error."""
        if self._error is not None:
            raise StompProtocolError(self._error.message)
        if self._buf:
            error = StompProtocolError(
                f"connection closed inside a frame ({len(self._buf)} bytes unparsed)"
            )
            self._fail(error)
            raise error

    def _fail(self, error: StompProtocolError) -> None:
        # Kept to say why again, as a copy without ``error``'s traceback: that holds the
        # parse's frames and the buffer in them (a refused body: up to max_body_size), and
        # the caller's frames, which may close a cycle only a full collection breaks.
        self._error = StompProtocolError(error.message)
        self._buf = bytearray()
        self._headers = ()

    def _parse(self, events: list[Event]) -> int:
        """Parse complete events from the buffer; return how many bytes they used."""
        buf = self._buf
        size = len(buf)
        append = events.append
        limits = self._limits
        command_limit = limits.max_command_length + 2  # room for CRLF
        header_limit = limits.max_header_size
        pos = 0  # first byte of the frame (or heart-beat) being parsed
        state = self._state
        while True:
            if state == _COMMAND:
                if pos >= size:
                    break
                eol = buf.find(b"\n", pos, pos + command_limit)
                if eol < 0:
                    if size - pos >= command_limit:
                        raise self._bad_command(bytes(buf[pos : pos + command_limit]), True)
                    break
                end = eol - 1 if eol > pos and buf[eol - 1] == 13 else eol
                if end == pos:
                    append(HEARTBEAT)
                    pos = eol + 1
                    continue
                raw_command = bytes(buf[pos:end])
                command = self._commands.get(raw_command)
                if command is None:
                    raise self._bad_command(raw_command, False)
                self._command = command
                self._header_start = eol + 1 - pos
                self._scan = eol - pos  # the blank line may follow the command line at once
                state = _HEADERS

            if state == _HEADERS:
                # One search for the blank line, resumed where the last feed stopped and
                # bounded by max_header_size: a match past the bound, or none within it, means
                # the header section is too large. A NUL before the blank line is checked
                # first, over the same stretch, so the error does not depend on the chunking.
                header_start = pos + self._header_start
                bound = header_start + header_limit
                search_from = pos + self._scan
                found = _HEADER_END.search(buf, search_from, bound + 2)
                last_eol = found.start() if found is not None else min(size, bound + 2)
                if buf.find(0, search_from, last_eol) >= 0:
                    raise StompProtocolError(
                        f"{self._command} frame has a NUL before the blank line that ends "
                        "its headers"
                    )
                if found is None:
                    if size >= bound + 2:
                        raise self._headers_too_large()
                    self._scan = max(size - 2, header_start - 1) - pos
                    break
                if last_eol >= bound:
                    raise self._headers_too_large()
                self._parse_headers(buf, header_start, last_eol + 1)
                self._body_start = self._scan = found.end() - pos
                state = _BODY

            # state == _BODY
            start = pos + self._body_start
            length = self._content_length
            if length >= 0:
                end = start + length
                if end >= size:
                    break
                if buf[end] != 0:
                    raise StompProtocolError(
                        f"{self._command} frame is not terminated by NUL after its "
                        f"content-length of {length} bytes"
                    )
            else:
                body_limit = self._body_limit
                end = buf.find(b"\x00", pos + self._scan, start + body_limit + 1)
                if end < 0:
                    if size - start > body_limit:
                        raise self._body_too_long()
                    self._scan = size - pos
                    break
            if end - start < 4096:
                body = bytes(buf[start:end]) if end > start else b""
            else:  # one copy instead of two; the view is released at once
                body = memoryview(buf)[start:end].tobytes()
            append(Frame(self._command, self._headers, body))
            pos = end + 1
            state = _COMMAND
        self._state = state
        return pos

    def _parse_headers(self, buf: bytearray, start: int, end: int) -> None:
        """Decode the header lines in buf[start:end] (each ending in an EOL)."""
        command = self._command
        self._content_length = -1
        self._body_limit = (
            self._limits.max_body_size if command in _BODY_COMMANDS or self.version == "1.0" else 0
        )
        if start == end:
            self._headers = ()
            if command in _CONNECT_COMMANDS:
                self._body_limit = self._limits.max_body_size  # no accept-version: 1.0
            return
        try:
            text = buf[start:end].decode("utf-8")
        except UnicodeDecodeError:
            raise StompProtocolError(
                f"{command} frame has header bytes that are not UTF-8"
            ) from None
        if "\r" in text:
            text = text.replace("\r\n", "\n")
            if "\r" in text:
                raise StompProtocolError(
                    f"{command} frame has a CR in a header that is not part of a CRLF"
                )
        lines = text.split("\n")
        lines.pop()  # the empty string after the last EOL
        if len(lines) > self._limits.max_headers:
            raise StompProtocolError(
                f"{command} frame has more than {self._limits.max_headers} header lines"
            )
        version = self.version
        unescape = "\\" in text and command not in _RAW_HEADER_COMMANDS and version != "1.0"
        headers: list[tuple[str, str]] = []
        append = headers.append
        for line in lines:  # a plain loop: faster than comprehensions on Python 3.11
            name, colon, value = line.partition(":")
            if not (colon and name):
                raise self._bad_header_line(line)
            if unescape and "\\" in line:
                name = _unescape(name, version)
                value = _unescape(value, version)
            append((name, value))
        self._headers = tuple(headers)
        if command in _CONNECT_COMMANDS and self._body_limit == 0:
            accepted = next((v for n, v in headers if n == "accept-version"), None)
            if negotiate_version(accepted) == "1.0":
                self._body_limit = self._limits.max_body_size
        if "content-length" in text:  # escaping cannot produce this name, so it is literal
            for name, value in headers:
                if name == "content-length":
                    self._content_length = self._parse_content_length(value)
                    break

    def _parse_content_length(self, value: str) -> int:
        if not (value.isascii() and value.isdigit()):
            raise StompProtocolError(
                f"invalid content-length {_shorten(value)!r}: "
                "must be a non-negative decimal integer"
            )
        if len(value) > _MAX_LENGTH_DIGITS or int(value) > self._body_limit:
            raise self._body_too_long(value)
        return int(value)

    def _bad_command(self, raw: bytes, truncated: bool) -> StompProtocolError:
        text = raw.decode("utf-8", "replace")
        if truncated:
            return StompProtocolError(
                f"command line longer than {self._limits.max_command_length} bytes: "
                f"{_shorten(text)!r}"
            )
        if text in ALL_COMMANDS:
            sender = "client" if self._side is Side.SERVER else "server"
            return StompProtocolError(f"a {sender} may not send a {text} frame")
        return StompProtocolError(f"unknown command {_shorten(text)!r}")

    def _headers_too_large(self) -> StompProtocolError:
        return StompProtocolError(
            f"{self._command} frame has more than {self._limits.max_header_size} bytes of headers"
        )

    @staticmethod
    def _bad_header_line(line: str) -> StompProtocolError:
        if ":" not in line:
            return StompProtocolError(f"header line without a colon: {_shorten(line)!r}")
        return StompProtocolError(f"header line with an empty name: {_shorten(line)!r}")

    def _body_too_long(self, content_length: str | None = None) -> StompProtocolError:
        command = self._command
        if command not in _BODY_COMMANDS:
            return StompProtocolError(f"{command} frame must not have a body")
        stated = "" if content_length is None else f" (content-length {_shorten(content_length)})"
        return StompProtocolError(
            f"{command} frame body is larger than {self._limits.max_body_size} bytes{stated}"
        )


def _escape(text: str) -> str:
    # str.replace returns the same object when there is nothing to replace: cheap when clean.
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n").replace(":", "\\c")


def _escape_line(name: str, value: str, version: str) -> str:
    """One header line (no EOL) as ``version`` writes it; ValueError when it cannot."""
    if version == "1.2":
        return f"{_escape(name)}:{_escape(value)}"
    if "\r" in name or "\r" in value:
        raise ValueError(f"STOMP {version} cannot carry a CR in a header: {_shorten(name)!r}")
    if version == "1.1":
        return f"{_escape(name)}:{_escape(value)}"
    _check_raw_header("STOMP 1.0", name, value)
    return f"{name}:{value}"


def encode_frame(command: str, headers: Mapping[str, str], body: bytes = b"") -> bytes:
    """A STOMP 1.2 frame from trusted parts: the client's fast path for every frame it
    writes. Headers are escaped (never CONNECT: the client leaves that to stomp.py) and a
    body always gets its content-length, else a peer ends it at its first NUL."""
    lines = [command]
    for name, value in headers.items():
        if name == "content-length":
            continue
        lines.append(_escape_line(name, value, "1.2"))
    if body:
        lines.append(f"content-length:{len(body)}")
    lines.append("\n")
    return "\n".join(lines).encode() + body + b"\x00"


def _check_raw_header(command: str, name: str, value: str) -> None:
    if ":" in name or "\r" in name or "\n" in name or "\r" in value or "\n" in value:
        raise ValueError(
            f"{command} headers are sent unescaped, so a name may not hold ':' and neither "
            f"name nor value may hold CR or LF: {_shorten(name)!r}"
        )


def encode(frame: Frame, *, content_length: bool = True, version: str = "1.2") -> bytes:
    """Serialize a frame, escaping headers (as ``version`` does) except in CONNECT, STOMP and
    CONNECTED.

    With `content_length` (the default) the frame gets a content-length header computed from
    its body: it replaces the first content-length header given and drops the rest, or is
    appended when there is a body and none was given. Without it the headers are written as
    given and a body holding NUL is refused. Raises ValueError for a frame that cannot be
    written faithfully.
    """
    command = frame.command
    body = frame.body
    if command not in ALL_COMMANDS:
        raise ValueError(f"not a STOMP 1.2 command: {_shorten(command)!r}")
    if body and command not in _BODY_COMMANDS:
        raise ValueError(f"a {command} frame may not have a body")
    raw = command in _RAW_HEADER_COMMANDS
    lines = [command]
    append = lines.append
    wrote_length = False
    for name, value in frame.headers:
        if not name:
            raise ValueError("header names may not be empty")
        if content_length and name == "content-length":
            if wrote_length:
                continue
            value = str(len(body))
            wrote_length = True
        if raw:
            _check_raw_header(command, name, value)
            append(f"{name}:{value}")
        elif version == "1.2":
            append(f"{_escape(name)}:{_escape(value)}")
        else:
            append(_escape_line(name, value, version))
    if content_length:
        if body and not wrote_length:
            append(f"content-length:{len(body)}")
    elif b"\x00" in body:
        raise ValueError("a body holding NUL needs a content-length header")
    append("\n")
    head = "\n".join(lines)
    if "\x00" in head:
        raise ValueError("headers may not hold NUL")
    return b"".join((head.encode("utf-8"), body, b"\x00"))


def encode_header(name: str, value: str, version: str = "1.2") -> bytes:
    """One escaped header line, EOL included, for `encode_message`."""
    if not name:
        raise ValueError("header names may not be empty")
    line = (
        f"{_escape(name)}:{_escape(value)}\n"
        if version == "1.2"
        else f"{_escape_line(name, value, version)}\n"
    )
    if "\x00" in line:
        raise ValueError("headers may not hold NUL")
    return line.encode()


def encode_headers(headers: Iterable[tuple[str, str]]) -> bytes:
    """Escaped header lines for `encode_message`; content-length is dropped, it writes its own.

    The broker encodes a message's headers once when it arrives and reuses the block for
    every delivery.
    """
    return b"".join(
        encode_header(name, value) for name, value in headers if name != "content-length"
    )


def encode_message(body: bytes, *header_blocks: bytes) -> bytes:
    """A MESSAGE frame from pre-encoded header blocks (see `encode_header(s)`) and a body.

    The blocks are written in order and the first occurrence of a header wins, so put the
    broker's own headers (subscription, message-id, ack) before the sender's. content-length
    is written from the body; the blocks must not contain one.
    """
    return b"".join(
        (b"MESSAGE\n", *header_blocks, b"content-length:%d\n\n" % len(body), body, b"\x00")
    )


@attrs.frozen
class HeartBeatIntervals:
    """Negotiated heart-beat periods in milliseconds; 0 means none in that direction."""

    client_to_server: int
    server_to_client: int


def parse_heart_beat(value: str) -> tuple[int, int]:
    """Parse a heart-beat header "cx,cy" into two non-negative millisecond counts."""
    first, comma, second = value.partition(",")
    numbers = (first.strip(), second.strip())
    if not comma or not all(
        number.isascii() and number.isdigit() and len(number) <= _MAX_LENGTH_DIGITS
        for number in numbers
    ):
        raise StompProtocolError(
            f"invalid heart-beat header {_shorten(value)!r}: "
            "expected two non-negative integers 'cx,cy'"
        )
    return int(numbers[0]), int(numbers[1])


def format_heart_beat(outgoing: int, incoming: int) -> str:
    """The heart-beat header value: the period we can send at, the period we want to receive."""
    if outgoing < 0 or incoming < 0:
        raise ValueError(f"heart-beat periods may not be negative: {outgoing},{incoming}")
    return f"{outgoing},{incoming}"


def negotiate_heart_beat(client: tuple[int, int], server: tuple[int, int]) -> HeartBeatIntervals:
    """The periods both sides use, from the CONNECT (cx,cy) and CONNECTED (sx,sy) headers.

    Per STOMP 1.2: the client sends every max(cx, sy) ms unless cx or sy is 0, and the
    server every max(sx, cy) ms unless sx or cy is 0.
    """
    cx, cy = client
    sx, sy = server
    return HeartBeatIntervals(
        client_to_server=0 if cx == 0 or sy == 0 else max(cx, sy),
        server_to_client=0 if sx == 0 or cy == 0 else max(sx, cy),
    )
