"""The sink's options and column rules, checked before any task runs (no Spark session)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from hafailover.errors import ConfigurationError
from hafailover.spark import DeliveryGuarantee, SinkOptions
from hafailover.spark._report import ORDER_WARNING, RETENTION_WARNING
from hafailover.spark._rows import ColumnPlan, plan_columns
from hafailover.spark.datasource import HaFailoverDataSource

pytestmark = [pytest.mark.spark]

URL = "failover:(stomp://127.0.0.1:61613,stomp://127.0.0.1:61614)"


def options(**given: str) -> SinkOptions:
    return SinkOptions.parse({"url": URL, "destination": "queue://orders", **given})


def schema(*fields: tuple[str, object]) -> StructType:
    return StructType([StructField(name, data_type) for name, data_type in fields])  # type: ignore[arg-type]


def test_defaults() -> None:
    parsed = options()
    assert parsed.url == URL
    assert str(parsed.destination) == "queue://orders"
    assert parsed.delivery_guarantee is DeliveryGuarantee.EXACTLY_ONCE
    assert parsed.sink_id is None and parsed.key_column is None and parsed.commit_log is None
    assert parsed.positional_ids is False
    assert options(positional_ids="TRUE").positional_ids is True


def test_keys_are_compared_without_case() -> None:
    parsed = SinkOptions.parse({"URL": URL, "Destination": "/queue/x", "Sink_Id": "orders-1"})
    assert str(parsed.destination) == "queue://x" and parsed.sink_id == "orders-1"


def test_missing_url_is_refused() -> None:
    with pytest.raises(ConfigurationError, match='option "url" is missing'):
        SinkOptions.parse({"destination": "queue://orders"})


def test_bad_url_names_the_option() -> None:
    with pytest.raises(ConfigurationError, match='option "url"'):
        SinkOptions.parse({"url": "failover:(stomp://a:1,amqp://b:2)"})


def test_connection_options_pass_through_into_the_url() -> None:
    parsed = options(heartbeat="2s", retry_interval="50ms")
    assert parsed.url == f"{URL}?heartbeat=2s&retry_interval=50ms"
    assert parsed.policy.heartbeat == 2.0
    single = SinkOptions.parse({"url": "stomp://h:1?heartbeat=3s", "retry_interval": "50ms"})
    assert single.url == "stomp://h:1?heartbeat=3s&retry_interval=50ms"


def test_unknown_option_lists_what_is_accepted() -> None:
    with pytest.raises(ConfigurationError, match="unknown option 'destinaton'") as caught:
        options(destinaton="queue://x")
    assert "sink options: url" in str(caught.value) and "heartbeat" in str(caught.value)


def test_spark_own_options_are_ignored() -> None:
    assert options(checkpointLocation="/tmp/x").url == URL


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"destination": "ftp://x"}, 'option "destination"'),
        ({"sink_id": "a:b"}, 'option "sink_id"'),
        ({"sink_id": ""}, 'option "sink_id"'),
        ({"delivery_guarantee": "at_most_once"}, "exactly_once, at_least_once"),
        ({"key_column": " "}, 'option "key_column" is empty'),
        ({"positional_ids": "yes"}, "option \"positional_ids\" is 'yes'; accepted: true, false"),
        ({"heartbeat": "soon"}, "heartbeat"),
    ],
)
def test_bad_values_are_refused(given: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        options(**given)


def test_the_password_stays_out_of_repr() -> None:
    assert "hunter2" not in repr(options(user="u", password="hunter2"))


# --- columns ----------------------------------------------------------------------------


def test_columns_like_the_kafka_sink() -> None:
    plan = plan_columns(
        schema(
            ("key", StringType()),
            ("value", BinaryType()),
            ("headers", MapType(StringType(), LongType())),
            ("destination", StringType()),
        ),
        options(),
    )
    assert plan == ColumnPlan(body="value", headers="headers", destination="destination", key="key")


def test_key_column_option_and_case() -> None:
    plan = plan_columns(
        schema(("Body", StringType()), ("order_id", LongType())), options(key_column="ORDER_ID")
    )
    assert plan == ColumnPlan(body="Body", key="order_id")


def test_at_least_once_needs_no_key() -> None:
    plan = plan_columns(
        schema(("body", StringType()), ("key", StringType())),
        options(delivery_guarantee="at_least_once"),
    )
    assert plan.key is None


def test_destination_column_replaces_the_option() -> None:
    given = SinkOptions.parse({"url": URL})
    assert plan_columns(schema(("body", StringType()), ("destination", StringType())), given)
    with pytest.raises(ConfigurationError, match='option "destination" is missing'):
        plan_columns(schema(("body", StringType())), given)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((("payload", StringType()),), "no body column"),
        ((("body", StringType()), ("value", StringType())), "both 'body' and 'value'"),
        ((("body", IntegerType()),), "'body' is int: the message body must be string or binary"),
        ((("body", StringType()), ("headers", StringType())), "headers must be a map"),
        (
            (("body", StringType()), ("headers", MapType(StringType(), ArrayType(StringType())))),
            "headers must be a map",
        ),
        ((("body", StringType()), ("destination", LongType())), "'destination' is bigint"),
        ((("body", StringType()), ("key", DoubleType())), "a key must be string, binary"),
        ((("body", StringType()), ("extra", StringType())), r"does not use: \['extra'\]"),
        ((("body", StringType()), ("BODY", StringType())), "appears twice"),
    ],
)
def test_bad_columns_are_refused(fields: tuple[tuple[str, object], ...], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        plan_columns(schema(*fields), options())


def test_key_column_option_must_name_a_column() -> None:
    with pytest.raises(ConfigurationError, match="not a column"):
        plan_columns(schema(("body", StringType())), options(key_column="id"))


def test_positional_ids_and_a_key_together_are_refused() -> None:
    with pytest.raises(ConfigurationError, match='"positional_ids" is for rows without a key'):
        plan_columns(
            schema(("body", StringType()), ("key", StringType())), options(positional_ids="true")
        )
    plan = plan_columns(schema(("body", StringType())), options(positional_ids="true"))
    assert plan == ColumnPlan(body="body")


@pytest.mark.parametrize(
    ("given", "fields", "warned"),
    [
        ({"positional_ids": "true"}, (("body", StringType()),), True),
        ({}, (("body", StringType()),), False),
        (
            {"positional_ids": "true", "delivery_guarantee": "at_least_once"},
            (("body", StringType()),),
            False,
        ),
        ({}, (("body", StringType()), ("key", StringType())), False),
    ],
)
def test_a_write_whose_ids_depend_on_order_is_warned_about(
    caplog: pytest.LogCaptureFixture,
    given: dict[str, str],
    fields: tuple[tuple[str, object], ...],
    warned: bool,
) -> None:
    source = HaFailoverDataSource({"url": URL, "destination": "queue://orders", **given})
    with caplog.at_level(logging.WARNING, logger="hafailover.spark"):
        source.writer(schema(*fields), overwrite=False)
        source.streamWriter(schema(*fields), overwrite=False)
    order = [r for r in caplog.records if r.getMessage() == ORDER_WARNING]
    assert len(order) == (2 if warned else 0)


@pytest.mark.parametrize(
    ("given", "warned", "relied_on"),
    [
        ({}, True, None),
        ({"broker_duplicate_id_retention": "2h"}, False, "7200s"),
        ({"delivery_guarantee": "at_least_once"}, False, None),
    ],
)
def test_an_exactly_once_write_warns_when_it_cannot_know_the_brokers_retention(
    caplog: pytest.LogCaptureFixture,
    given: dict[str, str],
    warned: bool,
    relied_on: str | None,
) -> None:
    """No broker says how long it keeps duplicate ids: unless the user states it, a write
    warns at its start that a late retry may store rows twice, naming what to set."""
    source = HaFailoverDataSource({"url": URL, "destination": "queue://orders", **given})
    with caplog.at_level(logging.INFO, logger="hafailover.spark"):
        source.writer(schema(("body", StringType())), overwrite=False)
        source.streamWriter(schema(("body", StringType())), overwrite=False)
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count(RETENTION_WARNING) == (2 if warned else 0)
    if warned:
        levels = {r.levelno for r in caplog.records if r.getMessage() == RETENTION_WARNING}
        assert levels == {logging.WARNING}
        assert "id-cache-size" in RETENTION_WARNING
        assert "--duplicate-id-retention" in RETENTION_WARNING
    relied = [m for m in messages if "relies on the broker keeping duplicate ids" in m]
    assert len(relied) == (2 if relied_on else 0)
    assert all(relied_on in m for m in relied if relied_on)


@pytest.mark.parametrize("value", ["soon", "0s", "-1h"])
def test_a_bad_broker_retention_is_refused(value: str) -> None:
    with pytest.raises(ConfigurationError, match='"broker_duplicate_id_retention"'):
        options(broker_duplicate_id_retention=value)
