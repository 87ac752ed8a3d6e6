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
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable

from hafailover.ack_modes import AckMode
from hafailover.errors import ConfigurationError

__all__ = ["DuplicateWindow", "Remembered", "remembered_at"]


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


class DuplicateWindow:
    """The last ``size`` distinct ids remembered, oldest first out. Remembering an id again
    makes it the newest."""

    __slots__ = ("_ids", "size")

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(
                f"a duplicate window holds a whole number of ids >= 1, not {size!r}"
            )
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, message_ids: Iterable[str | None]) -> None:
        ids = self._ids
        for message_id in message_ids:
            if message_id is None:
                continue  # a message without an id cannot be told from another
            ids[message_id] = None
            ids.move_to_end(message_id)
            if len(ids) > self.size:
                ids.popitem(last=False)

    def forget(self, message_id: str | None) -> None:
        """The message never reached the application after all: a copy is a delivery."""
        if message_id is not None:
            self._ids.pop(message_id, None)

    def ids(self) -> tuple[str, ...]:
        """Oldest first."""
        return tuple(self._ids)
