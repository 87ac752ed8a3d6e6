"""Tests of the pair's fencing rule: activation claims, leases, the activation sequence.

Unit tests drive a fake clock, and `Steps` to stop an operation between two of its file-system
actions. The property test interleaves, one atomic action at a time, the operations of three
processes (two of them incarnations of one node id) and checks that no two ever may serve at
one instant. The process tests use real processes, real CLOCK_MONOTONIC and real SIGSTOP/SIGCONT.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from reference_broker.witness import (
    MARKER_NAME,
    Decision,
    Host,
    Lease,
    Outcome,
    Steps,
    Timing,
    Witness,
    WitnessClockError,
    WitnessCorruptError,
    WitnessMissingError,
    WitnessUsageError,
)

pytestmark = pytest.mark.timeout(180)  # the process tests set their own bounds

REPO = Path(__file__).resolve().parents[2]
HOST = Host(boot_id="boot-1", clock_offset="0 0", pid_ns=4026531836)
TIMING = Timing(lease=3.0, margin=0.5, grace=0.5)
ADDRS = {"a": ("stomp://127.0.0.1:61001",), "b": ("stomp://127.0.0.1:61002",)}
T0 = 1000.0


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def node(directory: Path, clock: FakeClock, timing: Timing = TIMING, host: Host = HOST) -> Witness:
    return Witness(directory, timing, clock=clock, host=host, durable=False)


def activated(decision: Decision) -> Lease:
    assert decision.outcome is Outcome.ACTIVATED, decision.reason
    assert decision.lease is not None
    return decision.lease


def renewed(decision: Decision) -> Lease:
    assert decision.outcome is Outcome.RENEWED, decision.reason
    assert decision.lease is not None
    return decision.lease


def step_until(steps: Steps, prefix: str) -> None:
    """Run an operation up to and including the first action whose description starts so."""
    while True:
        done = steps.step()
        assert done is not None, f"the operation ended before {prefix!r}"
        if done.startswith(prefix):
            return


def rewrite(path: Path, **changes: object) -> None:
    """Change fields of a claim or lease file and re-seal it, as a buggy writer would."""
    body = json.loads(path.read_bytes())
    body.update(changes)
    body.pop("crc32")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["crc32"] = zlib.crc32(canonical)
    path.write_text(json.dumps(body))


def files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# --- activation, renewal, expiry ----------------------------------------------------------------


def test_first_start_claims_activation_1_and_marks_the_pair(
    tmp_path: Path, clock: FakeClock
) -> None:
    a = node(tmp_path, clock)
    assert a.read() is None
    lease = activated(a.try_activate("a", ADDRS["a"]))
    assert (lease.node_id, lease.activation, lease.renewed_at) == ("a", 1, T0)
    assert lease.not_before == -math.inf
    assert lease.may_serve(T0)
    state = a.read()
    assert state is not None
    assert (state.activation, state.holder, state.addresses) == (1, "a", ADDRS["a"])
    assert (state.renewed_at, state.lease, state.holder_pid) == (T0, 3.0, os.getpid())
    assert (state.kind, state.released, state.not_before) == ("first_start", False, None)
    # The claim, the holder's lease, the marker, and no temporary file left behind.
    assert files(tmp_path) == ["activation-1.json", "lease-1.json", MARKER_NAME]
    claim = json.loads(a.activation_path(1).read_bytes())
    assert claim["holder"] == "a"
    assert claim["granted_at"] == T0
    assert claim["holder_pid"] == os.getpid()
    assert (claim["boot_id"], claim["clock_offset"], claim["pid_ns"]) == attrs.astuple(HOST)


def test_durable_writes_with_the_real_clock_and_host(tmp_path: Path) -> None:
    w = Witness(tmp_path, TIMING)  # real clock, real host, fsync on
    lease = activated(w.try_activate("a", ADDRS["a"]))
    assert lease.may_serve(time.monotonic())
    renewed(w.renew("a", 1))
    state = w.read()
    assert state is not None
    assert state.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_live_serves_from_not_before_until_lease_minus_margin(
    tmp_path: Path, clock: FakeClock
) -> None:
    lease = activated(node(tmp_path, clock).try_activate("a", ADDRS["a"]))
    assert lease.serve_until == T0 + 3.0 - 0.5
    assert lease.may_serve(T0 + 2.49)
    assert not lease.may_serve(T0 + 2.5)
    assert not lease.renew_due(T0 + 0.99)
    assert lease.renew_due(T0 + 1.0)
    later = attrs.evolve(lease, not_before=T0 + 1.0)
    assert not later.may_serve(T0 + 0.99)
    assert later.may_serve(T0 + 1.0)


def test_backup_activates_only_after_expiry_plus_grace(tmp_path: Path, clock: FakeClock) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(3.5)
    for t in (T0, T0 + 2.5, T0 + 3.0, T0 + 3.5):  # 3.5 = expiry + grace: not yet past it
        held = b.try_activate("b", ADDRS["b"], now=t)
        assert held.outcome is Outcome.HELD, t
        assert held.retry_at == T0 + 3.5
        assert held.lease is None
    clock.advance(1e-6)
    decision = b.try_activate("b", ADDRS["b"])
    lease = activated(decision)
    assert lease.activation == 2
    assert lease.not_before == -math.inf  # nothing raced: serve at once
    assert "a's lease ended" in decision.reason
    state = b.read()
    assert state is not None
    assert (state.holder, state.activation, state.addresses) == ("b", 2, ADDRS["b"])
    assert state.kind == "takeover"


def test_renewal_pushes_the_backup_back(tmp_path: Path, clock: FakeClock) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(1.0)
    assert renewed(a.renew("a", 1)).renewed_at == T0 + 1.0
    clock.advance(2.6)  # past the first lease's expiry + grace, not the renewed one's
    assert b.try_activate("b", ADDRS["b"]).outcome is Outcome.HELD
    clock.advance(1.0)
    activated(b.try_activate("b", ADDRS["b"]))


def test_renew_after_takeover_is_fenced_and_writes_nothing(
    tmp_path: Path, clock: FakeClock
) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    old = activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(10.0)  # a was paused well past its lease
    assert not old.may_serve(clock.t)  # so its first check on resume fails ...
    activated(b.try_activate("b", ADDRS["b"]))
    before = a.lease_path(1).read_bytes()
    fenced = a.renew("a", 1)  # ... and its renewal finds the higher activation
    assert fenced.outcome is Outcome.FENCED
    assert fenced.lease is None
    assert "superseded" in fenced.reason
    assert a.lease_path(1).read_bytes() == before  # seen before writing: nothing written
    state = a.read()
    assert state is not None
    assert (state.holder, state.activation) == ("b", 2)


def test_renew_after_expiry_without_takeover_resumes(tmp_path: Path, clock: FakeClock) -> None:
    a = node(tmp_path, clock)
    old = activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(10.0)
    assert not old.may_serve(clock.t)
    assert renewed(a.renew("a", 1)).may_serve(clock.t)  # nobody took over


def test_renew_with_a_stale_reading_never_moves_the_lease_back(
    tmp_path: Path, clock: FakeClock
) -> None:
    a = node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(2.0)
    assert renewed(a.renew("a", 1, now=T0 + 1.0)).renewed_at == T0 + 1.0
    assert renewed(a.renew("a", 1, now=T0 + 0.5)).renewed_at == T0 + 1.0  # older than recorded


def test_a_node_cannot_reactivate_over_its_own_unexpired_lease(
    tmp_path: Path, clock: FakeClock
) -> None:
    # The same node id may be a paused earlier incarnation still holding the lease.
    activated(node(tmp_path, clock).try_activate("a", ADDRS["a"]))
    restarted = node(tmp_path, clock)
    clock.advance(1.0)
    assert restarted.try_activate("a", ADDRS["a"], now=T0 + 1).outcome is Outcome.HELD


def test_a_renewal_needs_the_same_activation(tmp_path: Path, clock: FakeClock) -> None:
    # a (activation 1) pauses; b takes over (2) and hands back to a restarted a (3); the
    # paused a resumes with activation 1 and must not pass for the holder.
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(4.0)
    activated(b.try_activate("b", ADDRS["b"]))
    assert b.hand_over("b", 2, "a", ADDRS["a"]).outcome is Outcome.HANDED_OVER
    assert a.renew("a", 1).outcome is Outcome.FENCED
    assert a.renew("a", 2).outcome is Outcome.FENCED  # b's activation is not a's
    renewed(a.renew("a", 3))


def test_a_lost_claim_race_is_held(tmp_path: Path, clock: FakeClock) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    first, second = a.try_activate_steps("a", ADDRS["a"]), b.try_activate_steps("b", ADDRS["b"])
    step_until(first, "listed")
    step_until(second, "listed")  # both saw an empty directory: a first start for both
    assert first.run().outcome is Outcome.ACTIVATED
    lost = second.run()
    assert lost.outcome is Outcome.HELD
    assert "claimed by another node first" in lost.reason
    assert not b.lease_path(2).exists()


# --- the races a lock used to exclude ----------------------------------------------------------


def test_a_renewal_that_races_the_takeover_delays_the_new_holder(
    tmp_path: Path, clock: FakeClock
) -> None:
    """The old holder renews between the new one's read and its claim: the re-read sees it."""
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(3.6)  # a was stopped past its lease + grace ...
    takeover = b.try_activate_steps("b", ADDRS["b"])
    step_until(takeover, "read lease-1")  # b decided on the expired lease
    clock.advance(0.1)
    old = renewed(a.renew("a", 1))  # ... and resumed: its renewal passes, there is no claim 2
    assert old.may_serve(clock.t)
    decision = takeover.run()
    new = activated(decision)
    assert new.not_before == old.renewed_at + old.duration + TIMING.grace
    assert new.not_before > old.serve_until
    assert not new.may_serve(old.serve_until - 1e-9)
    assert "raced" in decision.reason
    assert a.renew("a", 1).outcome is Outcome.FENCED  # its next renewal sees claim 2
    # The new holder's renewals keep the start: they read it from its lease file.
    clock.advance(1.0)
    assert renewed(b.renew("b", 2)).not_before == new.not_before
    state = b.read()
    assert state is not None
    assert state.not_before == new.not_before


