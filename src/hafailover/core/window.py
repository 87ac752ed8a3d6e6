"""The confirmation window: sent commands kept until the broker confirms them (F4).

Theory of operation
-------------------
Every command a session sends gets the next command id (0, 1, 2, ...) and, if
the window is on, is kept here with its size in bytes. The broker confirms
periodically, naming the highest id it has received and processed; everything
up to it is freed. When the connection dies and the client reconnects to a
server that still holds the session, the server names the last id it received
(``last_received``) and the client replays exactly the commands after it, in
order: the session continues as if nothing happened (reattach).

Flow control: a command is admitted only while the buffered bytes plus its own
stay within the window, except that an empty window always admits one command
(else a command larger than the window could never be sent). So memory never
exceeds the window plus one command, and a sender that outruns confirmations
waits (``has_room`` is false) instead of growing the buffer.

Commands sent inside a transaction are numbered but not replayable (F9: a
transacted session that lost work is rolled back, never patched up by replay);
a reattach reports which of them the server never received. Commands marked
``resendable`` (persistent sends stamped with a duplicate id) may be sent again
on a brand-new session after a reconnect, since a broker with duplicate
detection drops the copy it already has.

Size -1 turns the window off: ids are still counted, nothing is kept, and
reattach is impossible, which forces a reconnect (as in Artemis).

This module is pure: no I/O, no threads, no clocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

import attrs

from hafailover.errors import IllegalStateError

__all__ = [
    "Command",
    "ConfirmationWindow",
    "ReattachImpossibleError",
    "ReattachPlan",
    "ReconnectPlan",
    "WindowFullError",
    "command_flags",
]

P = TypeVar("P")


def command_flags(*, transacted: bool, stamped: bool) -> tuple[bool, bool]:
    """Whether a command is (replayable, resendable), decided here alone. A transacted
    command is never replayed nor resent: lost work means rollback, not repair (F9). Any
    other is replayed on a reattach, and resent on a reconnect when it is a send stamped
    with a duplicate id (F13), since the broker drops a copy it already has."""
    return not transacted, stamped and not transacted


class WindowFullError(IllegalStateError):
    """A command was recorded without room; the sender must wait for confirmations."""


class ReattachImpossibleError(IllegalStateError):
    """The server's view of the session cannot be reconciled with ours: reconnect instead."""


class Command(Generic[P]):
    """A sent command kept for replay. ``payload`` is whatever the adapter needs to resend."""

    __slots__ = ("command_id", "payload", "replayable", "resendable", "size")

    def __init__(
        self, command_id: int, size: int, payload: P, replayable: bool, resendable: bool
    ) -> None:
        self.command_id = command_id
        self.size = size
        self.payload = payload
        self.replayable = replayable
        self.resendable = resendable

    def __repr__(self) -> str:
        return f"Command(id={self.command_id}, size={self.size}, replayable={self.replayable})"


@attrs.frozen
class ReattachPlan(Generic[P]):
    """What to do when the server still holds the session."""

    replay: tuple[Command[P], ...]  # to send again, in order
    # Ids the server never received and that may not be replayed (transacted work).
    lost_unreplayable: tuple[int, ...]


@attrs.frozen
class ReconnectPlan(Generic[P]):
    """What became of unconfirmed commands when the session had to be recreated."""

    resend: tuple[Command[P], ...]  # safe to send on the new session (duplicate-id stamped)
    in_doubt: tuple[Command[P], ...]  # may or may not have reached the old server


