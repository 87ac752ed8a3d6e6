"""Column rules, duplicate ids, and Arrow record batches turned into messages.

The columns follow Spark's Kafka sink: ``body`` (or ``value``), string or binary, one
message per row; optional ``headers`` (a map: the message's properties); optional
``destination`` (a string that overrides the ``destination`` option for its row); optional
``key`` (or the column named by ``key_column``), which identifies the row for duplicate
detection. ``plan_columns`` checks a DataFrame's schema against these rules on the driver,
before any task runs. ``to_messages`` checks one whole record batch before the caller sends
any row of it, so a null body or a bad destination stops the task with nothing of that
record batch on the wire.

A row's duplicate id is ``{sink_id}:{batch_id}:k:{key}`` with a key. Without one it is
``{sink_id}:{batch_id}:c{partition}:{digest}:{occurrence}``: the digest of what the row is
(the message it makes: body, properties, destination; ``row_content`` encodes it
canonically) and how many identical rows came before it in the partition. Identical rows
make identical messages, so which of them gets which occurrence number does not matter, and
any order of the same rows gives the same set of ids: a task retry that sees its partition
in another order (after a shuffle) sends each row under the id it had before. With the
``positional_ids`` option the id is ``{sink_id}:{batch_id}:p{partition}:{position}``,
cheaper but only right if a retry sees the same order. No I/O here.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs
import pyarrow as pa
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
)

from hafailover.destination import Destination, parse_destination
from hafailover.errors import ConfigurationError
from hafailover.message import Message, PropertyValue
from hafailover.spark._options import DeliveryGuarantee, SinkOptions

__all__ = ["ColumnPlan", "IdScheme", "plan_columns", "row_content", "to_messages"]

_BODY_NAMES: Final = ("body", "value")
_HEADER_VALUE_TYPES: Final = (
    StringType,
    BooleanType,
    ByteType,
    ShortType,
    IntegerType,
    LongType,
    FloatType,
    DoubleType,
)
_KEY_TYPES: Final = (StringType, BinaryType, ByteType, ShortType, IntegerType, LongType)
# Longer keys (and keys that are not printable text) enter the duplicate id as a digest.
_MAX_PLAIN_KEY: Final = 128


@attrs.frozen
class ColumnPlan:
    """Which column of the DataFrame plays which part (the schema's own spelling)."""

    body: str
    headers: str | None = None
    destination: str | None = None
    key: str | None = None


def _type_name(data_type: DataType) -> str:
    return str(data_type.simpleString())


def plan_columns(schema: StructType, options: SinkOptions) -> ColumnPlan:
    """Check the schema against the column rules; raise ConfigurationError if it breaks one."""
    by_name: dict[str, Any] = {}
    for field in schema.fields:
        lowered = field.name.lower()
        if lowered in by_name:
            raise ConfigurationError(
                f"column {field.name!r} appears twice (names are compared without case)"
            )
        by_name[lowered] = field

    bodies = [by_name[n] for n in _BODY_NAMES if n in by_name]
    if not bodies:
        raise ConfigurationError(
            "the DataFrame has no body column: name the message body 'body' (or 'value'), "
            f"string or binary; its columns are {[f.name for f in schema.fields]}"
        )
    if len(bodies) > 1:
        raise ConfigurationError(
            "the DataFrame has both 'body' and 'value' columns: keep one as the message body"
        )
    body = bodies[0]
    if not isinstance(body.dataType, StringType | BinaryType):
        raise ConfigurationError(
            f"column {body.name!r} is {_type_name(body.dataType)}: the message body must be "
            f"string or binary (cast it, e.g. to_json(struct(...)) or col({body.name!r})"
            ".cast('string'))"
        )
    used = {body.name.lower()}

    headers = by_name.get("headers")
    if headers is not None:
        data_type = headers.dataType
        if not (
            isinstance(data_type, MapType)
            and isinstance(data_type.keyType, StringType)
            and isinstance(data_type.valueType, _HEADER_VALUE_TYPES)
        ):
            raise ConfigurationError(
                f"column {headers.name!r} is {_type_name(data_type)}: headers must be a "
                "map<string, string|boolean|integer|long|float|double>"
            )
        used.add("headers")

    destination = by_name.get("destination")
    if destination is not None:
        if not isinstance(destination.dataType, StringType):
            raise ConfigurationError(
                f"column {destination.name!r} is {_type_name(destination.dataType)}: "
                "a destination must be a string such as 'queue://orders'"
            )
        used.add("destination")
    elif options.destination is None:
        raise ConfigurationError(
            'option "destination" is missing and the DataFrame has no destination column: '
            'give .option("destination", "queue://NAME") or a string column "destination"'
        )

    key_name = (options.key_column or "key").lower()
    key = by_name.get(key_name)
    if key is None and options.key_column is not None:
        raise ConfigurationError(
            f'option "key_column" names {options.key_column!r}, which is not a column; '
            f"the columns are {[f.name for f in schema.fields]}"
        )
    if key is not None:
        if options.positional_ids:
            raise ConfigurationError(
                f'option "positional_ids" is for rows without a key, and column {key.name!r} '
                "is the key (its value is the row's duplicate id): leave one of them out"
            )
        if not isinstance(key.dataType, _KEY_TYPES):
            raise ConfigurationError(
                f"column {key.name!r} is {_type_name(key.dataType)}: a key must be string, "
                "binary or an integer type"
            )
        used.add(key_name)

    unknown = [f.name for f in schema.fields if f.name.lower() not in used]
    if unknown:
        raise ConfigurationError(
            f"the DataFrame has columns the sink does not use: {unknown}; the sink takes "
            "body (or value), headers, destination and key (or the column named by "
            "key_column): select only those"
        )
    if options.delivery_guarantee is DeliveryGuarantee.AT_LEAST_ONCE:
        # Keys only feed duplicate ids, which at-least-once delivery does not derive.
        return ColumnPlan(
            body=body.name,
            headers=headers.name if headers is not None else None,
            destination=destination.name if destination is not None else None,
        )
    return ColumnPlan(
        body=body.name,
        headers=headers.name if headers is not None else None,
        destination=destination.name if destination is not None else None,
        key=key.name if key is not None else None,
    )


@attrs.define
class IdScheme:
    """Derives each row's duplicate id within one partition of one batch; a ``None`` prefix
    means at-least-once (no id). Counts the content digests it has seen, so one scheme
    serves one task's partition from its first row to its last."""

    prefix: str | None  # "{sink_id}:{batch_id}:"
    partition: int
    positional: bool = False
    _seen: dict[str, int] = attrs.field(factory=dict, init=False, repr=False)

    @classmethod
    def for_batch(
        cls, options: SinkOptions, sink_id: str, batch_id: str, partition: int
    ) -> IdScheme:
        if options.delivery_guarantee is DeliveryGuarantee.AT_LEAST_ONCE:
            return cls(None, partition)
        return cls(f"{sink_id}:{batch_id}:", partition, options.positional_ids)

    def by_position(self, position: int) -> str | None:
        if self.prefix is None:
            return None
        return f"{self.prefix}p{self.partition}:{position}"

    def by_key(self, key: object) -> str | None:
        if self.prefix is None:
            return None
        return f"{self.prefix}k:{key_text(key)}"

    def by_content(self, content: bytes) -> str | None:
        """The id of the next row whose ``row_content`` is ``content``."""
        if self.prefix is None:
            return None
        digest = hashlib.blake2b(content, digest_size=_DIGEST_BYTES).hexdigest()
        occurrence = self._seen.get(digest, 0)
        self._seen[digest] = occurrence + 1
        return f"{self.prefix}c{self.partition}:{digest}:{occurrence}"


# 128 bits: two different rows of one partition share a digest with odds of about
# n**2 / 2**129, far below any other failure for any partition Spark can hold.
_DIGEST_BYTES: Final = 16
_LENGTH: Final = struct.Struct(">Q").pack
_INTEGER: Final = struct.Struct(">q").pack
_DOUBLE: Final = struct.Struct(">d").pack
_NO_PROPERTIES: Final = _LENGTH(0)


def _text(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def _property(value: PropertyValue) -> bytes:
    # Tagged, so 1, 1.0, True and "1" (different properties on the wire) stay different.
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        return b"i" + _INTEGER(value)
    if isinstance(value, float):
        return b"d" + (b"nan" if math.isnan(value) else _DOUBLE(value))
    if isinstance(value, str):
        data = _text(value)
        return b"s" + _LENGTH(len(data)) + data
    raise ConfigurationError(f"a header value must be text, a number or a boolean, not {value!r}")


def row_content(
    body: str | bytes, properties: Mapping[str, PropertyValue], destination: Destination
) -> bytes:
    """What a row is, encoded so that two rows get the same bytes exactly when they make the
    same message (body, properties, destination): every field length-prefixed and typed,
    properties sorted by name (a map's entry order means nothing)."""
    return _content(body, properties, _target(destination))


def _target(destination: Destination) -> bytes:
    data = _text(str(destination))
    return _LENGTH(len(data)) + data


def _content(body: str | bytes, properties: Mapping[str, PropertyValue], target: bytes) -> bytes:
    data = _text(body) if isinstance(body, str) else bytes(body)
    parts = [b"s" if isinstance(body, str) else b"b", _LENGTH(len(data)), data, target]
    if properties:
        parts.append(_LENGTH(len(properties)))
        for name in sorted(properties):
            encoded = _text(name)
            parts += (_LENGTH(len(encoded)), encoded, _property(properties[name]))
    else:
        parts.append(_NO_PROPERTIES)
    return b"".join(parts)


def key_text(key: object) -> str:
    """A key as it appears in a duplicate id: short printable text as is, else a digest."""
    if isinstance(key, bytes):
        text = key.hex()
    elif isinstance(key, bool) or not isinstance(key, str | int):
        raise ConfigurationError(f"a key must be text, bytes or an integer, not {key!r}")
    else:
        text = str(key)
    if len(text) <= _MAX_PLAIN_KEY and text.isprintable():
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _headers(value: Iterable[tuple[str, Any]] | None) -> dict[str, PropertyValue]:
    if value is None:
        return {}
    # A null map value means "no such header" (Spark cannot leave a map entry out).
    return {k: v for k, v in value if v is not None}


def to_messages(
    batch: pa.RecordBatch,
    plan: ColumnPlan,
    options: SinkOptions,
    ids: IdScheme,
    first_position: int,
) -> list[tuple[Message, Destination]]:
    """Every row of ``batch`` as (message, destination), or ConfigurationError for the first
    bad row. ``first_position`` is the partition position of the batch's first row."""
    rows = batch.num_rows
    bodies = batch.column(plan.body).to_pylist()
    where = f"partition {ids.partition}"
    if None in bodies:
        position = first_position + bodies.index(None)
        raise ConfigurationError(
            f"row {position} of {where} has a null body: filter such rows out "
            f"(df.where(col({plan.body!r}).isNotNull())); nothing of its record batch was sent"
        )
    headers = batch.column(plan.headers).to_pylist() if plan.headers else [None] * rows
    keys = batch.column(plan.key).to_pylist() if plan.key else None
    if keys is not None and None in keys:
        position = first_position + keys.index(None)
        raise ConfigurationError(
            f"row {position} of {where} has a null key in column {plan.key!r}: every row "
            "needs its key, which is its identity for duplicate detection"
        )
    default = options.destination
    resolved: list[Destination]
    if plan.destination:
        parsed: dict[str, Destination] = {}
        resolved = []
        for index, name in enumerate(batch.column(plan.destination).to_pylist()):
            if name is None:
                if default is None:
                    raise ConfigurationError(
                        f"row {first_position + index} of {where} has a null destination and "
                        'there is no "destination" option to fall back on'
                    )
                resolved.append(default)
                continue
            target = parsed.get(name)
            if target is None:
                try:
                    target = parsed[name] = parse_destination(name)
                except ConfigurationError as exc:
                    raise ConfigurationError(
                        f"row {first_position + index} of {where}: {exc}"
                    ) from None
            resolved.append(target)
    else:
        assert default is not None  # plan_columns insists on one or the other
        resolved = [default] * rows

    messages: list[tuple[Message, Destination]] = []
    append = messages.append
    by_content = keys is None and ids.prefix is not None and not ids.positional
    targets: dict[Destination, bytes] = {}
    for index in range(rows):
        position = first_position + index
        properties = _headers(headers[index])
        if keys is not None:
            message_id = ids.by_key(keys[index])
        elif by_content:
            destination = resolved[index]
            where_to = targets.get(destination)
            if where_to is None:
                where_to = targets[destination] = _target(destination)
            try:
                content = _content(bodies[index], properties, where_to)
            except ConfigurationError as exc:
                raise ConfigurationError(f"row {position} of {where}: {exc}") from None
            message_id = ids.by_content(content)
        else:
            message_id = ids.by_position(position)
        try:
            message = Message(body=bodies[index], properties=properties, message_id=message_id)
        except ConfigurationError as exc:
            raise ConfigurationError(f"row {position} of {where}: {exc}") from None
        append((message, resolved[index]))
    return messages