@pytest.mark.parametrize("stop_after", ["read activation-1", "read lease-1", "looked for claims"])
def test_a_holder_stopped_before_writing_its_renewal_is_fenced(
    tmp_path: Path, clock: FakeClock, stop_after: str
) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(0.9)
    renewal = a.renew_steps("a", 1)  # step 1: t = T0 + 0.9
    step_until(renewal, stop_after)
    clock.advance(10.0)
    lease = activated(b.try_activate("b", ADDRS["b"]))
    assert lease.not_before == -math.inf
    assert renewal.run().outcome is Outcome.FENCED


def test_a_holder_stopped_between_writing_and_checking_is_fenced(
    tmp_path: Path, clock: FakeClock
) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(0.9)
    renewal = a.renew_steps("a", 1)
    step_until(renewal, "wrote lease-1")  # step 2 done, step 3 not yet
    clock.advance(3.5)
    assert b.try_activate("b", ADDRS["b"]).outcome is Outcome.HELD  # the write counts
    clock.advance(1e-6)
    assert activated(b.try_activate("b", ADDRS["b"])).not_before == -math.inf
    decision = renewal.run()
    assert decision.outcome is Outcome.FENCED
    assert decision.lease is None


def test_a_claimer_stopped_before_its_lease_never_serves_and_is_waited_for(
    tmp_path: Path, clock: FakeClock
) -> None:
    """b claims 2 and stops before its lease; a renewal of 1 had raced b's read. Another node
    must wait for both b's grant and that renewal, and b, once resumed, must not serve."""
    a, b, c = node(tmp_path, clock), node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(3.6)
    takeover = b.try_activate_steps("b", ADDRS["b"])  # granted_at = T0 + 3.6
    step_until(takeover, "read lease-1")
    clock.advance(0.4)
    old = renewed(a.renew("a", 1))  # renewed_at = T0 + 4.0, serves until T0 + 6.5
    step_until(takeover, "claimed activation-2")  # b stops here
    assert a.renew("a", 1).outcome is Outcome.FENCED
    clock.t = T0 + 3.6 + 3.5  # b's grant + lease + grace is over: claim 2 counts as expired
    clock.advance(1e-6)
    lease = activated(c.try_activate("c", ["stomp://c"]))
    assert lease.activation == 3
    assert lease.not_before == old.renewed_at + old.duration + TIMING.grace  # from lease-1
    assert lease.not_before > old.serve_until
    resumed = takeover.run()  # b writes its lease, then sees claim 3
    assert resumed.outcome is Outcome.HELD
    assert "superseded" in resumed.reason
    assert resumed.lease is None


