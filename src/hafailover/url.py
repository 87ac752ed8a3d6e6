"""Connection URLs: ``failover:(stomp://h1:61613,stomp://h2:61613)?retry_interval=100ms``.

This module owns the URL grammar and every connection option of DESIGN.md
section 3: it turns text into a validated, frozen ``FailoverPolicy`` and back
(``policy.unredacted()`` parses to an equal policy). ``str()`` of a policy or an address
hides passwords, so that no log line or error message can leak one; ``unredacted()`` is
for the code that hands the URL on. It never opens a socket.

Grammar::

    url      := failover | broker
    failover := "failover:(" broker ("," broker)* ")" ["?" options]
    broker   := scheme "://" [user [":" password] "@"] host [":" port] ["?" options]
    scheme   := "stomp" | "stomp+ssl" | "amqp" | "amqps"

Options of a single broker URL apply to the connection; inside a failover list
brokers take no options of their own (they go after the closing parenthesis),
so one policy governs the whole list. Option names follow Artemis and Qpid.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from typing import Any, Final
from urllib.parse import quote, unquote

import attrs

from hafailover._units import (
    DURATION_UNITS_TEXT,
    SIZE_UNITS_TEXT,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)
from hafailover.errors import InvalidURLError

__all__ = [
    "BrokerAddress",
    "FailoverMethod",
    "FailoverPolicy",
    "Protocol",
    "ServerListAction",
    "parse_url",
]


class Protocol(enum.Enum):
    STOMP = "stomp"
    AMQP = "amqp"


class FailoverMethod(enum.Enum):
    """How the next broker is chosen (the Qpid failover methods)."""

    ROUNDROBIN = "roundrobin"  # walk the list in order, starting with the current broker
    SINGLEBROKER = "singlebroker"  # retry only the broker we were connected to
    RANDOM = "random"  # a fresh random order for every pass over the list
    NOFAILOVER = "nofailover"  # never reconnect: a loss is final (DISCONNECT)
    # the first broker is preferred: reconnects start there, and a connection elsewhere
    # moves back to it once it answers (probed every failback_interval)
    PRIORITY = "priority"


class ServerListAction(enum.Enum):
    """What the failover list a broker announces does to the known brokers (Qpid JMS
    ``failover.amqpOpenServerListAction``)."""

    ADD = "add"  # the URL's brokers, then the announced ones
    REPLACE = "replace"  # the broker connected to, then the announced ones
    IGNORE = "ignore"  # announcements change nothing


# scheme -> (protocol, tls, default port)
_SCHEMES: Final[Mapping[str, tuple[Protocol, bool, int]]] = {
    "stomp": (Protocol.STOMP, False, 61613),
    "stomp+ssl": (Protocol.STOMP, True, 61614),
    "amqp": (Protocol.AMQP, False, 5672),
    "amqps": (Protocol.AMQP, True, 5671),
}


def _check_port(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 1 <= value <= 65535:
        raise InvalidURLError(f"port {value} is out of range", option="port", accepted=["1-65535"])


@attrs.frozen
class BrokerAddress:
    """One broker: where it is and how to log in."""

    scheme: str = attrs.field(validator=attrs.validators.in_(tuple(_SCHEMES)))
    host: str = attrs.field(validator=attrs.validators.min_len(1))
    port: int = attrs.field(validator=_check_port)
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)

    @property
    def protocol(self) -> Protocol:
        return _SCHEMES[self.scheme][0]

    @property
    def tls(self) -> bool:
        return _SCHEMES[self.scheme][1]

    @property
    def default_port(self) -> int:
        """The scheme's port, for an address named without one."""
        return _SCHEMES[self.scheme][2]

    @property
    def endpoint(self) -> tuple[str, int]:
        """The (host, port) pair, for comparing brokers regardless of credentials."""
        return (self.host, self.port)

    def __str__(self) -> str:
        return self.redacted()

    def redacted(self) -> str:
        """The address with the password hidden (``***``), for logs; also what str() gives."""
        return self._render(mask_password=True)

    def unredacted(self) -> str:
        """The whole address, password included: only to hand on, never to print."""
        return self._render(mask_password=False)

    def _render(self, *, mask_password: bool) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        userinfo = ""
        if self.user is not None:
            userinfo = quote(self.user, safe="")
            if self.password is not None:
                userinfo += ":" + ("***" if mask_password else quote(self.password, safe=""))
            userinfo += "@"
        return f"{self.scheme}://{userinfo}{host}:{self.port}"


