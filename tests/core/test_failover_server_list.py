"""Reading the standard AMQP failover list (the announcement ActiveMQ Artemis sends)."""

from __future__ import annotations

from proton import symbol

from hafailover.protocols.base import parse_failover_server_list


def test_entries_with_symbol_or_string_keys_give_host_and_port() -> None:
    announced = [
        {symbol("network-host"): "10.0.0.2", symbol("hostname"): "b", symbol("port"): 5673},
        {"hostname": "backup.example", "port": "5674", "scheme": "amqp"},
        {"network-host": "[::1]", "scheme": "amqps"},  # no port: the scheme's default
        {"network-host": "c"},
    ]
    assert parse_failover_server_list(announced) == (
        ("10.0.0.2", 5673),
        ("backup.example", 5674),
        ("::1", 5671),
        ("c", 5672),
    )


def test_what_is_not_a_server_entry_is_skipped() -> None:
    assert parse_failover_server_list(None) == ()
    assert parse_failover_server_list("h:1") == ()
    assert (
        parse_failover_server_list(
            [{"port": 5672}, {"network-host": ""}, {"network-host": "h", "port": "x"}, "h", 3]
        )
        == ()
    )
