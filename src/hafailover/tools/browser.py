"""The browser client: ``hafailover browser`` lists a queue's waiting messages without
consuming them. A failover while browsing raises ``BrowserInvalidatedError`` (F11); the
command reports it rather than print a list that silently stops short."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from hafailover.ack_modes import AckMode
from hafailover.connection import connect
from hafailover.errors import HaFailoverError, LocalError
from hafailover.message import Message
from hafailover.tools._common import OptionError, check_destination, check_url
from hafailover.tools.consumer import seq_of

__all__ = ["BrowserOptions", "BrowserResult", "run_browser"]


@attrs.frozen
class BrowserOptions:
    url: str
    destination: str = "queue://TEST"
    user: str | None = None
    password: str | None = None


@attrs.define
class BrowserResult:
    summary: dict[str, Any]
    ok: bool


def describe(message: Message) -> dict[str, Any]:
    return {
        "seq": seq_of(message),
        "message_id": message.message_id,
        "size": len(message.body_bytes),
        "redelivered": bool(message.redelivered),
    }


def run_browser(
    options: BrowserOptions, *, on_message: Callable[[dict[str, Any]], None] | None = None
) -> BrowserResult:
    """Browse the queue once; ``on_message`` sees each message's description."""
    check_url(options.url)
    queue = check_destination(options.destination)
    if queue.is_topic:
        raise OptionError("--destination", f"only queues can be browsed, not {queue}")
    messages: list[dict[str, Any]] = []
    error: str | None = None
    try:
        with connect(options.url, user=options.user, password=options.password) as connection:
            session = connection.create_session(AckMode.AUTO)
            for message in session.create_browser(queue):
                entry = describe(message)
                messages.append(entry)
                if on_message is not None:
                    on_message(entry)
    except HaFailoverError as exc:
        if isinstance(exc, LocalError):
            raise
        error = f"{type(exc).__name__}: {exc}"
    summary: dict[str, Any] = {
        "command": "browser",
        "destination": str(queue),
        "count": len(messages),
        "messages": messages,
    }
    if error is not None:
        summary["error"] = error
    return BrowserResult(summary=summary, ok=error is None)