# --- option specifications ----------------------------------------------------


@attrs.frozen
class _Option:
    name: str
    parse: Callable[[str], Any]
    render: Callable[[Any], str]
    accepted: tuple[str, ...]


def _parse_attempts(text: str) -> int:
    value = int(text.strip())
    if value < -1:
        raise ValueError(f"{value} is below -1")
    return value


def _parse_initial_attempts(text: str) -> int:
    value = _parse_attempts(text)
    if value == 0:
        raise ValueError("0 would never connect")
    return value


def _parse_float_range(low: float, high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text.strip())
        if not low <= value <= high:
            raise ValueError(f"{value} is outside {low:g}..{high:g}")
        return value

    return parse


def _parse_positive_duration(text: str) -> float:
    value = parse_duration(text)
    if value <= 0:
        raise ValueError("it must be more than zero")
    return value


def _parse_optional_duration(text: str) -> float | None:
    """A duration, or -1 for 'no limit' (returned as None)."""
    if text.strip() == "-1":
        return None
    return parse_duration(text)


def _render_optional_duration(value: float | None) -> str:
    return "-1" if value is None else format_duration(value)


def _parse_window(text: str) -> int:
    if text.strip() == "-1":
        return -1
    value = parse_size(text)
    if value <= 0:
        raise ValueError("it must be -1 (off) or a positive size")
    return value


def _render_window(value: int) -> str:
    return "-1" if value == -1 else format_size(value)


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean")


def _parse_dedup(text: str) -> int:
    """How many message ids each consumer remembers to drop duplicates; 0 is off."""
    value = int(text.strip())
    if value < 0:
        raise ValueError(f"{value} is negative")
    return value


def _parse_client_id(text: str) -> str | None:
    """The connection's client id (JMS): names its non-shared durable subscriptions and is
    the AMQP container id; empty for none."""
    value = text.strip()
    if not value:
        return None
    if len(value) > 200 or not all(c.isalnum() or c in "-_" for c in value):
        raise ValueError(f"{value!r} is not 1 to 200 letters, digits, '-' or '_'")
    return value


def _render_client_id(value: str | None) -> str:
    return value or ""


def _parse_max_redeliveries(text: str) -> int:
    """Redeliveries a consumer accepts before it rejects a message to the dead-letter
    address; -1 is no limit."""
    value = int(text.strip())
    if value < -1:
        raise ValueError(f"{value} is below -1")
    return value


def _parse_method(text: str) -> FailoverMethod:
    return FailoverMethod(text.strip().lower())


def _parse_file(text: str) -> str | None:
    """A file that must exist now (a certificate or key); empty for none."""
    path = text.strip()
    if not path:
        return None
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {path}")
    return path


def _render_file(value: str | None) -> str:
    return value or ""


def _parse_new_file(text: str) -> str | None:
    """A file the client writes (it may not exist yet, its directory must); empty for none."""
    path = text.strip()
    if not path:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"no such directory: {directory}")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory")
    return path


def _parse_server_list(text: str) -> ServerListAction:
    return ServerListAction(text.strip().lower())