def test_not_before_is_carried_through_a_hand_over_and_a_release(
    tmp_path: Path, clock: FakeClock
) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(3.6)
    takeover = b.try_activate_steps("b", ADDRS["b"])
    step_until(takeover, "read lease-1")
    old = renewed(a.renew("a", 1))
    start = activated(takeover.run()).not_before
    assert start == old.renewed_at + 3.5
    # b hands over at once, before its own start: a (restarted) must still wait for it.
    handed = b.hand_over("b", 2, "a", ADDRS["a"])
    assert handed.state is not None
    assert handed.state.not_before == start
    assert renewed(a.renew("a", 3)).not_before == start
    assert a.release("a", 3).outcome is Outcome.RELEASED
    assert activated(b.try_activate("b", ADDRS["b"])).not_before == start


# --- hand-over, release, reset ------------------------------------------------------------------


def test_hand_over_moves_the_role_and_bumps_the_sequence(tmp_path: Path, clock: FakeClock) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(b.try_activate("b", ADDRS["b"]))
    handed = b.hand_over("b", 1, "a", ADDRS["a"])
    assert handed.outcome is Outcome.HANDED_OVER
    assert handed.lease is None
    assert handed.state is not None
    assert (handed.state.holder, handed.state.activation) == ("a", 2)
    assert handed.state.addresses == ADDRS["a"]
    assert handed.state.holder_pid is None  # unknown until a renews
    assert handed.state.kind == "hand_over"
    assert not a.lease_path(2).exists()
    assert b.renew("b", 1).outcome is Outcome.FENCED
    assert b.try_activate("b", ADDRS["b"]).outcome is Outcome.HELD
    lease = renewed(a.renew("a", 2))
    assert lease.may_serve(clock.t)  # the giver stopped on its own: no wait
    assert b.hand_over("b", 1, "a", ADDRS["a"]).outcome is Outcome.FENCED
    with pytest.raises(WitnessUsageError, match="itself"):
        a.hand_over("a", 2, "a", ADDRS["a"])


def test_an_unclaimed_hand_over_runs_out(tmp_path: Path, clock: FakeClock) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(b.try_activate("b", ADDRS["b"]))
    b.hand_over("b", 1, "a", ADDRS["a"])
    clock.advance(3.5)
    assert b.try_activate("b", ADDRS["b"]).outcome is Outcome.HELD
    clock.advance(1e-6)
    assert activated(b.try_activate("b", ADDRS["b"])).activation == 3
    assert a.renew("a", 2).outcome is Outcome.FENCED


def test_release_lets_the_other_node_activate_at_once(tmp_path: Path, clock: FakeClock) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    released = a.release("a", 1)
    assert released.outcome is Outcome.RELEASED
    assert released.state is not None
    assert (released.state.holder, released.state.activation) == (None, 1)
    assert released.state.addresses == ()
    assert released.state.released
    assert a.release("a", 1).outcome is Outcome.FENCED
    assert a.renew("a", 1).outcome is Outcome.FENCED
    lease = activated(b.try_activate("b", ADDRS["b"]))  # same instant, no lease to wait for
    assert lease.activation == 2
    assert lease.may_serve(clock.t)


def test_reset_recovers_and_refuses_while_a_lease_is_live(tmp_path: Path, clock: FakeClock) -> None:
    a = node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    with pytest.raises(WitnessUsageError, match="still holds a lease"):
        a.reset(5)
    clock.advance(4.0)
    reset = a.reset(5)
    assert reset.outcome is Outcome.RELEASED
    assert reset.state is not None
    assert (reset.state.activation, reset.state.holder, reset.state.kind) == (5, None, "reset")
    with pytest.raises(WitnessUsageError, match="not above"):
        a.reset(4)
    with pytest.raises(WitnessUsageError, match="not above"):
        a.reset(5)
    assert a.renew("a", 1).outcome is Outcome.FENCED  # 2 to 4 were skipped: the listing sees 5
    assert activated(a.try_activate("a", ADDRS["a"])).activation == 6


def test_the_holder_deletes_old_files(tmp_path: Path, clock: FakeClock) -> None:
    witnesses = {"a": node(tmp_path, clock), "b": node(tmp_path, clock)}
    activated(witnesses["a"].try_activate("a", ADDRS["a"]))
    for n in range(1, 6):  # a hands to b, b back to a, ...: activations 2 to 6
        giver, taker = ("a", "b") if n % 2 else ("b", "a")
        assert witnesses[giver].hand_over(giver, n, taker, ADDRS[taker]).outcome is (
            Outcome.HANDED_OVER
        )
        renewed(witnesses[taker].renew(taker, n + 1))
    stray = tmp_path / f".tmp-{HOST.pid_ns}-999999999-abcd-lease-1.json"  # no such process
    stray.write_text("{")
    renewed(witnesses["b"].renew("b", 6))
    assert files(tmp_path) == [
        "activation-4.json",
        "activation-5.json",
        "activation-6.json",
        "lease-4.json",
        "lease-5.json",
        "lease-6.json",
        MARKER_NAME,
    ]


# --- damaged, deleted and foreign files ---------------------------------------------------------


def _time_field(body: dict[str, object]) -> str:
    return "granted_at" if "granted_at" in body else "renewed_at"


def _not_json(path: Path) -> None:
    path.write_bytes(b'{"format": "hafailover-activation", "activation": ')


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _a_list(path: Path) -> None:
    path.write_text("[]")


def _edited_without_checksum(path: Path) -> None:
    body = json.loads(path.read_bytes())
    body["lease"] += 1
    path.write_text(json.dumps(body))


def _activation_as_text(path: Path) -> None:
    rewrite(path, activation="1")


def _another_activation(path: Path) -> None:
    rewrite(path, activation=7)


def _extra_field(path: Path) -> None:
    rewrite(path, note="hand edited")


def _nan_time(path: Path) -> None:
    body = json.loads(path.read_bytes())
    value = json.dumps(body[_time_field(body)])
    path.write_text(json.dumps(body).replace(value, "NaN"))


def _negative_lease(path: Path) -> None:
    rewrite(path, lease=-1.0)


def _other_version(path: Path) -> None:
    rewrite(path, version=2)


def _no_pid(path: Path) -> None:
    rewrite(path, holder_pid=0)


