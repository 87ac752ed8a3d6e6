"""The sink's options: parsed once, on the driver, before any task runs.

Spark hands a data source its options as a case-insensitive string map (keys arrive
lower-cased). ``SinkOptions.parse`` turns that map into a frozen value or raises a
``ConfigurationError`` naming the option and what would be accepted. Options the sink does
not know are connection URL options (``heartbeat``, ``retry_interval``, ...): they are
appended to the URL and checked by the URL parser, so a misspelt name is still refused.
Pure: no Spark, no sockets.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Final

import attrs

from hafailover._units import parse_duration
from hafailover.destination import Destination, parse_destination
from hafailover.errors import ConfigurationError, InvalidURLError
from hafailover.url import FailoverPolicy, parse_url

__all__ = ["DeliveryGuarantee", "SinkOptions"]


class DeliveryGuarantee(enum.Enum):
    # Every row carries a duplicate id derived from sink id, batch id and its key, or
    # without a key from its content (or its position, with positional_ids):
    # a re-run of the same batch (task retry, query restart) is dropped by the broker.
    EXACTLY_ONCE = "exactly_once"
    # No derived id: a task retry or a re-run batch sends its rows again.
    AT_LEAST_ONCE = "at_least_once"


# The sink's own options; everything else must be a connection URL option.
SINK_OPTIONS: Final = (
    "url",
    "user",
    "password",
    "destination",
    "sink_id",
    "key_column",
    "positional_ids",
    "delivery_guarantee",
    "commit_log",
    "batch_id",
    "broker_duplicate_id_retention",
)
# Options Spark itself adds to a streaming sink's map; they are not ours to judge.
_SPARK_OPTIONS: Final = frozenset({"checkpointlocation", "path", "queryname"})
# A sink id is one segment of every duplicate id: ':' separates the segments.
_SINK_ID: Final = re.compile(r"[A-Za-z0-9._\-]{1,100}")
_BOOLEANS: Final = {"true": True, "false": False}


@attrs.frozen
class SinkOptions:
    """Everything the sink needs besides the data: where, how, and who it is."""

    url: str  # the failover URL with the pass-through options appended
    policy: FailoverPolicy = attrs.field(eq=False, repr=False)
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    destination: Destination | None = None
    sink_id: str | None = None
    key_column: str | None = None
    # Without a key, number rows by their place in the partition instead of their content:
    # cheaper, but a retry that sees another order sends a row under another row's id.
    positional_ids: bool = False
    delivery_guarantee: DeliveryGuarantee = DeliveryGuarantee.EXACTLY_ONCE
    # A file the driver appends one JSON line to per committed or aborted batch.
    commit_log: str | None = None
    # A batch write's batch id (the foreachBatch helper passes Spark's); None: "write".
    batch_id: str | None = None
    # How long the user says the broker keeps duplicate ids (seconds), which the sink cannot
    # ask a broker; None: unknown, and exactly_once warns that it cannot know a retry is
    # covered.
    broker_duplicate_id_retention: float | None = None

    @property
    def connection_key(self) -> tuple[str, str | None, str | None]:
        """What makes two writers share one connection in a Python worker."""
        return (self.url, self.user, self.password)

    @property
    def redacted_url(self) -> str:
        return self.policy.redacted()

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        """Validate Spark's option map (keys compared case-insensitively)."""
        given = {str(k).lower(): v for k, v in options.items()}
        url = given.get("url")
        if url is None or not str(url).strip():
            raise ConfigurationError(
                'option "url" is missing: give the brokers as a failover URL, e.g. '
                '.option("url", "failover:(stomp://h1:61613,stomp://h2:61613)")'
            )
        passthrough = {
            k: v for k, v in given.items() if k not in SINK_OPTIONS and k not in _SPARK_OPTIONS
        }
        full_url = _with_options(str(url).strip(), passthrough)
        try:
            policy = parse_url(full_url)
        except InvalidURLError as exc:
            if exc.option in passthrough and str(exc).startswith("unknown option"):
                raise ConfigurationError(
                    f"unknown option {exc.option!r} for the hafailover sink; sink options: "
                    f"{', '.join(SINK_OPTIONS)}; connection options: {', '.join(exc.accepted)}"
                ) from None
            raise ConfigurationError(f'option "url": {exc}') from None

        destination = None
        if given.get("destination") is not None:
            try:
                destination = parse_destination(given["destination"])
            except ConfigurationError as exc:
                raise ConfigurationError(f'option "destination": {exc}') from None

        sink_id = given.get("sink_id")
        if sink_id is not None and not _SINK_ID.fullmatch(sink_id):
            raise ConfigurationError(
                f'option "sink_id" is {sink_id!r}: use 1 to 100 letters, digits, ".", "_" or "-" '
                "(it is part of every duplicate id, so keep it the same across restarts)"
            )

        guarantee_text = given.get("delivery_guarantee", DeliveryGuarantee.EXACTLY_ONCE.value)
        try:
            guarantee = DeliveryGuarantee(guarantee_text.strip().lower())
        except ValueError:
            raise ConfigurationError(
                f'option "delivery_guarantee" is {guarantee_text!r}; accepted: '
                + ", ".join(g.value for g in DeliveryGuarantee)
            ) from None

        batch_id = given.get("batch_id")
        if batch_id is not None and not _SINK_ID.fullmatch(batch_id):
            raise ConfigurationError(
                f'option "batch_id" is {batch_id!r}: use 1 to 100 letters, digits, ".", "_" '
                'or "-" (foreachBatch passes its batch id, a number)'
            )

        key_column = given.get("key_column")
        if key_column is not None and not key_column.strip():
            raise ConfigurationError('option "key_column" is empty: name a column or leave it out')

        positional_text = given.get("positional_ids", "false")
        positional = _BOOLEANS.get(str(positional_text).strip().lower())
        if positional is None:
            raise ConfigurationError(
                f'option "positional_ids" is {positional_text!r}; accepted: true, false'
            )

        retention = None
        retention_text = given.get("broker_duplicate_id_retention")
        if retention_text is not None:
            try:
                retention = parse_duration(str(retention_text).strip())
            except ValueError as exc:
                raise ConfigurationError(
                    f'option "broker_duplicate_id_retention": {exc}; give how long the broker '
                    'keeps duplicate ids, e.g. "1h" (the bundled pair\'s '
                    "--duplicate-id-retention)"
                ) from None
            if retention <= 0:
                raise ConfigurationError(
                    f'option "broker_duplicate_id_retention" is {retention_text!r}: a broker '
                    "that keeps ids for no time covers no retry; leave the option out"
                )

        return cls(
            url=full_url,
            policy=policy,
            user=given.get("user"),
            password=given.get("password"),
            destination=destination,
            sink_id=sink_id,
            key_column=key_column,
            positional_ids=positional,
            delivery_guarantee=guarantee,
            commit_log=given.get("commit_log") or None,
            batch_id=batch_id,
            broker_duplicate_id_retention=retention,
        )


def _with_options(url: str, extra: Mapping[str, str]) -> str:
    if not extra:
        return url
    # Sorted, so the same options always give the same URL (the worker's connection key).
    query = "&".join(f"{name}={value}" for name, value in sorted(extra.items()))
    tail = url.rpartition(")")[2] if url.lower().startswith("failover:") else url
    return f"{url}{'&' if '?' in tail else '?'}{query}"