_DURATION = tuple(DURATION_UNITS_TEXT)
_OPTIONS: Final[tuple[_Option, ...]] = (
    _Option(
        "failover_method",
        _parse_method,
        lambda v: v.value,
        tuple(m.value for m in FailoverMethod),
    ),
    _Option("reconnect_attempts", _parse_attempts, str, ("-1 (forever)", "0", "a positive count")),
    _Option(
        "initial_connect_attempts",
        _parse_initial_attempts,
        str,
        ("-1 (forever)", "a positive count"),
    ),
    _Option("retry_interval", _parse_positive_duration, format_duration, _DURATION),
    _Option(
        "retry_interval_multiplier",
        _parse_float_range(1.0, 100.0),
        repr,
        ("a number from 1.0 to 100.0",),
    ),
    _Option("max_retry_interval", _parse_positive_duration, format_duration, _DURATION),
    _Option("retry_jitter", _parse_float_range(0.0, 1.0), repr, ("a fraction from 0.0 to 1.0",)),
    _Option(
        "confirmation_window_size",
        _parse_window,
        _render_window,
        ("-1 (off)", *SIZE_UNITS_TEXT),
    ),
    _Option("heartbeat", parse_duration, format_duration, ("0 (off)", *_DURATION)),
    _Option(
        "connection_ttl",
        _parse_optional_duration,
        _render_optional_duration,
        ("-1 (never)", *_DURATION),
    ),
    _Option("call_timeout", _parse_positive_duration, format_duration, _DURATION),
    _Option(
        "call_failover_timeout",
        _parse_optional_duration,
        _render_optional_duration,
        ("-1 (wait as long as failover lasts)", *_DURATION),
    ),
    _Option("failback_interval", _parse_positive_duration, format_duration, _DURATION),
    _Option("use_topology", _parse_bool, lambda v: "true" if v else "false", _TRUE + _FALSE),
    _Option(
        "failover_server_list",
        _parse_server_list,
        lambda v: v.value,
        tuple(a.value for a in ServerListAction),
    ),
    _Option("duplicate_detection", _parse_bool, lambda v: "true" if v else "false", _TRUE + _FALSE),
    _Option("consumer_dedup", _parse_dedup, str, ("0 (off)", "a positive count of message ids")),
    _Option(
        "consumer_dedup_file",
        _parse_new_file,
        _render_file,
        ("the path of a file in an existing directory",),
    ),
    _Option(
        "block_on_acknowledge", _parse_bool, lambda v: "true" if v else "false", _TRUE + _FALSE
    ),
    _Option("client_id", _parse_client_id, _render_client_id, ("letters, digits, '-' and '_'",)),
    _Option(
        "max_redeliveries",
        _parse_max_redeliveries,
        str,
        ("-1 (no limit)", "0", "a positive count"),
    ),
    # TLS (stomp+ssl://, amqps://): the CA certificates that verify the broker (else the
    # system's), a client certificate and key for mutual TLS, and an explicit opt-out.
    _Option("ssl_ca_file", _parse_file, _render_file, ("the path of a PEM file",)),
    _Option("ssl_cert_file", _parse_file, _render_file, ("the path of a PEM file",)),
    _Option("ssl_key_file", _parse_file, _render_file, ("the path of a PEM file",)),
    _Option("ssl_verify", _parse_bool, lambda v: "true" if v else "false", _TRUE + _FALSE),
)
_OPTIONS_BY_NAME: Final[Mapping[str, _Option]] = {o.name: o for o in _OPTIONS}
# Artemis spells the heartbeat period "client_failure_check_period".
_ALIASES: Final[Mapping[str, str]] = {"client_failure_check_period": "heartbeat"}


def _brokers_validator(
    instance: object, attribute: attrs.Attribute[tuple[BrokerAddress, ...]], value: Any
) -> None:
    if not value:
        raise InvalidURLError(
            "the failover list names no broker", option="brokers", accepted=["stomp://host:port"]
        )
    protocols = {b.protocol for b in value}
    if len(protocols) > 1:
        raise InvalidURLError(
            "a failover list mixes protocols ("
            + ", ".join(sorted(p.value for p in protocols))
            + "); every broker must speak the same one",
            option="brokers",
            accepted=["all stomp:// and stomp+ssl://", "all amqp:// and amqps://"],
        )
    endpoints = [b.endpoint for b in value]
    for endpoint in endpoints:
        if endpoints.count(endpoint) > 1:
            raise InvalidURLError(
                f"broker {endpoint[0]}:{endpoint[1]} is listed twice",
                option="brokers",
                accepted=["each broker once"],
            )


def _as_brokers(value: Any) -> tuple[BrokerAddress, ...]:
    return tuple(value)


