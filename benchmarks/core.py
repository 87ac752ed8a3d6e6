"""Cost of the pure failover core on the send path.

Run: .venv/bin/python benchmarks/core.py [--sends N]

Per send, a session asks the failover state machine whether it may go ahead
(admit) and records the command in the confirmation window; every window's
worth of bytes the broker confirms and the window frees what it holds. This
measures that path per send, and the state machine's transition cost, and
prints them next to a bare deque append/popleft measured in the same run (the
least any buffer could cost). Target: under 5 microseconds per send, so the
core can never limit a client sending 30,000 messages a second.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Callable

from hafailover.core.failover import Connected, FailoverMachine, Lost, Restored
from hafailover.core.window import ConfirmationWindow
from hafailover.url import BrokerAddress

MESSAGE = 1024
WINDOW = 1024 * 1024
TARGET_US = 5.0


def best_of(repeats: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(repeats))


def bare_deque(sends: int) -> float:
    buffer: deque[tuple[int, int, bytes]] = deque()
    per_window = WINDOW // MESSAGE
    payload = b"x"
    start = time.perf_counter()
    for i in range(sends):
        buffer.append((i, MESSAGE, payload))
        if len(buffer) == per_window:
            while buffer:
                buffer.popleft()
    return (time.perf_counter() - start) / sends


def core_send_path(sends: int) -> float:
    machine = FailoverMachine(reconnect_enabled=True)
    machine.handle(Connected(BrokerAddress("stomp", "live", 61613)))
    window: ConfirmationWindow[bytes] = ConfirmationWindow(WINDOW)
    payload = b"x"
    admit = machine.admit
    has_room = window.has_room
    record = window.record
    start = time.perf_counter()
    for _ in range(sends):
        admit()
        if not has_room(MESSAGE):
            window.confirm(window.next_id - 1)
        record(payload, MESSAGE, resendable=True)
    return (time.perf_counter() - start) / sends


def failover_transitions(cycles: int) -> float:
    machine = FailoverMachine(reconnect_enabled=True)
    live = BrokerAddress("stomp", "live", 61613)
    machine.handle(Connected(live))
    lost = Lost("reset")
    back = Connected(live, resumed=True)
    restored = Restored()
    start = time.perf_counter()
    for _ in range(cycles):
        machine.handle(lost)
        machine.handle(back)
        machine.handle(restored)
    return (time.perf_counter() - start) / (3 * cycles)


def reattach_replay(sends: int) -> float:
    window: ConfirmationWindow[bytes] = ConfirmationWindow(WINDOW)
    for _ in range(WINDOW // MESSAGE):
        window.record(b"x", MESSAGE)
    start = time.perf_counter()
    for _ in range(sends // 1000):
        plan = window.reattach(last_received=window.last_confirmed)
        assert len(plan.replay) == WINDOW // MESSAGE
    return (time.perf_counter() - start) / (sends // 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sends", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    baseline = best_of(args.repeats, lambda: bare_deque(args.sends))
    send_path = best_of(args.repeats, lambda: core_send_path(args.sends))
    transition = best_of(args.repeats, lambda: failover_transitions(args.sends // 10))
    replay = best_of(args.repeats, lambda: reattach_replay(args.sends))
    figures = {
        "bare_deque_us_per_send": baseline * 1e6,
        "core_us_per_send": send_path * 1e6,
        "core_vs_bare_deque": send_path / baseline,
        "core_sends_per_second": 1 / send_path,
        "failover_transition_us": transition * 1e6,
        "reattach_plan_of_1024_commands_us": replay * 1e6,
        "target_us_per_send": TARGET_US,
        "meets_target": send_path * 1e6 < TARGET_US,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"bare deque append/popleft   {figures['bare_deque_us_per_send']:.3f} us/send")
    print(
        f"core send path              {figures['core_us_per_send']:.3f} us/send "
        f"({figures['core_vs_bare_deque']:.1f}x bare deque, "
        f"{figures['core_sends_per_second']:,.0f} sends/s)"
    )
    print(f"failover transition         {figures['failover_transition_us']:.3f} us")
    print(f"reattach plan, 1024 cmds    {figures['reattach_plan_of_1024_commands_us']:.1f} us")
    verdict = "meets" if figures["meets_target"] else "MISSES"
    print(f"target < {TARGET_US} us/send: {verdict}")


if __name__ == "__main__":
    main()
