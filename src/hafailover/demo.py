"""A walk through the failover core, with no network: ``hafailover demo --walkthrough``.

(`make demo` runs the live demo instead: ``reference_broker/demo.py``.)

It drives the real pure core (URL, reconnect schedule, failover state machine,
confirmation window, transaction rules) through a scripted broker loss and
prints what each part decided. No network is involved: the "server" is the
last command id the script says was received.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hafailover.core.failover import Connected, FailoverMachine, Lost
from hafailover.core.report import FailoverReport, SessionFailover
from hafailover.core.schedule import ReconnectSchedule
from hafailover.core.window import ConfirmationWindow
from hafailover.errors import ErrorCode
from hafailover.tx import TransactionState
from hafailover.url import BrokerAddress, parse_url

DEMO_URL = (
    "failover:(stomp://app:secret@127.0.0.1:61613,stomp://app:secret@127.0.0.1:61614)"
    "?max_retry_interval=1s&confirmation_window_size=64KiB"
)


def run(out: Callable[[str], None] = print) -> FailoverReport:
    policy = parse_url(DEMO_URL)
    out(f"policy        {policy.redacted()}")
    schedule = ReconnectSchedule(policy, rng=random.Random(7))
    plan = schedule.plan(initial=False, limit=4)
    out(
        "reconnect     "
        + ", ".join(f"#{a.number} {a.broker.port} after {a.delay * 1000:.0f}ms" for a in plan)
    )

    machine = FailoverMachine(reconnect_enabled=policy.effective_reconnect_attempts != 0)
    live, backup = policy.brokers
    machine.handle(Connected(live))
    window: ConfirmationWindow[str] = ConfirmationWindow(policy.confirmation_window_size)

    # 600 sends of 1 KiB; the broker confirms every window's worth of bytes.
    confirmed_upto = -1
    received = -1
    for seq in range(600):
        while not window.has_room(1024):
            confirmed_upto = received
            window.confirm(confirmed_upto)
        window.record(f"seq={seq}", 1024, resendable=True)
        received = seq
    received = 590  # the last ten never reached the broker before it died
    out(
        f"traffic       600 sends, broker confirmed up to #{confirmed_upto}, "
        f"{len(window)} commands ({window.buffered_bytes} bytes) held for replay"
    )

    effects = machine.handle(Lost("connection reset by peer"))
    out(f"lost          {machine.state.value}: " + ", ".join(type(e).__name__ for e in effects))

    # Case 1: the same server comes back and still holds the session: reattach.
    reattach = window.reattach(last_received=received)
    effects = machine.handle(Connected(live, resumed=True))
    out(
        f"reattach      server had #{received}; replay {len(reattach.replay)} commands "
        f"(#{reattach.replay[0].command_id}..#{reattach.replay[-1].command_id}); "
        + ", ".join(type(e).__name__ for e in effects)
    )

    # Case 2: the live is gone for good; the backup has a fresh session: reconnect.
    tx = TransactionState()
    for _ in range(3):
        tx.work()
    machine.handle(Lost("live killed"))
    reconnect = window.reconnect()
    effects = machine.handle(Connected(backup))
    doomed = tx.failover(reattached=False, lost_work=False)
    decision = tx.begin_commit()
    outcome = decision.code.value if decision.code is not None else decision.action.value
    out(
        f"reconnect     to {backup.port}: resend {len(reconnect.resend)} duplicate-id sends, "
        f"{len(reconnect.in_doubt)} in doubt; transaction "
        f"{'rollback-only' if doomed else 'intact'}; commit() -> {outcome}"
    )
    tx.work()
    out(f"retry         the application replays: commit() -> {tx.begin_commit().action.value}")

    report = FailoverReport(
        code=ErrorCode.FAILOVER,
        reason="live killed",
        from_broker=_short(live),
        to_broker=_short(backup),
        reattached=False,
        attempts=2,
        sessions=(
            SessionFailover(
                1,
                resent=tuple(c.payload for c in reconnect.resend),
                in_doubt=tuple(c.payload for c in reconnect.in_doubt),
                rolled_back=doomed,
            ),
        ),
    )
    out(f"report        {report.summary()}")
    return report


def _short(broker: BrokerAddress) -> str:
    return f"{broker.host}:{broker.port}"