@attrs.frozen
class FailoverPolicy:
    """Everything a connection needs to know about its brokers and failover.

    Durations are in seconds. ``None`` for connection_ttl and
    call_failover_timeout means "no limit" (written -1 in a URL);
    confirmation_window_size -1 disables reattach.
    """

    brokers: tuple[BrokerAddress, ...] = attrs.field(
        converter=_as_brokers, validator=_brokers_validator
    )
    failover_method: FailoverMethod = FailoverMethod.ROUNDROBIN
    reconnect_attempts: int = -1
    initial_connect_attempts: int = 1
    retry_interval: float = 0.01
    retry_interval_multiplier: float = 1.2
    max_retry_interval: float = 2.0
    retry_jitter: float = 0.1
    confirmation_window_size: int = 1024 * 1024
    heartbeat: float = 1.0
    connection_ttl: float | None = 60.0
    call_timeout: float = 30.0
    call_failover_timeout: float | None = None
    failback_interval: float = 5.0
    use_topology: bool = True
    failover_server_list: ServerListAction = ServerListAction.ADD
    duplicate_detection: bool = True
    consumer_dedup: int = 0
    consumer_dedup_file: str | None = None
    block_on_acknowledge: bool = False
    client_id: str | None = None
    max_redeliveries: int = -1
    ssl_ca_file: str | None = None
    ssl_cert_file: str | None = None
    ssl_key_file: str | None = None
    ssl_verify: bool = True
    # The options the URL named, whatever their values (not part of equality): a policy
    # built in code names none.
    given: frozenset[str] = attrs.field(default=frozenset(), eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # Field-level checks ran as the URL was parsed; these span fields, and
        # also guard policies built in code rather than from text.
        for option in _OPTIONS:
            value = getattr(self, option.name)
            try:
                reparsed = option.parse(option.render(value))
            except (ValueError, TypeError, AttributeError):
                reparsed = _INVALID
            if reparsed != value:
                raise InvalidURLError(
                    f"{option.name}={value!r} is not a valid value",
                    option=option.name,
                    accepted=option.accepted,
                )
        if self.max_retry_interval < self.retry_interval:
            raise InvalidURLError(
                f"max_retry_interval={format_duration(self.max_retry_interval)} is shorter than "
                f"retry_interval={format_duration(self.retry_interval)}",
                option="max_retry_interval",
                accepted=[f">= {format_duration(self.retry_interval)}"],
            )
        ttl = self.connection_ttl
        if ttl is not None and self.heartbeat > 0 and ttl < self.heartbeat:
            raise InvalidURLError(
                f"connection_ttl={format_duration(ttl)} is shorter than "
                f"heartbeat={format_duration(self.heartbeat)}: the broker would drop "
                "sessions before a heartbeat could keep them",
                option="connection_ttl",
                accepted=[f">= {format_duration(self.heartbeat)}", "-1"],
            )
        given = [
            name
            for name in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file")
            if getattr(self, name) is not None
        ] + ([] if self.ssl_verify else ["ssl_verify"])
        if given and not any(b.tls for b in self.brokers):
            raise InvalidURLError(
                f"{given[0]} is for TLS brokers, and none of these is",
                option=given[0],
                accepted=["stomp+ssl://", "amqps://"],
            )
        if self.consumer_dedup_file is not None and self.consumer_dedup == 0:
            raise InvalidURLError(
                "consumer_dedup_file keeps the duplicate window, and consumer_dedup=0 has none",
                option="consumer_dedup",
                accepted=["a positive count of message ids with consumer_dedup_file"],
            )
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            missing = "ssl_key_file" if self.ssl_key_file is None else "ssl_cert_file"
            raise InvalidURLError(
                f"mutual TLS needs both ssl_cert_file and ssl_key_file; {missing} is missing",
                option=missing,
                accepted=["the path of a PEM file"],
            )

    @property
    def protocol(self) -> Protocol:
        return self.brokers[0].protocol

    @property
    def server_list_action(self) -> ServerListAction:
        """What an announced failover list does; use_topology=false ignores it."""
        return self.failover_server_list if self.use_topology else ServerListAction.IGNORE

    @property
    def reattach_enabled(self) -> bool:
        return self.confirmation_window_size != -1

    def first_connection_fails_over(self) -> FailoverPolicy:
        """F12 for a client whose first connection may come after the live has failed over
        (a Spark executor's worker, started at any time): unless the URL names
        initial_connect_attempts, the first connection walks the brokers as a reconnect
        does, for as many attempts."""
        if "initial_connect_attempts" in self.given:
            return self
        return attrs.evolve(self, initial_connect_attempts=self.reconnect_attempts or 1)

    @property
    def effective_reconnect_attempts(self) -> int:
        """Reconnect attempts after a loss; nofailover allows none."""
        if self.failover_method is FailoverMethod.NOFAILOVER:
            return 0
        return self.reconnect_attempts

    def options(self) -> dict[str, str]:
        """The options that differ from the defaults, as URL text."""
        rendered: dict[str, str] = {}
        for option in _OPTIONS:
            value = getattr(self, option.name)
            if value != _DEFAULTS[option.name]:
                rendered[option.name] = option.render(value)
        return rendered

    def __str__(self) -> str:
        return self.redacted()

    def redacted(self) -> str:
        """The URL with passwords hidden (``***``), for logs and reports; also what str()
        gives."""
        return self._render(mask_passwords=True)

    def unredacted(self) -> str:
        """The whole URL, passwords included, that parses to an equal policy: only to hand
        on, never to print."""
        return self._render(mask_passwords=False)

    def _render(self, *, mask_passwords: bool) -> str:
        query = "&".join(f"{k}={quote(v, safe='')}" for k, v in self.options().items())
        suffix = f"?{query}" if query else ""
        brokers = [b._render(mask_password=mask_passwords) for b in self.brokers]
        if len(brokers) == 1:
            return f"{brokers[0]}{suffix}"
        return "failover:(" + ",".join(brokers) + ")" + suffix

    def with_credentials(self, user: str | None, password: str | None) -> FailoverPolicy:
        """Fill in user and password for brokers whose URL gave none."""
        if user is None and password is None:
            return self
        return attrs.evolve(
            self,
            brokers=tuple(
                b if b.user is not None else attrs.evolve(b, user=user, password=password)
                for b in self.brokers
            ),
        )


_INVALID = object()
_DEFAULTS: Final[Mapping[str, Any]] = {
    f.name: f.default for f in attrs.fields(FailoverPolicy) if f.name != "brokers"
}


# --- parsing ------------------------------------------------------------------


def _split_host_port(text: str, scheme: str, url: str) -> tuple[str, int]:
    default_port = _SCHEMES[scheme][2]
    if text.startswith("["):
        end = text.find("]")
        if end == -1:
            raise InvalidURLError(
                f"{url!r}: unclosed '[' in an IPv6 host", option="host", accepted=["[::1]:61613"]
            )
        host, rest = text[1:end], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise InvalidURLError(
                f"{url!r}: unexpected text after the IPv6 host",
                option="host",
                accepted=["[::1]:61613"],
            )
        port_text = rest[1:] if rest else ""
    elif ":" in text:
        host, port_text = text.rsplit(":", 1)
        if ":" in host:
            # "fe80::1" would read as host "fe80:" and port 1: an IPv6 host needs brackets.
            raise InvalidURLError(
                f"{url!r}: an IPv6 host must be in brackets",
                option="host",
                accepted=["[::1]:61613"],
            )
    else:
        host, port_text = text, ""
    if not host:
        raise InvalidURLError(f"{url!r} names no host", option="host", accepted=["host:port"])
    if port_text == "":
        return host, default_port
    if not port_text.isdigit():
        raise InvalidURLError(
            f"{url!r}: port {port_text!r} is not a number", option="port", accepted=["1-65535"]
        )
    return host, int(port_text)


def _parse_broker(text: str) -> tuple[BrokerAddress, str]:
    """Parse one broker URL; return it and its raw query string."""
    url = text.strip()
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in _SCHEMES:
        raise InvalidURLError(
            f"{url!r} has an unknown scheme {scheme!r}",
            option="scheme",
            accepted=list(_SCHEMES),
        )
    rest, _, query = rest.partition("?")
    if "/" in rest:
        raise InvalidURLError(
            f"{url!r}: a broker URL takes no path",
            option="path",
            accepted=[f"{scheme}://host:port"],
        )
    user: str | None = None
    password: str | None = None
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        raw_user, has_password, raw_password = userinfo.partition(":")
        user = unquote(raw_user)
        password = unquote(raw_password) if has_password else None
    host, port = _split_host_port(rest, scheme, url)
    return BrokerAddress(scheme, host, port, user, password), query


def _parse_options(query: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if not query:
        return values
    for pair in query.split("&"):
        if not pair:
            continue
        raw_name, has_value, raw_value = pair.partition("=")
        name = unquote(raw_name).strip()
        name = _ALIASES.get(name, name)
        option = _OPTIONS_BY_NAME.get(name)
        if option is None:
            raise InvalidURLError(
                f"unknown option {unquote(raw_name)!r}",
                option=unquote(raw_name),
                accepted=sorted([*_OPTIONS_BY_NAME, *_ALIASES]),
            )
        if name in values:
            raise InvalidURLError(
                f"option {name!r} is given twice", option=name, accepted=["each option once"]
            )
        text = unquote(raw_value)
        if not has_value or not text.strip():
            raise InvalidURLError(
                f"option {name!r} has no value", option=name, accepted=option.accepted
            )
        try:
            values[name] = option.parse(text)
        except ValueError as exc:
            raise InvalidURLError(
                f"bad value for {name}: {text!r} ({exc})", option=name, accepted=option.accepted
            ) from None
    return values


def parse_url(url: str) -> FailoverPolicy:
    """Parse a single-broker or ``failover:(...)`` URL into a policy.

    Raises :class:`~hafailover.errors.InvalidURLError` (a ``ValueError``) that
    names the option or URL part at fault and what would be accepted.
    """
    if not isinstance(url, str):
        raise InvalidURLError(
            f"a URL must be a string, not {type(url).__name__}", option="url", accepted=["str"]
        )
    text = url.strip()
    if text.lower().startswith("failover:"):
        body = text[len("failover:") :]
        if not body.startswith("("):
            raise InvalidURLError(
                f"{url!r}: the broker list must be in parentheses",
                option="brokers",
                accepted=["failover:(stomp://h1:61613,stomp://h2:61613)"],
            )
        close = body.find(")")
        if close == -1:
            raise InvalidURLError(
                f"{url!r}: the broker list is not closed with ')'",
                option="brokers",
                accepted=["failover:(stomp://h1:61613,stomp://h2:61613)"],
            )
        inner, after = body[1:close], body[close + 1 :]
        if after and not after.startswith("?"):
            raise InvalidURLError(
                f"{url!r}: unexpected text {after!r} after the broker list",
                option="brokers",
                accepted=["?option=value&..."],
            )
        brokers = []
        for part in inner.split(","):
            if not part.strip():
                continue
            broker, broker_query = _parse_broker(part)
            if broker_query:
                raise InvalidURLError(
                    f"broker {broker.redacted()} carries options inside the failover list; "
                    "put them after the closing parenthesis",
                    option=broker_query.partition("=")[0],
                    accepted=["failover:(...)?option=value"],
                )
            brokers.append(broker)
        options = _parse_options(after[1:])
    else:
        broker, query = _parse_broker(text)
        brokers = [broker]
        options = _parse_options(query)
    method = options.get("failover_method")
    if method is FailoverMethod.NOFAILOVER and options.get("reconnect_attempts", 0) != 0:
        raise InvalidURLError(
            f"failover_method=nofailover contradicts "
            f"reconnect_attempts={options['reconnect_attempts']}",
            option="reconnect_attempts",
            accepted=["0 with nofailover", "another failover_method"],
        )
    action = options.get("failover_server_list")
    if options.get("use_topology") is False and action not in (None, ServerListAction.IGNORE):
        raise InvalidURLError(
            f"use_topology=false contradicts failover_server_list={action.value}",
            option="failover_server_list",
            accepted=["ignore with use_topology=false", "use_topology=true"],
        )
    return FailoverPolicy(brokers=tuple(brokers), given=frozenset(options), **options)
