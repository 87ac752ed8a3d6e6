"""What every protocol adapter shares: the value an open returns and the topology header.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

import attrs

from hafailover.url import BrokerAddress, FailoverPolicy

__all__ = [
    "Opened",
    "TlsOptions",
    "detects_duplicates",
    "parse_failover_server_list",
    "parse_topology",
]

# Brokers known to drop a message whose duplicate id they have stored (DESIGN F13), by the
# prefix of the name they give in STOMP's CONNECTED ``server`` header or AMQP's ``product``
# open property. Any other broker is taken not to: a retry could store twice there.
_DETECTS_DUPLICATES: Final = (
    "hafailover-reference-broker",
    "activemq-artemis",
    "apache-activemq-artemis",
)


@attrs.frozen
class TlsOptions:
    """How a TLS link checks the broker and shows itself (the URL's ssl_* options)."""

    ca_file: str | None = None  # the CAs that verify the broker; None: the system's
    cert_file: str | None = None  # a client certificate, for mutual TLS
    key_file: str | None = None
    verify: bool = True  # the broker's certificate and host name are checked

    @classmethod
    def of(cls, policy: FailoverPolicy) -> TlsOptions:
        return cls(policy.ssl_ca_file, policy.ssl_cert_file, policy.ssl_key_file, policy.ssl_verify)


@attrs.frozen
class Opened:
    """What the broker said when the connection opened."""

    broker: BrokerAddress
    session_id: str | None  # for a later reattach; None when the broker lacks the extension
    resumed: bool  # the broker still held the session asked for (reattach)
    last_received: int  # with resumed: the last command id the broker received
    topology: tuple[tuple[str, int], ...]  # announced client addresses, empty if none
    reattach_refused: bool = False  # a reattach was asked for and the session is gone
    detects_duplicates: bool = False  # the broker drops a copy by its duplicate id (F13)
    product: str = ""  # what the broker calls itself (STOMP ``server``, AMQP ``product``)


def parse_topology(value: str | None) -> tuple[tuple[str, int], ...]:
    """The (host, port) pairs of a topology announcement: "h1:p1,[::1]:p2"."""
    endpoints: list[tuple[str, int]] = []
    for item in (value or "").split(","):
        host, _, port = item.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if host and port.isdigit():
            endpoints.append((host, int(port)))
    return tuple(endpoints)


def parse_failover_server_list(value: object) -> tuple[tuple[str, int], ...]:
    """The (host, port) pairs of an AMQP ``failover-server-list`` (the standard
    announcement of ActiveMQ Artemis, read by Qpid JMS): a list of maps whose keys are
    symbols or strings, ``network-host`` (else ``hostname``) and ``port`` (5672, or 5671 for
    the ``amqps`` scheme, when absent). Entries without a host are skipped."""
    if not isinstance(value, list | tuple):
        return ()
    endpoints: list[tuple[str, int]] = []
    for entry in value:
        if not isinstance(entry, dict):
            continue
        fields = {str(key): item for key, item in entry.items()}
        host = fields.get("network-host") or fields.get("hostname")
        if not isinstance(host, str) or not host:
            continue
        default = 5671 if str(fields.get("scheme", "")).lower() == "amqps" else 5672
        port = fields.get("port", default)
        if isinstance(port, bool) or not isinstance(port, int | str) or not str(port).isdigit():
            continue
        endpoints.append((host.strip("[]"), int(port)))
    return tuple(endpoints)


def detects_duplicates(product: str) -> bool:
    """Whether a broker that names itself ``product`` has duplicate detection."""
    name = product.strip().lower()
    return any(name.startswith(known) for known in _DETECTS_DUPLICATES)