@pytest.mark.parametrize("which", ["activation", "lease"])
@pytest.mark.parametrize(
    "damage",
    [
        _not_json,
        _empty,
        _a_list,
        _edited_without_checksum,
        _activation_as_text,
        _another_activation,
        _extra_field,
        _nan_time,
        _negative_lease,
        _other_version,
        _no_pid,
    ],
)
def test_a_corrupt_current_file_is_never_guessed_at(
    tmp_path: Path, clock: FakeClock, damage: Callable[[Path], None], which: str
) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    damage(a.activation_path(1) if which == "activation" else a.lease_path(1))
    clock.advance(100.0)
    with pytest.raises(WitnessCorruptError, match="refusing to guess") as err:
        b.read()
    assert err.value.code == "CORRUPT"
    with pytest.raises(WitnessCorruptError):
        b.try_activate("b", ADDRS["b"])
    fenced = a.renew("a", 1)  # the holder cannot prove it still holds the role: safe state
    assert fenced.outcome is Outcome.FENCED
    assert "refusing to guess" in fenced.reason
    assert b.reset(7).outcome is Outcome.RELEASED  # the operator's way out
    assert activated(b.try_activate("b", ADDRS["b"])).activation == 8


def test_a_corrupt_lease_below_an_unrenewed_claim_is_never_guessed_at(
    tmp_path: Path, clock: FakeClock
) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    clock.advance(4.0)
    takeover = b.try_activate_steps("b", ADDRS["b"])
    step_until(takeover, "claimed")  # b stops before its lease: readers look at lease-1
    _empty(a.lease_path(1))
    clock.advance(4.0)
    with pytest.raises(WitnessCorruptError):
        a.try_activate("a", ADDRS["a"])


@pytest.mark.parametrize("deleted", ["both", "activation", "all"])
def test_deleted_files_are_not_a_first_start(
    tmp_path: Path, clock: FakeClock, deleted: str
) -> None:
    a, b = node(tmp_path, clock), node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    a.activation_path(1).unlink()
    if deleted in ("both", "all"):
        a.lease_path(1).unlink()
    if deleted == "all":  # only the marker was left; now nothing at all (a documented limit)
        a.marker_path.unlink()
        assert b.read() is None
        return
    with pytest.raises(WitnessMissingError, match="deleted") as err:
        b.read()
    assert err.value.code == "MISSING"
    with pytest.raises(WitnessMissingError):
        b.try_activate("b", ADDRS["b"])
    assert a.renew("a", 1).outcome is Outcome.FENCED
    assert b.reset(2).outcome is Outcome.RELEASED
    assert activated(b.try_activate("b", ADDRS["b"])).activation == 3


def test_stray_temporary_files_alone_are_still_a_first_start(
    tmp_path: Path, clock: FakeClock
) -> None:
    (tmp_path / ".tmp-1-2-abcd-activation-1.json").write_text("{")  # died before its link
    assert activated(node(tmp_path, clock).try_activate("a", ADDRS["a"])).activation == 1


def test_a_lease_from_a_previous_boot_is_void(tmp_path: Path, clock: FakeClock) -> None:
    before = node(tmp_path, clock, host=attrs.evolve(HOST, boot_id="boot-0"))
    activated(before.try_activate("a", ADDRS["a"]))
    renewed(before.renew("a", 1))
    after = node(tmp_path, FakeClock(5.0), host=HOST)  # the clock restarted with the boot
    assert after.renew("a", 1).outcome is Outcome.FENCED
    lease = activated(after.try_activate("b", ADDRS["b"]))
    assert (lease.activation, lease.renewed_at, lease.not_before) == (2, 5.0, -math.inf)


def test_a_file_from_another_time_namespace_is_refused(tmp_path: Path, clock: FakeClock) -> None:
    a = node(tmp_path, clock)
    activated(a.try_activate("a", ADDRS["a"]))
    other = node(tmp_path, clock, host=attrs.evolve(HOST, clock_offset="3600 0"))
    clock.advance(100.0)
    with pytest.raises(WitnessClockError, match="time namespace"):
        other.try_activate("b", ADDRS["b"])
    assert other.renew("a", 1).outcome is Outcome.FENCED


# --- contract checks, and no step ever waits for another node -----------------------------------


def test_now_ahead_of_the_clock_is_refused(tmp_path: Path, clock: FakeClock) -> None:
    a = node(tmp_path, clock)
    with pytest.raises(WitnessUsageError, match="ahead of the clock"):
        a.try_activate("a", ADDRS["a"], now=T0 + 1)
    with pytest.raises(WitnessUsageError, match="finite"):
        a.try_activate("a", ADDRS["a"], now=math.nan)
    assert a.read() is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lease": 0},
        {"lease": -1},
        {"margin": -0.1},
        {"grace": -0.1},
        {"lease": 3.0, "margin": 2.0},  # would stop serving before the next renewal
        {"lease": math.inf},
        {"margin": True},
    ],
)
def test_bad_timings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(WitnessUsageError):
        Timing(**kwargs)


def test_bad_arguments_are_refused(tmp_path: Path, clock: FakeClock) -> None:
    a = node(tmp_path, clock)
    with pytest.raises(WitnessUsageError, match="list of addresses"):
        a.try_activate("a", "stomp://127.0.0.1:61001")
    with pytest.raises(WitnessUsageError, match="node id"):
        a.try_activate("", ADDRS["a"])
    with pytest.raises(WitnessUsageError, match="activation"):
        a.renew("a", 0)
    steps = a.try_activate_steps("a", ADDRS["a"])
    with pytest.raises(WitnessUsageError, match="not finished"):
        _ = steps.decision
    assert steps.run().outcome is Outcome.ACTIVATED
    assert steps.step() is None