class ConfirmationWindow(Generic[P]):
    """A byte-accounted buffer of unconfirmed commands."""

    __slots__ = ("_buffered", "_entries", "_last_confirmed", "_next_id", "size")

    def __init__(self, size: int) -> None:
        if size != -1 and size <= 0:
            raise ValueError(f"confirmation window size must be -1 or positive, not {size}")
        self.size = size
        self._entries: deque[Command[P]] = deque()
        self._buffered = 0
        self._next_id = 0
        self._last_confirmed = -1

    @property
    def enabled(self) -> bool:
        return self.size != -1

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    @property
    def next_id(self) -> int:
        """The id the next recorded command will get."""
        return self._next_id

    @property
    def last_confirmed(self) -> int:
        """The highest id the broker has confirmed, -1 before the first confirmation."""
        return self._last_confirmed

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Command[P]]:
        return iter(self._entries)

    def has_room(self, size: int) -> bool:
        """Whether a command of ``size`` bytes may be recorded now."""
        return not self._entries or self._buffered + size <= self.size or self.size == -1

    def record(
        self,
        payload: P,
        size: int,
        *,
        replayable: bool = True,
        resendable: bool = False,
        force: bool = False,
    ) -> int:
        """Number a sent command and keep it until confirmed; return its id.

        ``force`` records it even past the window: for the small control commands
        (acknowledges, subscriptions, transaction frames) that flow control never holds
        back, since the broker counts every command and the ids must stay in step."""
        command_id = self._next_id
        if self.size == -1:
            self._next_id = command_id + 1
            return command_id
        if not force and self._entries and self._buffered + size > self.size:
            raise WindowFullError(
                f"confirmation window full: {self._buffered} of {self.size} bytes unconfirmed, "
                f"command of {size} bytes must wait"
            )
        self._next_id = command_id + 1
        self._entries.append(Command(command_id, size, payload, replayable, resendable))
        self._buffered += size
        return command_id

    def confirm(self, up_to: int) -> int:
        """The broker has received every command up to ``up_to``; free them.

        Returns how many commands were freed. A confirmation older than one
        already seen is harmless (0); one for a command never sent is a
        protocol error.
        """
        if up_to >= self._next_id:
            raise ReattachImpossibleError(
                f"broker confirmed command {up_to} but only {self._next_id} were sent"
            )
        if up_to <= self._last_confirmed:
            return 0
        self._last_confirmed = up_to
        entries = self._entries
        freed = 0
        while entries and entries[0].command_id <= up_to:
            self._buffered -= entries.popleft().size
            freed += 1
        return freed

    def reattach_refusal(self, last_received: int) -> str | None:
        """Why a server that says it received up to ``last_received`` cannot be reattached
        to, or None when it can: the window is off, or the server claims fewer commands
        than it confirmed or more than were sent (its view of the session and ours
        disagree). The one test of the window's side of F4; the caller reconnects."""
        if not self.enabled:
            return "the confirmation window is off (size -1)"
        if last_received < self._last_confirmed:
            return f"server received up to {last_received} but had confirmed {self._last_confirmed}"
        if last_received >= self._next_id:
            return f"server received up to {last_received} but only {self._next_id} were sent"
        return None

    def reattach(self, last_received: int) -> ReattachPlan[P]:
        """Plan the replay after a reattach; the server received up to ``last_received``.

        Frees what the server has, and returns the rest in order. Raises
        ReattachImpossibleError when ``reattach_refusal`` gives a reason.
        """
        refusal = self.reattach_refusal(last_received)
        if refusal is not None:
            raise ReattachImpossibleError(refusal)
        if last_received >= 0:
            self.confirm(last_received)
        replay = tuple(c for c in self._entries if c.replayable)
        lost = tuple(c.command_id for c in self._entries if not c.replayable)
        if lost:
            # Never sent again, so never confirmed: drop them now. The server
            # tracks the highest id it received, so the gap they leave is fine.
            self._entries = deque(replay)
            self._buffered = sum(c.size for c in replay)
        return ReattachPlan(replay=replay, lost_unreplayable=lost)

    def reconnect(self) -> ReconnectPlan[P]:
        """Empty the window for a brand-new session and say what became of its commands.

        Ids start again at 0, as the new session's do on the server.
        """
        entries = tuple(self._entries)
        plan = ReconnectPlan(
            resend=tuple(c for c in entries if c.resendable),
            in_doubt=tuple(c for c in entries if not c.resendable),
        )
        self._entries.clear()
        self._buffered = 0
        self._next_id = 0
        self._last_confirmed = -1
        return plan
