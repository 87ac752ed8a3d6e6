"""The broker's SASL layer as a pure machine: every state and input, any split, any bytes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proton import Data, Described, symbol

from reference_broker.amqp.sasl import (
    AMQP_HEADER,
    SASL_HEADER,
    SASL_INIT,
    AmqpHeaderReceived,
    PlainCredentialsError,
    SaslCode,
    SaslInitReceived,
    SaslProtocolError,
    SaslServer,
    SaslState,
    SaslUsageError,
    encode_sasl_frame,
    parse_plain,
)

pytestmark = pytest.mark.timeout(60)

INIT = encode_sasl_frame(SASL_INIT, [symbol("PLAIN"), b"\0admin\0secret", "localhost"])
MECHANISMS_FROM_CLIENT = encode_sasl_frame(0x40, [[symbol("PLAIN")]])


def _frames(data: bytes) -> list[Any]:
    """Decode the SASL frames the server wrote (after its header, if any)."""
    if data.startswith(SASL_HEADER):
        data = data[len(SASL_HEADER) :]
    out = []
    while data:
        size = int.from_bytes(data[:4], "big")
        body = Data()
        body.decode(data[8:size])
        body.rewind()
        body.next()
        value = body.get_object()
        assert isinstance(value, Described)
        out.append(value)  # typed Any: a test reads the fields it knows are there
        data = data[size:]
    return out


def _machine_in(state: SaslState) -> SaslServer:
    machine = SaslServer(["PLAIN"])
    if state is SaslState.AWAIT_HEADER:
        return machine
    if state is SaslState.DONE:
        machine.receive(AMQP_HEADER)
        return machine
    machine.receive(SASL_HEADER)
    if state is SaslState.AWAIT_INIT:
        return machine
    machine.receive(INIT)
    if state is SaslState.AWAIT_VERDICT:
        return machine
    assert state is SaslState.FAILED
    machine.refuse()
    return machine


def test_a_plain_exchange() -> None:
    machine = SaslServer(["PLAIN", "ANONYMOUS"])
    assert machine.receive(SASL_HEADER) == []
    sent = machine.data_to_send()
    assert sent.startswith(SASL_HEADER)
    (mechanisms,) = _frames(sent)
    assert mechanisms.descriptor == 0x40
    assert list(mechanisms.value[0]) == ["PLAIN", "ANONYMOUS"]
    events = machine.receive(INIT + AMQP_HEADER + b"open")
    assert events == [SaslInitReceived("PLAIN", b"\0admin\0secret", "localhost")]
    assert machine.state is SaslState.AWAIT_VERDICT
    assert machine.accept() == AMQP_HEADER + b"open"
    (outcome,) = _frames(machine.data_to_send())
    assert outcome.descriptor == 0x44
    assert outcome.value[0] == SaslCode.OK
    assert machine.state is SaslState.DONE  # type: ignore[comparison-overlap] # narrowed above


def test_refusal_sends_the_code() -> None:
    machine = _machine_in(SaslState.AWAIT_VERDICT)
    machine.data_to_send()
    machine.refuse(SaslCode.AUTH)
    (outcome,) = _frames(machine.data_to_send())
    assert outcome.value[0] == SaslCode.AUTH
    assert machine.state is SaslState.FAILED
    with pytest.raises(SaslUsageError):
        machine.refuse(SaslCode.OK)


def test_a_client_that_skips_sasl_is_reported_with_its_bytes() -> None:
    machine = SaslServer(["PLAIN"])
    assert machine.receive(AMQP_HEADER[:3]) == []
    events = machine.receive(AMQP_HEADER[3:] + b"rest")
    assert events == [AmqpHeaderReceived(AMQP_HEADER + b"rest")]
    assert machine.state is SaslState.DONE
    assert machine.data_to_send() == b""


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\n",
        b"AMQP\x01\x01\x00\x00",  # TLS header: not offered
        b"AMQP\x03\x02\x00\x00",  # an unknown version
    ],
)
def test_a_foreign_header_gets_ours_and_an_error(data: bytes) -> None:
    machine = SaslServer(["PLAIN"])
    with pytest.raises(SaslProtocolError):
        machine.receive(data)
    assert machine.data_to_send() == SASL_HEADER
    assert machine.state is SaslState.FAILED


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (MECHANISMS_FROM_CLIENT, "expected sasl-init"),
        (b"\x00\x00\x00\x08\x02\x01\x00\x00", "empty SASL frame"),
        (b"\x00\x00\x00\x0c\x02\x00\x00\x00\x00\x53\x41\x45", "frame type 0"),
        (b"\x00\x00\x00\x06\x02\x01\x00\x00", "bad frame header"),
        (b"\x00\x00\x00\x0c\x01\x01\x00\x00\x00\x53\x41\x45", "bad frame header"),
        (b"\x7f\x00\x00\x00\x02\x01\x00\x00", "over"),
        (b"\x00\x00\x00\x0b\x02\x01\x00\x00\x00\x53\x41", "undecodable"),
        (encode_sasl_frame(SASL_INIT, []), "needs a mechanism"),
        (encode_sasl_frame(SASL_INIT, [symbol("PLAIN"), "text"]), "must be binary"),
        (encode_sasl_frame(SASL_INIT, [symbol("PLAIN"), None, 7]), "hostname"),
    ],
)
def test_a_bad_frame_gets_sys_perm(frame: bytes, why: str) -> None:
    machine = _machine_in(SaslState.AWAIT_INIT)
    machine.data_to_send()
    with pytest.raises(SaslProtocolError, match=why):
        machine.receive(frame)
    (outcome,) = _frames(machine.data_to_send())
    assert outcome.value[0] == SaslCode.SYS_PERM
    # Sticky: the same error again, nothing more to send.
    with pytest.raises(SaslProtocolError, match=why):
        machine.receive(b"")
    assert machine.data_to_send() == b""


# Every state x every input: legal, a clean peer error (FAILED, sticky), or a usage error
# that leaves the state alone.
PEER_INPUTS = {
    "sasl-header": SASL_HEADER,
    "amqp-header": AMQP_HEADER,
    "init": INIT,
    "mechanisms": MECHANISMS_FROM_CLIENT,
    "junk": b"\x00\x01\x02\x03\x04\x05\x06\x07\x08",
}
LEGAL = {
    (SaslState.AWAIT_HEADER, "sasl-header"): SaslState.AWAIT_INIT,
    (SaslState.AWAIT_HEADER, "amqp-header"): SaslState.DONE,
    (SaslState.AWAIT_INIT, "init"): SaslState.AWAIT_VERDICT,
    (SaslState.AWAIT_VERDICT, "accept"): SaslState.DONE,
    (SaslState.AWAIT_VERDICT, "refuse"): SaslState.FAILED,
    # After sasl-init the bytes belong to the AMQP layer: kept, not parsed.
    **{(SaslState.AWAIT_VERDICT, name): SaslState.AWAIT_VERDICT for name in PEER_INPUTS},
}


@pytest.mark.parametrize("state", list(SaslState))
@pytest.mark.parametrize("name", [*PEER_INPUTS, "accept", "refuse"])
def test_every_state_and_input(state: SaslState, name: str) -> None:
    machine = _machine_in(state)
    machine.data_to_send()

    def step() -> None:
        if name == "accept":
            machine.accept()
        elif name == "refuse":
            machine.refuse()
        else:
            machine.receive(PEER_INPUTS[name])

    expected = LEGAL.get((state, name))
    if expected is not None:
        step()
        assert machine.state is expected
    elif name in ("accept", "refuse") or state in (SaslState.DONE, SaslState.FAILED):
        with pytest.raises(SaslUsageError):
            step()
        assert machine.state is state
    else:
        with pytest.raises(SaslProtocolError):
            step()
        assert machine.state is SaslState.FAILED
        with pytest.raises(SaslProtocolError):
            machine.receive(b"")


@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_split_gives_the_same_exchange(cuts: list[int]) -> None:
    stream = SASL_HEADER + INIT + AMQP_HEADER + b"frames"
    points = sorted({c % (len(stream) + 1) for c in cuts})
    machine = SaslServer(["PLAIN"])
    events = []
    start = 0
    for point in [*points, len(stream)]:
        events += machine.receive(stream[start:point])
        start = point
    assert events == [SaslInitReceived("PLAIN", b"\0admin\0secret", "localhost")]
    assert machine.accept() == AMQP_HEADER + b"frames"


@settings(max_examples=300)
@given(
    prefix=st.sampled_from([b"", SASL_HEADER, AMQP_HEADER]),
    data=st.lists(st.binary(max_size=64), max_size=6),
)
def test_any_bytes_give_events_or_a_clean_error(prefix: bytes, data: list[bytes]) -> None:
    machine = SaslServer(["PLAIN"])
    error: SaslProtocolError | None = None
    try:
        for chunk in [prefix, *data]:
            if machine.state is SaslState.DONE:
                break
            for event in machine.receive(chunk):
                assert isinstance(event, SaslInitReceived | AmqpHeaderReceived)
    except SaslProtocolError as exc:
        error = exc
    if error is None:
        return
    assert machine.state is SaslState.FAILED
    with pytest.raises(SaslProtocolError) as again:
        machine.receive(b"x")
    assert again.value is error
    sent = machine.data_to_send()
    # What a failed exchange says before the close: our header and/or an outcome.
    assert sent == SASL_HEADER or _frames(sent)[-1].descriptor == 0x44


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (b"\0admin\0secret", ("", "admin", "secret")),
        (b"admin\0admin\0p\xc3\xa4ss", ("admin", "admin", "päss")),
        (b"\0admin\0", ("", "admin", "")),
    ],
)
def test_parse_plain(response: bytes, expected: tuple[str, str, str]) -> None:
    assert parse_plain(response) == expected


@pytest.mark.parametrize(
    "response", [None, b"admin", b"\0admin", b"\0\0secret", b"\0a\0b\0c", b"\0\xff\0x"]
)
def test_parse_plain_refuses_malformed_responses(response: bytes | None) -> None:
    with pytest.raises(PlainCredentialsError):
        parse_plain(response)