OPERATIONS: dict[str, Callable[[Witness], Steps]] = {
    "activate": lambda w: w.try_activate_steps("a", ADDRS["a"]),
    "renew": lambda w: w.renew_steps("a", 1),
    "hand_over": lambda w: w.hand_over_steps("a", 1, "b", ADDRS["b"]),
    "release": lambda w: w.release_steps("a", 1),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_node_stopped_at_any_step_delays_nobody(
    tmp_path: Path, clock: FakeClock, operation: str
) -> None:
    """Whatever action a's operation stopped after, b gets an answer at once, and activates
    once what a left behind has run out (lease + grace at most); a, resumed, does not serve."""
    count = 0
    while True:
        directory = tmp_path / f"stop-{count}"
        directory.mkdir()
        clock.t = T0
        a, b = node(directory, clock), node(directory, clock)
        if operation != "activate":
            activated(a.try_activate("a", ADDRS["a"]))
        stopped = OPERATIONS[operation](a)
        for _ in range(count):
            stopped.step()
        if stopped.done:
            break
        decision = b.try_activate("b", ADDRS["b"])
        if decision.outcome is Outcome.HELD:
            clock.advance(3.5 + 1e-6)
            decision = b.try_activate("b", ADDRS["b"])
        mine = activated(decision)
        theirs = stopped.run()
        if theirs.lease is not None:  # a's lease ended before b's begins
            assert theirs.lease.serve_until <= max(mine.not_before, clock.t), (count, theirs)
        count += 1
    assert count >= 5


# --- the property: never two nodes serving ------------------------------------------------------


@attrs.define(eq=False)
class NodeModel:
    """One node process as the broker would drive it, one witness action at a time."""

    label: str  # "a1", "a2" (two incarnations of node "a"), "b"
    name: str  # the node id it gives the witness
    witness: Witness
    timing: Timing
    lease: Lease | None = None  # the newest lease; None once dropped
    held_from: float = -math.inf  # when it got that lease
    activation: int | None = None  # the activation it holds or was handed
    last_activation: int | None = None  # the last one it held or was handed, if any
    last_now: float = -math.inf
    op: Steps | None = None  # the operation under way, stopped between two actions
    op_kind: str = ""
    op_activation: int | None = None
    op_stale: bool = False  # the operation began on an activation the node no longer held
    op_to: NodeModel | None = None


@attrs.frozen
class Held:
    """Who held which lease from when until when (end: +inf while still held)."""

    label: str
    lease: Lease
    start: float
    end: float


class Model:
    def __init__(self, nodes: dict[str, NodeModel], clock: FakeClock) -> None:
        self.nodes = nodes
        self.clock = clock
        self.history: list[Held] = []
        self.min_grace = min(n.timing.grace for n in nodes.values())

    def intervals(self) -> list[Held]:
        current = [
            Held(n.label, n.lease, max(n.lease.not_before, n.held_from), n.lease.serve_until)
            for n in self.nodes.values()
            if n.lease is not None
        ]
        return self.history + current

    def drop(self, me: NodeModel) -> None:
        if me.lease is not None:
            start = max(me.lease.not_before, me.held_from)
            end = min(me.lease.serve_until, self.clock.t)
            self.history.append(Held(me.label, me.lease, start, end))
        me.lease = None

    def take(self, me: NodeModel, lease: Lease) -> None:
        """me gets a new lease now: check it against every lease anyone else has held."""
        self.drop(me)
        me.lease, me.held_from = lease, self.clock.t
        start, end = max(lease.not_before, self.clock.t), lease.serve_until
        for other in self.intervals():
            # At no instant do two nodes pass may_serve (an interval held to the end from now
            # on is a superset of the one it will have been).
            overlap = start < end and other.start < other.end
            overlap = overlap and start < other.end and other.start < end
            assert other.label == me.label or not overlap, f"{me.label} {lease} vs {other}"
        for n in self.nodes.values():
            if n is me or n.lease is None:
                continue
            # Of two leases held at once, the one of the higher activation starts at least a
            # grace after the lower one ends, as its holder recorded it (the budget for a delay
            # between a check and its effect). The lower one may be the newer: a node can stop
            # between its passing check and learning the outcome.
            assert n.lease.activation != lease.activation, (n.label, me.label, lease)
            (low, _), (high, high_from) = sorted(
                [(n.lease, n.held_from), (lease, self.clock.t)], key=lambda x: x[0].activation
            )
            high_start = max(high.not_before, high_from)
            if high_start < high.serve_until:
                assert high_start >= low.renewed_at + low.duration + self.min_grace, (low, high)

    def begin(self, me: NodeModel, kind: str, to: NodeModel, lag: float) -> bool:
        """Start an operation the way the broker does; False if the broker would not."""
        now = max(me.last_now, self.clock.t - lag * me.timing.lease)
        me.last_now = now
        w = me.witness
        if kind == "activate":
            me.op = w.try_activate_steps(me.name, ADDRS[me.name], now=now)
        elif kind == "renew":
            activation = me.activation if me.activation is not None else me.last_activation
            if activation is None:
                return False  # never held one: nothing to renew (never guess a number)
            me.op, me.op_activation = w.renew_steps(me.name, activation, now=now), activation
            me.op_stale = me.activation != activation
        elif kind == "hand_over":
            if me.activation is None or to.name == me.name:
                return False
            self.drop(me)  # the contract: stop serving first
            me.op = w.hand_over_steps(me.name, me.activation, to.name, ADDRS[to.name], now=now)
            me.op_activation, me.op_to, me.activation = me.activation, to, None
        elif kind == "release":
            if me.activation is None:
                return False
            self.drop(me)  # the contract: stop serving first
            me.op = w.release_steps(me.name, me.activation, now=now)
            me.op_activation, me.activation = me.activation, None
        else:
            raise AssertionError(kind)
        me.op_kind = kind
        return True

    def step(self, me: NodeModel) -> None:
        assert me.op is not None
        if me.op.step() is not None:
            return
        decision, kind = me.op.decision, me.op_kind
        me.op = None
        event(f"{kind}: {decision.outcome.value}")
        if kind == "activate":
            if decision.outcome is Outcome.ACTIVATED:
                assert decision.lease is not None
                if decision.lease.not_before > decision.lease.renewed_at:
                    event("activated with a later start: a renewal raced the takeover")
                self.take(me, decision.lease)
                me.activation = me.last_activation = decision.lease.activation
            else:
                assert decision.outcome is Outcome.HELD
                assert decision.retry_at is not None
        elif kind == "renew":
            # A renewal of an activation the node had given up or lost when it began must fail.
            # One may still succeed when the node was handed a newer activation while it ran:
            # its check for a claim above came before that claim. Its lease is then checked
            # against every other like any lease (the node would drop it for the newer one).
            stale = me.activation != me.op_activation
            if decision.outcome is Outcome.RENEWED:
                assert decision.lease is not None
                assert not me.op_stale, "a renewal of an activation given up or lost succeeded"
                old = me.lease
                if old is not None and old.activation == decision.lease.activation:
                    assert decision.lease.serve_until >= old.serve_until
                self.take(me, decision.lease)
            else:
                assert decision.outcome is Outcome.FENCED
                if not stale:
                    self.drop(me)
                    me.activation = None
        elif kind == "hand_over":
            if decision.outcome is Outcome.HANDED_OVER:
                assert decision.state is not None
                to = me.op_to
                assert to is not None
                to.activation = to.last_activation = decision.state.activation  # the handshake
            else:
                assert decision.outcome is Outcome.FENCED
        else:
            assert decision.outcome in (Outcome.RELEASED, Outcome.FENCED)


timings = st.builds(
    lambda lease, margin, grace: Timing(lease, margin * lease * 0.6, grace * lease),
    st.floats(0.1, 5.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 0.7),
)
LABELS = ("a1", "a2", "b")
node_actions = st.tuples(
    st.just("act"),
    st.sampled_from(LABELS),
    st.sampled_from(["renew", "renew", "activate", "activate", "hand_over", "release"]),
    st.floats(0.0, 1.0) | st.just(0.0),  # how stale the `now` reading is, in leases
    st.sampled_from(LABELS),  # to whom a hand-over goes
    st.sampled_from([1, 1, 2, 3, 100, 100]),  # how many of its actions to take (100: all)
)
actions = st.one_of(  # the nodes act about three times as often as time moves
    st.tuples(st.just("advance"), st.floats(0.0, 0.4) | st.floats(0.0, 2.0)),  # in leases
    st.tuples(st.just("boundary"), st.integers(0, 7)),
    *[node_actions] * 6,
)


RACE_TIMING = Timing(1.0, 0.2, 0.2)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(  # the old holder renews between the takeover's read and its claim
    timing_a=RACE_TIMING,
    timing_b=RACE_TIMING,
    steps=[
        ("act", "a1", "activate", 0.0, "a1", 100),
        ("advance", 1.5),  # a1 stopped past its lease + grace
        ("act", "b", "activate", 0.0, "a1", 4),  # listed, probed, read activation-1, lease-1
        ("act", "a1", "renew", 0.0, "a1", 100),  # a1 resumed: renewed, there is no claim 2
        ("act", "b", "activate", 0.0, "a1", 100),  # claims 2; the re-read sees the renewal
        ("advance", 0.3),
        ("act", "a1", "renew", 0.0, "a1", 100),  # fenced
        ("act", "b", "renew", 0.0, "a1", 100),
        ("advance", 0.5),
        ("boundary", 1),
        ("act", "b", "renew", 0.0, "a1", 100),
    ],
)
@example(  # as above, and the new holder stops right after its claim; a2 takes over from it
    timing_a=RACE_TIMING,
    timing_b=RACE_TIMING,
    steps=[
        ("act", "a1", "activate", 0.0, "a1", 100),
        ("advance", 1.5),
        ("act", "b", "activate", 0.0, "a1", 4),
        ("advance", 0.1),
        ("act", "a1", "renew", 0.0, "a1", 100),
        ("act", "b", "activate", 0.0, "a1", 1),  # claimed activation-2, then stopped
        ("advance", 1.15),  # b's claim ran out, a1's renewal (+ grace) not quite
        ("act", "a2", "activate", 0.0, "a1", 100),
        ("boundary", 0),
        ("boundary", 1),
        ("act", "b", "activate", 0.0, "a1", 100),  # resumed: superseded, never serves
        ("act", "a1", "renew", 0.0, "a1", 100),
    ],
)
@example(  # the new holder hands over, and the receiver releases, before the raced lease ends
    timing_a=RACE_TIMING,
    timing_b=RACE_TIMING,
    steps=[
        ("act", "a1", "activate", 0.0, "a1", 100),
        ("advance", 1.5),
        ("act", "b", "activate", 0.0, "a1", 4),
        ("act", "a1", "renew", 0.0, "a1", 100),
        ("act", "b", "activate", 0.0, "a1", 100),
        ("act", "b", "hand_over", 0.0, "a2", 100),
        ("act", "a2", "renew", 0.0, "a1", 100),  # must still wait for a1's lease
        ("act", "a2", "release", 0.0, "a1", 100),
        ("act", "b", "activate", 0.0, "a1", 100),  # so must b, after the release
        ("boundary", 0),
        ("act", "a1", "renew", 0.0, "a1", 100),
    ],
)
@example(  # the holder is handed a newer activation while its renewal of the old one ends
    timing_a=RACE_TIMING,
    timing_b=RACE_TIMING,
    steps=[
        ("act", "b", "activate", 0.0, "b", 100),
        ("act", "b", "renew", 0.0, "b", 5),  # wrote lease-1, found no claim 2: passed
        ("advance", 1.5),  # b stopped past its lease + grace
        ("act", "a1", "activate", 0.0, "b", 100),  # claims 2
        ("act", "a1", "hand_over", 0.0, "b", 100),  # claims 3 for b: the handshake
        ("act", "b", "renew", 0.0, "b", 100),  # b's renewal of 1 ends: RENEWED, and harmless
    ],
)
@example(  # a holder stops between writing its lease and checking; a hand-over follows
    timing_a=RACE_TIMING,
    timing_b=RACE_TIMING,
    steps=[
        ("act", "b", "activate", 0.0, "b", 100),
        ("advance", 0.3),
        ("act", "b", "renew", 0.0, "b", 4),  # read claim, read lease, looked, wrote
        ("advance", 1.3),
        ("act", "a1", "activate", 0.0, "b", 3),
        ("boundary", 2),
        ("act", "a1", "activate", 0.0, "b", 100),
        ("act", "b", "renew", 0.0, "b", 100),  # fenced
        ("act", "a1", "hand_over", 0.0, "b", 100),
        ("act", "b", "renew", 0.0, "b", 100),
        ("act", "a2", "activate", 0.0, "b", 100),
    ],
)
@given(
    timing_a=timings,
    timing_b=timings,
    steps=st.lists(actions, min_size=20, max_size=150),
)
def test_never_two_nodes_may_serve_at_once(
    timing_a: Timing, timing_b: Timing, steps: list[tuple[Any, ...]]
) -> None:
    """Nodes a and b, where a also has a second incarnation (a restart while the first one is
    paused): three processes, two node ids, every interleaving of their file-system actions,
    readings that lag, pauses anywhere, and time passing between any two actions."""
    clock = FakeClock()
    with tempfile.TemporaryDirectory() as directory:
        nodes = {
            label: NodeModel(label, label[0], node(Path(directory), clock, timing), timing)
            for label, timing in (("a1", timing_a), ("a2", timing_a), ("b", timing_b))
        }
        model = Model(nodes, clock)
        observer = nodes["b"].witness
        seen = 0

        def check_files() -> None:
            nonlocal seen
            state = observer.read()  # never corrupt, never missing, never going back
            activation = 0 if state is None else state.activation
            assert activation >= seen
            seen = activation

        for action in steps:
            kind = action[0]
            if kind == "advance":
                clock.advance(float(action[1]) * timing_a.lease)
            elif kind == "boundary":
                # Land exactly on edges: where a lease stops or starts serving, where a grace
                # ends, and just after.
                edges = [
                    edge
                    for n in nodes.values()
                    if n.lease is not None
                    for edge in (n.lease.serve_until, n.lease.not_before)
                ]
                state = observer.read()
                if state is not None:
                    for t in (timing_a, timing_b):
                        end = state.expires_at + t.grace
                        edges += [end, math.nextafter(end, math.inf)]
                edges = [e for e in edges if math.isfinite(e)]
                if edges:
                    clock.t = max(clock.t, edges[int(action[1]) % len(edges)])
            else:
                _, label, op, lag, to, count = action
                me = nodes[label]
                if me.op is None and not model.begin(me, op, nodes[to], lag):
                    continue
                for _ in range(count):
                    if me.op is None:
                        break
                    model.step(me)
            check_files()
        # Let every stopped operation finish, one action each in turn.
        while any(n.op is not None for n in nodes.values()):
            for n in nodes.values():
                if n.op is not None:
                    model.step(n)
            check_files()


# --- real processes -----------------------------------------------------------------------------


NODE_SCRIPT = """\
import os, signal, sys, time
from pathlib import Path
from reference_broker.witness import Outcome, Timing, Witness

pair_dir, name, log_path = sys.argv[1:4]
lease_s, margin, grace, max_run = map(float, sys.argv[4:8])
stop_request = Path(sys.argv[8])  # holds k: stop ourselves after action k of a renewal
witness = Witness(pair_dir, Timing(lease_s, margin, grace))
log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def log(at, what):
    os.write(log_fd, f"{name} {at!r} {what}\\n".encode())  # one write: whole lines


def renew(activation):
    steps = witness.renew_steps(name, activation)
    try:
        stop_after = int(stop_request.read_text())
    except (OSError, ValueError):
        return steps.run()
    stop_request.unlink()
    for k in range(1, stop_after + 1):
        done = steps.step()
        if done is None:
            break
    log(time.monotonic(), f"self-stop after action {k}: {done}")
    os.kill(os.getpid(), signal.SIGSTOP)
    return steps.run()


lease = None
end = time.monotonic() + max_run  # never outlive the test, whatever happens to it
while time.monotonic() < end:
    now = time.monotonic()
    if lease is not None:
        log(now, "serving" if lease.may_serve(now) else "expired")
    if lease is None:
        decision = witness.try_activate(name, [f"stomp://{name}"])
        if decision.outcome is Outcome.ACTIVATED:
            lease = decision.lease
            log(max(lease.renewed_at, lease.not_before), f"activated {lease.activation}")
    elif lease.renew_due(time.monotonic()):
        decision = renew(lease.activation)
        if decision.outcome is Outcome.RENEWED:
            lease = decision.lease
        elif decision.outcome is Outcome.FENCED:
            log(time.monotonic(), f"fenced {decision.reason}")
            lease = None  # the safe state, then back to being a backup
    time.sleep(0.005)
"""

EXIT_SCRIPT = """\
import sys
from reference_broker.witness import Timing, Witness

decision = Witness(sys.argv[1], Timing(lease=60.0)).try_activate("a", ["stomp://a"])
print(decision.outcome.value, flush=True)
if sys.argv[2] == "stay":
    sys.stdin.read()  # hold the role until the test closes our stdin
"""

CLOCK_SCRIPT = """\
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
end = time.monotonic() + 20
while time.monotonic() < end:
    os.write(fd, f"{time.monotonic()!r}\\n".encode())
    time.sleep(0.005)
"""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # by pid: only what this test started
            proc.wait(timeout=10)


def spawn(
    started: list[subprocess.Popen[bytes]], script: Path, *args: object, pipes: bool = False
) -> subprocess.Popen[bytes]:
    pipe = subprocess.PIPE if pipes else None
    proc = subprocess.Popen(
        [sys.executable, str(script), *map(str, args)],
        env=child_env(),
        cwd=REPO,
        stdin=pipe,
        stdout=pipe,
    )
    started.append(proc)
    return proc


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


class LogTail:
    """A node's log, parsed as it grows ("name instant what" lines, each one write)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lines: list[tuple[str, float, str]] = []

    def read(self) -> list[tuple[str, float, str]]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return self.lines
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.decode().splitlines():
            name, at, what = line.split(" ", 2)
            self.lines.append((name, float(at), what))
        return self.lines


def serving_intervals(lines: list[tuple[str, float, str]]) -> list[tuple[float, float]]:
    """Runs of consecutive 'serving' checks of one node, as [first, last] check instants."""
    intervals: list[tuple[float, float]] = []
    run: list[float] = []
    for _, at, what in [*lines, ("", math.inf, "end")]:
        if what == "serving":
            run.append(at)
        elif run:
            intervals.append((run[0], run[-1]))
            run = []
    return intervals


def assert_never_both_serving(logs: dict[str, list[tuple[str, float, str]]], budget: float) -> int:
    """No two nodes' serving runs overlap, and between two nodes' runs lies the budget."""
    runs = sorted(
        (start, end, name)
        for name, lines in logs.items()
        for start, end in serving_intervals(lines)
    )
    changes = 0
    for (_, end, before), (start, _, after) in itertools.pairwise(runs):
        assert end < start, f"{before} serves until {end}, {after} from {start}"
        if before != after:
            changes += 1
            assert start - end > budget, f"{before} until {end}, {after} from {start}"
    return changes


def process_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(60)
def test_monotonic_clock_runs_on_while_a_process_is_stopped(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    assert "CLOCK_MONOTONIC" in time.get_clock_info("monotonic").implementation
    script = tmp_path / "clock.py"
    script.write_text(CLOCK_SCRIPT)
    log = tmp_path / "clock.log"
    proc = spawn(processes, script, log)
    wait_for(lambda: len(read_floats(log)) > 10, 20, "the child's first readings")
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(0.5)
    resumed_at = time.monotonic()
    os.kill(proc.pid, signal.SIGCONT)
    count = len(read_floats(log))
    wait_for(lambda: len(read_floats(log)) > count + 10, 20, "readings after SIGCONT")
    readings = read_floats(log)
    gap, after = max((b - a, b) for a, b in itertools.pairwise(readings))
    assert gap >= 0.45  # the child's clock advanced through the stop ...
    assert after >= resumed_at  # ... and is the same clock as ours


def read_floats(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["reaped", "zombie", "stopped"])
def test_a_holder_process_that_has_exited_is_not_waited_for(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], how: str
) -> None:
    script = tmp_path / "holder.py"
    script.write_text(EXIT_SCRIPT)
    pair = tmp_path / "pair"
    pair.mkdir()
    stay = "stay" if how == "stopped" else "exit"
    proc = spawn(processes, script, pair, stay, pipes=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"activated"
    if how == "reaped":
        proc.wait(timeout=20)
    elif how == "zombie":
        wait_for(lambda: process_state(proc.pid) == "Z", 20, "a zombie")
    else:
        os.kill(proc.pid, signal.SIGSTOP)
    backup = Witness(pair, Timing(lease=60.0))  # the holder's 60 s lease has not expired
    decision = backup.try_activate("b", ["stomp://b"])
    if how == "stopped":
        assert decision.outcome is Outcome.HELD  # a stopped process may resume: wait
    else:
        lease = activated(decision)
        assert f"process {proc.pid} has exited" in decision.reason
        assert lease.may_serve(time.monotonic())


class Pair:
    """Two NODE_SCRIPT processes on one pair directory, and their logs."""

    def __init__(
        self, tmp_path: Path, started: list[subprocess.Popen[bytes]], timing: Timing
    ) -> None:
        script = tmp_path / "node.py"
        script.write_text(NODE_SCRIPT)
        pair = tmp_path / "pair"
        pair.mkdir()
        self.logs = {name: tmp_path / f"{name}.log" for name in ("n0", "n1")}
        self.tails = {name: LogTail(path) for name, path in self.logs.items()}
        self.stop_requests = {name: tmp_path / f"stop-{name}" for name in self.logs}
        self.procs = {
            name: spawn(
                started,
                script,
                pair,
                name,
                self.logs[name],
                timing.lease,
                timing.margin,
                timing.grace,
                100,
                self.stop_requests[name],
            )
            for name in self.logs
        }

    def events(self, name: str) -> list[tuple[str, float, str]]:
        return self.tails[name].read()

    def first(self, name: str, word: str, after: float = -math.inf) -> float | None:
        """The instant of the first such event after `after` (lines are written in order,
        give or take the time between a reading and its line: far less than 2 s)."""
        found = None
        for _, at, what in reversed(self.events(name)):
            if at <= after - 2.0:
                break
            if at > after and what.startswith(word):
                found = at
        return found

    def says(self, name: str, word: str, after: float = -math.inf) -> bool:
        return self.first(name, word, after) is not None


@pytest.mark.timeout(120)
def test_sigstopped_live_is_fenced_and_never_serves_alongside_the_backup(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    timing = Timing(lease=1.0, margin=0.2, grace=0.2)
    pair = Pair(tmp_path, processes, timing)
    wait_for(lambda: any(pair.says(n, "serving") for n in pair.logs), 20, "a node to serve")
    live, backup = ("n0", "n1") if pair.says("n0", "serving") else ("n1", "n0")
    time.sleep(3 * timing.lease)  # several renewals while the backup is refused
    assert not pair.says(backup, "activated")

    # Stop the live wherever it is: there is no critical section any more.
    paused_at = time.monotonic()
    os.kill(pair.procs[live].pid, signal.SIGSTOP)
    wait_for(lambda: pair.says(backup, "serving"), 5 * timing.lease, "the backup to take over")
    resumed_at = time.monotonic()
    os.kill(pair.procs[live].pid, signal.SIGCONT)
    wait_for(lambda: pair.says(live, "fenced", resumed_at), 10, "the resumed live to fence itself")
    time.sleep(2 * timing.lease)  # let both run on

    live_log = pair.events(live)
    after_resume = [what.split()[0] for _, at, what in live_log if at >= resumed_at]
    # Its first check on resume failed ("expired"), unless the stop fell between a check and
    # its log line: then that line bears the earlier instant and the renewal comes first.
    assert after_resume[0] in ("expired", "fenced"), after_resume
    assert "serving" not in after_resume
    assert pair.says(backup, "serving", resumed_at + timing.lease)  # the backup kept serving
    first = pair.first(backup, "serving", paused_at)
    assert first is not None
    assert first - paused_at <= timing.lease + timing.grace + 0.4
    logs = {name: pair.events(name) for name in pair.logs}
    assert assert_never_both_serving(logs, timing.margin + timing.grace) == 1


@pytest.mark.timeout(150)
def test_a_holder_stopped_again_and_again_never_delays_the_takeover(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """20 rounds: stop whichever node holds the role, at a random instant (half the time from
    outside with SIGSTOP, half the time from inside, after a random action of a renewal); the
    other must serve within lease + grace + slack; resume the stopped one, which fences
    itself and becomes the backup for the next round."""
    timing = Timing(lease=0.6, margin=0.12, grace=0.12)
    slack = 0.4
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    pair = Pair(tmp_path, processes, timing)
    wait_for(lambda: any(pair.says(n, "serving") for n in pair.logs), 20, "a node to serve")
    holder = "n0" if pair.says("n0", "serving") else "n1"
    delays: list[tuple[str, float]] = []
    for round_number in range(20):
        other = "n1" if holder == "n0" else "n0"
        proc = pair.procs[holder]
        wait_for(
            lambda: pair.says(holder, "serving", time.monotonic() - 0.05),  # noqa: B023 - now
            10,
            f"round {round_number}: the holder to serve",
        )
        if round_number % 2 == 0:
            time.sleep(rng.uniform(0, timing.renew_interval))
            how = "SIGSTOP"
            paused_at = time.monotonic()
            os.kill(proc.pid, signal.SIGSTOP)
        else:
            action = rng.randint(1, 6)  # a renewal takes 6 actions when nothing is wrong
            how = f"self-stop after action {action}"
            since = time.monotonic()
            pair.stop_requests[holder].write_text(str(action))
            wait_for(
                lambda: process_state(proc.pid) == "T",  # noqa: B023 - used at once
                10,
                f"round {round_number}: the holder to stop itself",
            )
            stopped = pair.first(holder, "self-stop", since)
            assert stopped is not None
            paused_at = stopped
        wait_for(
            lambda: pair.says(other, "serving", paused_at),  # noqa: B023 - used at once
            timing.lease + timing.grace + 10,
            f"round {round_number}: the other node to take over",
        )
        first = pair.first(other, "serving", paused_at)
        assert first is not None
        delays.append((how, round(first - paused_at, 3)))
        resumed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(
            lambda: pair.says(holder, "fenced", resumed_at),  # noqa: B023 - used at once
            10,
            f"round {round_number}: the resumed node to fence itself",
        )
        holder = other
    print(f"seed {seed}: takeover delays {delays}")  # shown on failure, or with -s
    worst = max(delay for _, delay in delays)
    assert worst <= timing.lease + timing.grace + slack, f"seed {seed}: {delays}"
    logs = {name: pair.events(name) for name in pair.logs}
    assert assert_never_both_serving(logs, timing.margin + timing.grace) == 20, f"seed {seed}"
