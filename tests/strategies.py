"""Hypothesis strategies shared by the test suite."""

from __future__ import annotations

from hypothesis import strategies as st

from hafailover.url import BrokerAddress, FailoverMethod, FailoverPolicy

SCHEMES_BY_PROTOCOL = {"stomp": ("stomp", "stomp+ssl"), "amqp": ("amqp", "amqps")}

hostnames = st.one_of(
    st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,10}){0,3}", fullmatch=True),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
)
ports = st.integers(1, 65535)
credentials = st.text(min_size=1, max_size=12)


@st.composite
def broker_addresses(draw: st.DrawFn, protocol: str | None = None) -> BrokerAddress:
    protocol = protocol or draw(st.sampled_from(sorted(SCHEMES_BY_PROTOCOL)))
    scheme = draw(st.sampled_from(SCHEMES_BY_PROTOCOL[protocol]))
    user = draw(st.none() | credentials)
    password = draw(st.none() | credentials) if user is not None else None
    return BrokerAddress(scheme, draw(hostnames), draw(ports), user, password)


durations = st.one_of(
    st.integers(1, 10**7).map(lambda ms: ms / 1000.0),
    st.floats(0.0005, 10**4, allow_nan=False, allow_infinity=False),
)


@st.composite
def policies(draw: st.DrawFn) -> FailoverPolicy:
    protocol = draw(st.sampled_from(sorted(SCHEMES_BY_PROTOCOL)))
    brokers = draw(
        st.lists(
            broker_addresses(protocol),
            min_size=1,
            max_size=4,
            unique_by=lambda b: b.endpoint,
        )
    )
    method = draw(st.sampled_from(list(FailoverMethod)))
    retry_interval = draw(durations)
    heartbeat = draw(st.just(0.0) | durations)
    ttl = draw(st.none() | durations.map(lambda d: d + heartbeat))
    return FailoverPolicy(
        brokers=tuple(brokers),
        failover_method=method,
        reconnect_attempts=0
        if method is FailoverMethod.NOFAILOVER
        else draw(st.integers(-1, 1000)),
        initial_connect_attempts=draw(st.integers(1, 1000) | st.just(-1)),
        retry_interval=retry_interval,
        retry_interval_multiplier=draw(st.floats(1.0, 100.0)),
        max_retry_interval=retry_interval + draw(st.just(0.0) | durations),
        retry_jitter=draw(st.floats(0.0, 1.0)),
        confirmation_window_size=draw(st.just(-1) | st.integers(1, 2**40)),
        heartbeat=heartbeat,
        connection_ttl=ttl,
        call_timeout=draw(durations),
        call_failover_timeout=draw(st.none() | st.just(0.0) | durations),
        use_topology=draw(st.booleans()),
        duplicate_detection=draw(st.booleans()),
    )
