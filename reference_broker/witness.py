"""The fencing rule of the broker pair: activation claims, leases and an activation sequence.

Theory of operation
-------------------
The live and the backup share a directory (the *pair directory*). Every activation N of the
live role has two files there, both sealed with a CRC32:

``activation-<N>.json``, the *claim*: the holder's node id and client addresses, when it was
    granted (CLOCK_MONOTONIC) and for how long, the claimer's process, boot id and time and pid
    namespaces, how it was claimed (first start, takeover, hand-over, reset) and `not_before`.
    It is written complete into a temporary file, fsynced, and published with ``link()``, which
    fails if the name exists: a claim is exclusive, atomic, and never changes afterwards.
``lease-<N>.json``: written only by the holder of N (temporary file, fsync, ``rename``): its
    last renewal, lease length, process, host, `not_before`, and whether it released the role.

The current activation is the highest N with a claim. ``witness.marker`` appears once a claim
exists, so that a directory whose files were deleted is not taken for a first start.

- renew(node, N): 1) t = a clock reading; 2) write lease-N with renewed_at = t; 3) THEN look
  for a claim above N: none, RENEWED with a Lease counted from t; one, FENCED.
- try_activate(node): read the highest claim N and its lease and decide: released, the lease
  ended more than `grace` ago (or in a previous boot), or the holder's process has provably
  exited. Claim N+1 by link (a lost race is HELD). Re-read lease-N: a renewal that landed
  between the read and the claim may have passed its step 3, so the new holder must not serve
  before that lease's end + grace (`Lease.not_before`). Write lease-(N+1), then look for a
  claim above N+1, as renew does.
- hand_over(from, N, to): the holder, no longer serving, claims N+1 naming `to`, who serves
  after its own renew(to, N+1), at once. release(node, N): the holder, no longer serving,
  writes lease-N with released = true; anyone may claim N+1 at once.

`not_before` carries forward the end (+ grace) of older leases that may still be served:
every claim records the bound its claimer knew, every lease the bound its holder learnt after
its claim, so a reader of activation N never looks further back than lease-(N-1). Every
operation is a generator that yields after each file-system action (`Steps`), so that tests
can interleave the actions of several nodes; the public methods run it to the end.

Invariant: at no instant do two nodes both hold a `Lease` whose `may_serve(now)` is true.
It holds when both nodes run on one machine in one time namespace (they read the same
CLOCK_MONOTONIC, which keeps running while a process is stopped), pass `now` values that are real
readings of that clock taken no later than the call, use only the newest Lease they were given,
drop it before they call `hand_over` or `release`, call renew/release for one activation from
one process at a time, and never adopt an activation number they were not given (by activating
or in a hand-over). A lease is served only if its step 3 ran before the next claim, so its step
2 is visible to that claimer's re-read; a renewal whose step 3 runs later is FENCED and unused.
What it cannot cover is a pause between a passing check and the confirmation it licenses:
margin + grace is the budget for that delay. docs/broker-fencing.md gives the argument.

What it never does: no lock, no threads, no sleeping, no waiting for another process. Every
step is one atomic file-system action, so a node stopped at any instruction delays nothing but
its own progress; the caller drives time and retries on its next tick. It never guesses: a
corrupt or missing current file makes try_activate and read raise and the holder's renew FENCE.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import re
import secrets
import time
import zlib
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import attrs

from reference_broker._files import PRIVATE_FILE, sync_directory

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_LEASE",
    "DEFAULT_MARGIN",
    "MARKER_NAME",
    "Decision",
    "Host",
    "Lease",
    "Outcome",
    "Steps",
    "Timing",
    "Witness",
    "WitnessClockError",
    "WitnessCorruptError",
    "WitnessError",
    "WitnessMissingError",
    "WitnessState",
    "WitnessUsageError",
]

MARKER_NAME = "witness.marker"
CLAIM_FORMAT = "hafailover-activation"
LEASE_FORMAT = "hafailover-lease"
FORMAT_VERSION = 1
DEFAULT_LEASE = 3.0
DEFAULT_MARGIN = 0.5
DEFAULT_GRACE = 0.5
KEEP_BEHIND = 2  # the holder of N deletes the files of activations below N - KEEP_BEHIND
_MARKER = b"hafailover: an activation has been claimed in this directory\n"
_CLAIM_RE = re.compile(r"activation-([1-9][0-9]*)\.json")
_LEASE_RE = re.compile(r"lease-([1-9][0-9]*)\.json")
_TEMP_RE = re.compile(r"\.tmp-([0-9]+)-([0-9]+)-[0-9a-f]+-.*")
_HOST_FIELDS = frozenset({"boot_id", "clock_offset", "pid_ns"})
_COMMON = frozenset({"format", "version", "activation", "lease", "holder_pid", "not_before"})
_CLAIM_FIELDS = _COMMON | _HOST_FIELDS | {"holder", "addresses", "granted_at", "kind"}
_LEASE_FIELDS = _COMMON | _HOST_FIELDS | {"renewed_at", "released"}
_KINDS = ("first_start", "takeover", "hand_over", "reset")
_NEVER = -math.inf

Kind = Literal["first_start", "takeover", "hand_over", "reset"]
_Relation = Literal["same", "previous_boot", "foreign"]


# --- errors -------------------------------------------------------------------------------------


class WitnessError(Exception):
    """Root of the witness's errors; `code` tells programs which failure it is."""

    code: ClassVar[str] = "WITNESS"


class WitnessCorruptError(WitnessError, ValueError):
    """A claim or lease file exists but is not valid: nobody may act on it."""

    code = "CORRUPT"

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"{path}: {reason}; refusing to guess who is live. Stop both nodes, decide which one "
            f"has the newest journal, and run Witness.reset() with an activation above any this "
            f"pair has used"
        )
        self.path = path
        self.reason = reason


class WitnessMissingError(WitnessError):
    """The current claim is gone although the pair has had one (marker, or orphan lease)."""

    code = "MISSING"

    def __init__(self, path: Path, evidence: str) -> None:
        super().__init__(
            f"{path} is missing but {evidence}: it was deleted, and a live may still hold a "
            f"lease. Refusing to guess; stop both nodes and run Witness.reset()"
        )
        self.path = path


class WitnessClockError(WitnessError):
    """A file was written on this boot by a process that reads another CLOCK_MONOTONIC."""

    code = "CLOCK"


class WitnessUsageError(WitnessError, ValueError):
    """The caller broke the contract: a bad argument, a `now` ahead of the clock, a bad timing."""

    code = "USAGE"


# --- values -------------------------------------------------------------------------------------


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WitnessUsageError(f"{name} must be a finite number of seconds, not {value!r}")
    return float(value)


@attrs.frozen
class Timing:
    """A node's timing, in seconds.

    lease:  how long a renewal lets the holder serve, and (recorded in its lease file) how long
            the other node must wait. The holder renews every `renew_interval` = lease / 3.
    margin: the holder stops serving this long before its lease ends (`Lease.may_serve`).
    grace:  the other node waits this long after the recorded lease ends before it serves.

    On one clock the serving windows of two activations are disjoint for any margin, grace >= 0;
    margin + grace is the budget for the delay between a passing `may_serve` check and the effect
    it licenses (a confirmation on the wire). margin must leave the lease valid past the next
    renewal (margin < lease - renew_interval), or the live would pause between renewals.
    """

    lease: float = DEFAULT_LEASE
    margin: float = DEFAULT_MARGIN
    grace: float = DEFAULT_GRACE

    def __attrs_post_init__(self) -> None:
        lease = _check_seconds("lease", self.lease)
        margin = _check_seconds("margin", self.margin)
        grace = _check_seconds("grace", self.grace)
        if lease <= 0:
            raise WitnessUsageError(f"lease must be positive, not {lease}")
        if margin < 0 or grace < 0:
            raise WitnessUsageError(f"margin and grace must be >= 0, not {margin} and {grace}")
        if margin >= lease - self.renew_interval:
            raise WitnessUsageError(
                f"margin {margin} must be below lease - lease/3 = {lease - self.renew_interval}, "
                f"or the live stops serving before its next renewal"
            )

    @property
    def renew_interval(self) -> float:
        """How often the holder renews: three tries fit in one lease."""
        return self.lease / 3


@attrs.frozen
class Host:
    """What makes two processes' CLOCK_MONOTONIC readings and pids comparable.

    boot_id:      /proc/sys/kernel/random/boot_id ("" if unknown). CLOCK_MONOTONIC restarts at
                  each boot, so a lease written in another boot says nothing; and no process
                  survives a reboot, so such a lease is void.
    clock_offset: this time namespace's CLOCK_MONOTONIC offset, from /proc/self/timens_offsets
                  ("" if unknown). Processes in different time namespaces read different clocks.
    pid_ns:       inode of /proc/self/ns/pid (None if unknown): pids mean the same thing only
                  inside one pid namespace.
    """

    boot_id: str
    clock_offset: str
    pid_ns: int | None

    @classmethod
    def detect(cls) -> Host:
        boot_id = ""
        clock_offset = ""
        pid_ns: int | None = None
        with contextlib.suppress(OSError):
            boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        try:
            for line in Path("/proc/self/timens_offsets").read_text().splitlines():
                fields = line.split()
                if fields and fields[0] == "monotonic":
                    clock_offset = " ".join(fields[1:])
        except OSError:
            clock_offset = "0 0" if boot_id else ""  # Linux before 5.6: no time namespaces
        with contextlib.suppress(OSError):
            pid_ns = os.stat("/proc/self/ns/pid").st_ino
        return cls(boot_id=boot_id, clock_offset=clock_offset, pid_ns=pid_ns)


@attrs.frozen
class _Claim:
    """The content of activation-<N>.json; written once, never changed."""

    activation: int
    holder: str | None  # None only for a reset
    addresses: tuple[str, ...]
    granted_at: float  # the claimer's clock reading: the lease counts from it until renewed
    lease: float
    holder_pid: int | None  # the claimer's process; None for a hand-over and a reset
    kind: Kind
    not_before: float | None  # older leases may be served until then (None: none)
    host: Host


@attrs.frozen
class _LeaseRecord:
    """The content of lease-<N>.json; written only by the holder of N."""

    activation: int
    renewed_at: float
    lease: float
    holder_pid: int
    released: bool
    not_before: float | None
    host: Host


@attrs.frozen
class WitnessState:
    """A summary of one activation: its claim and, once its holder has written it, its lease.

    activation rises by one on every activation and hand-over, never falls; holder is None after
    a release or reset (anyone may activate at once); renewed_at, lease and holder_pid come from
    the lease file, or from the claim until its holder writes one (holder_pid is None after a
    hand-over until the new holder renews); boot_id, clock_offset and pid_ns are those of the
    file they come from. kind says how the activation was claimed; not_before, until when an
    older lease may still be served (None: no such lease).
    """

    activation: int
    holder: str | None
    addresses: tuple[str, ...]
    renewed_at: float
    lease: float
    holder_pid: int | None
    boot_id: str
    clock_offset: str
    pid_ns: int | None
    kind: str = "first_start"
    released: bool = False
    not_before: float | None = None

    @property
    def expires_at(self) -> float:
        """When the recorded lease ends; the holder's own limit is this minus its margin."""
        return self.renewed_at + self.lease

    @property
    def host(self) -> Host:
        return Host(self.boot_id, self.clock_offset, self.pid_ns)


@attrs.frozen
class Lease:
    """What a holder may do, and from and until when, on its own monotonic clock. Cheap to check.

    not_before is in the future only after a takeover that raced with a renewal of the old
    holder: the new holder waits for that lease to end (+ grace), renewing as usual.
    """

    node_id: str
    activation: int
    renewed_at: float
    duration: float
    margin: float
    not_before: float = _NEVER

    @property
    def serve_until(self) -> float:
        # Computed as (renewed_at + duration) - margin, the same float the witness's expires_at
        # starts from, so rounding cannot push it past the other node's activation threshold.
        return self.renewed_at + self.duration - self.margin

    @property
    def renew_at(self) -> float:
        return self.renewed_at + self.duration / 3

    def may_serve(self, now: float) -> bool:
        """True while the holder may accept and confirm sends. Check it before every effect."""
        return self.not_before <= now < self.serve_until

    def renew_due(self, now: float) -> bool:
        return now >= self.renew_at


class Outcome(enum.Enum):
    ACTIVATED = "activated"  # try_activate: you hold the role under a new activation; serve
    RENEWED = "renewed"  # renew: serve under the new lease
    HANDED_OVER = "handed_over"  # hand_over: the other node holds the role now
    RELEASED = "released"  # release/reset: nobody holds the role; anyone may activate
    HELD = "held"  # try_activate: another lease is valid until retry_at, or a race was lost
    FENCED = "fenced"  # renew/hand_over/release: you no longer hold the role: stop at once


@attrs.frozen
class Decision:
    """What an operation did: its outcome, why, the activation after it, the caller's lease."""

    outcome: Outcome
    reason: str
    state: WitnessState | None = None
    lease: Lease | None = None
    retry_at: float | None = None


_Op = Generator[str, None, Decision]


class Steps:
    """One witness operation, run one atomic file-system action at a time.

    `step()` performs the next action and returns what it did, or None once the operation is
    over; `decision` is then its outcome. Errors are raised by the step that meets them. The
    public Witness methods are `run()` of these; tests interleave the steps of several nodes.
    """

    def __init__(self, operation: _Op) -> None:
        self._operation = operation
        self._decision: Decision | None = None

    @property
    def done(self) -> bool:
        return self._decision is not None

    @property
    def decision(self) -> Decision:
        if self._decision is None:
            raise WitnessUsageError("the operation has not finished")
        return self._decision

    def step(self) -> str | None:
        if self._decision is not None:
            return None
        try:
            return next(self._operation)
        except StopIteration as stop:
            self._decision = stop.value
            return None

    def run(self) -> Decision:
        while self.step() is not None:
            pass
        return self.decision


def _drain(operation: Generator[str, None, Any]) -> Any:
    """Run a generator of steps to the end; its return value."""
    try:
        while True:
            next(operation)
    except StopIteration as stop:
        return stop.value


# --- the witness --------------------------------------------------------------------------------


class Witness:
    """One node's handle on the pair's activations and leases. Holds no open files between calls.

    `now` arguments are CLOCK_MONOTONIC readings (time.monotonic()) taken no later than the
    call; a reading taken earlier is safe (it only shortens leases), one ahead of `clock()` is
    refused. By default `now` is read when the call starts. `clock`, `host` and `durable=False`
    (no fsync) are for tests.
    """

    def __init__(
        self,
        pair_dir: str | os.PathLike[str],
        timing: Timing | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        host: Host | None = None,
        durable: bool = True,
    ) -> None:
        self._dir = Path(pair_dir)
        self._timing = timing if timing is not None else Timing()
        self._clock = clock
        self._host = host if host is not None else Host.detect()
        self._durable = durable

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def marker_path(self) -> Path:
        return self._dir / MARKER_NAME

    def activation_path(self, activation: int) -> Path:
        return self._dir / f"activation-{activation}.json"

    def lease_path(self, activation: int) -> Path:
        return self._dir / f"lease-{activation}.json"

    @property
    def timing(self) -> Timing:
        return self._timing

    @property
    def host(self) -> Host:
        return self._host

    def __repr__(self) -> str:
        return f"<Witness {str(self._dir)!r} {self._timing}>"

    # --- operations -----------------------------------------------------------------------------

    def read(self) -> WitnessState | None:
        """The current (highest) activation and its lease, as they are now.

        None at the pair's first start; raises WitnessCorruptError or WitnessMissingError.
        """
        found: tuple[int | None, bool] = _drain(self._find_highest())
        if found[0] is None:
            return None
        claim, lease = self._read_current(found[0])
        return _state(claim, lease)

    def try_activate(
        self, node_id: str, addresses: Sequence[str], now: float | None = None
    ) -> Decision:
        """Take the live role if nobody holds a valid lease: ACTIVATED or HELD.

        Allowed when there is no claim yet (first start), the role was released, the recorded
        lease ended more than `grace` ago or in a previous boot, or the holder's process has
        provably exited (same boot and pid namespace, and its pid is gone or a zombie). The
        Lease may start later than now (`Lease.not_before`) when the old holder renewed during
        the takeover. A corrupt or deleted current file raises: the node must not guess. A node
        that already holds the role renews instead; its own unexpired lease is HELD like anyone's
        (it may be an earlier, paused incarnation of the same node).
        """
        return self.try_activate_steps(node_id, addresses, now).run()

    def try_activate_steps(
        self, node_id: str, addresses: Sequence[str], now: float | None = None
    ) -> Steps:
        _check_node("node_id", node_id)
        addrs = _check_addresses(addresses)
        return Steps(self._try_activate(node_id, addrs, self._now(now)))

    def renew(self, node_id: str, activation: int, now: float | None = None) -> Decision:
        """Extend the holder's lease: RENEWED (with the new Lease) or FENCED.

        FENCED when a higher activation exists, the claim does not name this node, the holder
        released it, or a file cannot be read as valid: the node must stop serving at once and
        never serve under this activation again. After an OSError the old lease stands and runs
        out on its own.
        """
        return self.renew_steps(node_id, activation, now).run()

    def renew_steps(self, node_id: str, activation: int, now: float | None = None) -> Steps:
        _check_node("node_id", node_id)
        _check_activation(activation)
        return Steps(self._renew(node_id, activation, self._now(now)))

    def hand_over(
        self,
        from_node: str,
        activation: int,
        to_node: str,
        to_addresses: Sequence[str],
        now: float | None = None,
    ) -> Decision:
        """Give the role to `to_node` (failback): HANDED_OVER or FENCED.

        The caller must have stopped serving and dropped its Lease first. The new activation is
        in `decision.state.activation`; tell it to `to_node`, which starts serving after its own
        `renew(to_node, that activation)` succeeds, at once. If it never renews, the lease
        recorded in the claim runs out and either node may activate again.
        """
        return self.hand_over_steps(from_node, activation, to_node, to_addresses, now).run()

    def hand_over_steps(
        self,
        from_node: str,
        activation: int,
        to_node: str,
        to_addresses: Sequence[str],
        now: float | None = None,
    ) -> Steps:
        _check_node("from_node", from_node)
        _check_node("to_node", to_node)
        _check_activation(activation)
        addrs = _check_addresses(to_addresses)
        if to_node == from_node:
            raise WitnessUsageError(f"cannot hand the role from {from_node!r} to itself")
        return Steps(self._hand_over(from_node, activation, to_node, addrs, self._now(now)))

    def release(self, node_id: str, activation: int, now: float | None = None) -> Decision:
        """Give the role up (clean shutdown) so another node may activate at once.

        RELEASED or FENCED. The caller must have stopped serving and dropped its Lease.
        """
        return self.release_steps(node_id, activation, now).run()

    def release_steps(self, node_id: str, activation: int, now: float | None = None) -> Steps:
        _check_node("node_id", node_id)
        _check_activation(activation)
        return Steps(self._release(node_id, activation, self._now(now)))

    def reset(self, activation: int, now: float | None = None) -> Decision:
        """Operator recovery: claim this activation number as released.

        For a corrupt or deleted current file, with both nodes stopped. Pick an activation above
        any the pair has used (the newest journal knows); it must be above every claim and lease
        file present. Refused (WitnessUsageError) while a readable current lease is live.
        """
        _check_activation(activation)
        at = self._now(now)
        claims, leases, _marked = _parse_names(self._list())
        top = max([*claims, *leases], default=0)
        if activation <= top:
            raise WitnessUsageError(
                f"activation {activation} is not above {top}, the highest this pair has used"
            )
        not_before = _NEVER
        if claims:
            try:
                claim, lease = self._read_current(max(claims))
            except WitnessError:
                pass  # a damaged or missing current file is what reset is for
            else:
                state = _state(claim, lease)
                if self._relation(state.host) == "same" and self._relation(claim.host) == "same":
                    live = (
                        not state.released
                        and at <= state.expires_at + self._timing.grace
                        and not self._exited(state.holder_pid, state.host)
                    )
                    if live:
                        raise WitnessUsageError(
                            f"{state.holder} still holds a lease until {state.expires_at:.3f}: "
                            f"stop it (or let it release) before a reset"
                        )
                    bound: float = _drain(self._prior_bound(claim, lease))
                    not_before = max(bound, self._lease_end(lease))
        new = self._new_claim(activation, None, (), at, "reset", not_before, holder_pid=None)
        if not self._link_claim(new):
            raise WitnessUsageError(f"activation {activation} was claimed meanwhile")
        self._mark()
        state = _state(new, None)
        return Decision(Outcome.RELEASED, f"reset to activation {activation}", state=state)

    # --- the operations, step by step -----------------------------------------------------------

    def _try_activate(self, node_id: str, addrs: tuple[str, ...], at: float) -> _Op:
        grace = self._timing.grace
        current, marked = yield from self._find_highest()
        not_before = _NEVER
        exited = False
        relation: _Relation = "same"
        if current is None:
            kind: Kind = "first_start"
            why = "first start: no activation yet"
            target = 1
        else:
            claim = self._read_claim(current)
            yield f"read activation-{current}"
            if claim is None:
                raise WitnessMissingError(self.activation_path(current), "it was just listed")
            lease = self._read_lease(current)
            yield f"read lease-{current}"
            state = _state(claim, lease)
            relation = self._relation(state.host, claim.host, raising=True)
            grace_end = state.expires_at + grace
            if state.released:
                why = f"activation {current} was released"
            elif relation == "previous_boot":
                why = f"{state.holder}'s lease dates from a previous boot"
            elif at > grace_end:
                why = f"{state.holder}'s lease ended at {state.expires_at:.3f} (+ grace)"
            elif self._exited(state.holder_pid, state.host):
                why = f"{state.holder}'s process {state.holder_pid} has exited"
                exited = True
            else:
                return Decision(
                    Outcome.HELD,
                    f"{state.holder} holds activation {current} until {state.expires_at:.3f} "
                    f"(+ grace {grace})",
                    state=state,
                    retry_at=grace_end,
                )
            if relation == "same":
                not_before = yield from self._prior_bound(claim, lease)
            kind = "takeover"
            target = current + 1

        new = self._new_claim(target, node_id, addrs, at, kind, not_before, holder_pid=os.getpid())
        won = self._link_claim(new)
        yield f"{'claimed' if won else 'lost the race for'} activation-{target}"
        if not won:
            return Decision(
                Outcome.HELD,
                f"activation {target} was claimed by another node first",
                retry_at=at,
            )
        if current is not None and relation == "same":
            # The old holder may have renewed between our read and our claim, and that renewal
            # may have passed its check: wait for the lease it wrote before serving.
            fresh = self._read_lease(current)
            yield f"re-read lease-{current}"
            if fresh is not None and exited and self._exited(fresh.holder_pid, fresh.host):
                late = _or_never(fresh.not_before)
            else:
                late = self._lease_end(fresh)
            not_before = max(not_before, late)
        record = self._new_lease(target, at, not_before)
        self._write_lease(record)
        yield f"wrote lease-{target}"
        if not marked:
            self._mark()
            yield "marked the pair directory"
        superseded = self._superseded(target)
        yield f"looked for claims above {target}"
        if superseded:
            return Decision(
                Outcome.HELD,
                f"activation {target} was claimed, then superseded before it could serve",
                retry_at=at,
            )
        lease_value = Lease(node_id, target, at, self._timing.lease, self._timing.margin)
        if not_before > at:
            lease_value = attrs.evolve(lease_value, not_before=not_before)
            why += f"; serving from {not_before:.3f}, after a renewal that raced the takeover"
        return Decision(
            Outcome.ACTIVATED,
            f"activation {target}: {why}",
            state=_state(new, record),
            lease=lease_value,
        )

    def _renew(self, node_id: str, activation: int, at: float) -> _Op:
        try:
            claim = self._read_claim(activation)
            yield f"read activation-{activation}"
            problem = self._not_holder(claim, node_id, activation)
            if problem is not None:
                return _fenced(problem)
            assert claim is not None
            lease = self._read_lease(activation)
            yield f"read lease-{activation}"
            if lease is not None:
                if lease.released:
                    return _fenced(f"{node_id} released activation {activation}")
                if self._relation(lease.host, raising=True) != "same":
                    return _fenced(f"{self.lease_path(activation)} dates from a previous boot")
            superseded = self._superseded(activation)
            yield f"looked for claims above {activation}"
            if superseded:
                return _fenced(_superseded_reason(activation))
            if lease is not None:
                previous, not_before = lease.renewed_at, _or_never(lease.not_before)
            else:
                previous = claim.granted_at
                not_before = yield from self._prior_bound(claim, None)
        except WitnessError as exc:
            return _fenced(str(exc))
        # Never move the recorded renewal back: both readings are past instants, so the larger
        # one is still a time the lease may be counted from.
        record = self._new_lease(activation, max(previous, at), not_before)
        self._write_lease(record)
        yield f"wrote lease-{activation}"
        superseded = self._superseded(activation)
        yield f"looked for claims above {activation}"
        if superseded:
            return _fenced(_superseded_reason(activation))
        self._housekeep(activation)
        yield "housekeeping"
        new = Lease(
            node_id,
            activation,
            record.renewed_at,
            record.lease,
            self._timing.margin,
            not_before,
        )
        return Decision(Outcome.RENEWED, "renewed", state=_state(claim, record), lease=new)

    def _holder_steps(
        self, node_id: str, activation: int, released: str
    ) -> Generator[str, None, Decision | tuple[_Claim, _LeaseRecord | None, float]]:
        """The checks a holder's hand-over and release share, one file-system step each.

        Returns FENCED when ``node_id`` no longer holds ``activation`` (or released it, in
        which case the reason says ``released``), else the claim, its lease and the bound
        below which older leases may still be served.
        """
        try:
            claim = self._read_claim(activation)
            yield f"read activation-{activation}"
            problem = self._not_holder(claim, node_id, activation)
            if problem is not None:
                return _fenced(problem)
            assert claim is not None
            lease = self._read_lease(activation)
            yield f"read lease-{activation}"
            if lease is not None and lease.released:
                return _fenced(f"{node_id} {released} activation {activation}")
            superseded = self._superseded(activation)
            yield f"looked for claims above {activation}"
            if superseded:
                return _fenced(_superseded_reason(activation))
            not_before = yield from self._prior_bound(claim, lease)
        except WitnessError as exc:
            return _fenced(str(exc))
        return claim, lease, not_before

    def _hand_over(
        self, from_node: str, activation: int, to_node: str, addrs: tuple[str, ...], at: float
    ) -> _Op:
        # The giver has stopped serving: only leases older than its own may still run.
        held = yield from self._holder_steps(from_node, activation, "released")
        if isinstance(held, Decision):
            return held
        claim, lease, not_before = held
        granted = max(at, lease.renewed_at if lease is not None else claim.granted_at)
        target = activation + 1
        new = self._new_claim(
            target, to_node, addrs, granted, "hand_over", not_before, holder_pid=None
        )
        won = self._link_claim(new)
        yield f"{'claimed' if won else 'lost the race for'} activation-{target}"
        if not won:
            return _fenced(f"activation {target} was claimed by another node first")
        why = f"{from_node} handed activation {target} to {to_node}"
        return Decision(Outcome.HANDED_OVER, why, state=_state(new, None))

    def _release(self, node_id: str, activation: int, at: float) -> _Op:
        held = yield from self._holder_steps(node_id, activation, "already released")
        if isinstance(held, Decision):
            return held
        claim, lease, not_before = held
        previous = lease.renewed_at if lease is not None else claim.granted_at
        record = self._new_lease(activation, max(previous, at), not_before, released=True)
        self._write_lease(record)
        yield f"wrote lease-{activation} (released)"
        superseded = self._superseded(activation)
        yield f"looked for claims above {activation}"
        if superseded:  # the release came too late to matter, and harms nobody
            return _fenced(_superseded_reason(activation))
        why = f"{node_id} released activation {activation}"
        return Decision(Outcome.RELEASED, why, state=_state(claim, record))

    # --- bounds ---------------------------------------------------------------------------------

    def _prior_bound(
        self, claim: _Claim, lease: _LeaseRecord | None
    ) -> Generator[str, None, float]:
        """Until when a lease of an activation below `claim`'s may still be served (+ grace).

        The holder's lease file has the bound it learnt after its claim. Without one, the claim
        has its claimer's bound from before the claim; a takeover may have raced a renewal of
        the activation below, and only that one: its lease file shows it.
        """
        if self._relation(claim.host, raising=True) != "same":
            return _NEVER  # a previous boot: none of its processes runs
        bound = _or_never(claim.not_before)
        if lease is not None:
            if self._relation(lease.host, raising=True) != "same":
                return _NEVER
            return max(bound, _or_never(lease.not_before))
        if claim.kind == "takeover" and claim.activation > 1:
            older = self._read_lease(claim.activation - 1)
            yield f"read lease-{claim.activation - 1}"
            bound = max(bound, self._lease_end(older))
        return bound

    def _lease_end(self, lease: _LeaseRecord | None) -> float:
        """The end (+ our grace) of what this lease file lets its holder (and older ones) serve."""
        if lease is None or self._relation(lease.host, raising=True) != "same":
            return _NEVER
        bound = _or_never(lease.not_before)
        if not lease.released:  # a holder writes "released" only after it stopped serving
            bound = max(bound, lease.renewed_at + lease.lease + self._timing.grace)
        return bound

    # --- files ----------------------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        current = self._clock()
        if now is None:
            return current
        value = _check_seconds("now", now)
        if value > current:
            raise WitnessUsageError(
                f"now={value} is ahead of the clock ({current}): pass a time.monotonic() "
                f"reading taken before the call"
            )
        return value

    def _list(self) -> list[str]:
        return os.listdir(self._dir)

    def _find_highest(self) -> Generator[str, None, tuple[int | None, bool]]:
        """The highest claimed activation (None: the pair's first start), and the marker's presence.

        A listing may miss a name created while it runs, so a marker without claims is listed
        twice, and the names above the highest are probed one by one.
        """
        for attempt in range(2):
            claims, leases, marked = _parse_names(self._list())
            yield "listed the pair directory"
            if claims:
                break
            if not marked and not leases:
                return None, False
            if attempt == 1:
                evidence = f"{self.marker_path} shows this pair has claimed an activation"
                if leases:
                    evidence = f"{self.lease_path(max(leases))} exists"
                raise WitnessMissingError(self.activation_path(max(leases, default=1)), evidence)
        highest = max(claims)
        while os.path.lexists(self.activation_path(highest + 1)):
            highest += 1
        yield f"probed activation-{highest + 1}"
        orphans = [n for n in leases if n > highest]
        if orphans:
            raise WitnessMissingError(
                self.activation_path(max(orphans)), f"{self.lease_path(max(orphans))} exists"
            )
        return highest, marked

    def _read_current(self, activation: int) -> tuple[_Claim, _LeaseRecord | None]:
        claim = self._read_claim(activation)
        if claim is None:
            raise WitnessMissingError(self.activation_path(activation), "it was just listed")
        return claim, self._read_lease(activation)

    def _read_claim(self, activation: int) -> _Claim | None:
        path = self.activation_path(activation)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return _decode_claim(raw, path, activation)

    def _read_lease(self, activation: int) -> _LeaseRecord | None:
        path = self.lease_path(activation)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return _decode_lease(raw, path, activation)

    def _superseded(self, activation: int) -> bool:
        """Whether a claim above `activation` exists (a claim is made only above the highest;
        an operator's reset may skip numbers, which the listing catches)."""
        if os.path.lexists(self.activation_path(activation + 1)):
            return True
        claims, _leases, _marked = _parse_names(self._list())
        return any(n > activation for n in claims)

    def _temp_path(self, final: str) -> Path:
        ns = self._host.pid_ns or 0
        return self._dir / f".tmp-{ns}-{os.getpid()}-{secrets.token_hex(4)}-{final}"

    def _write_temp(self, final: str, data: bytes) -> Path:
        temp = self._temp_path(final)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self._durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return temp

    def _link_claim(self, claim: _Claim) -> bool:
        """Publish the claim under its name unless that name exists: exclusive and atomic."""
        final = self.activation_path(claim.activation)
        temp = self._write_temp(final.name, _encode_claim(claim))
        try:
            os.link(temp, final)
        except FileExistsError:
            return False
        finally:
            temp.unlink(missing_ok=True)
        if self._durable:
            sync_directory(self._dir)  # an activation number must never be reused
        return True

    def _write_lease(self, record: _LeaseRecord) -> None:
        # The content is fsynced before the rename, so a crash leaves the old lease or the new
        # one, never a torn file. The name is not: after a crash every lease is void anyway.
        final = self.lease_path(record.activation)
        temp = self._write_temp(final.name, _encode_lease(record))
        try:
            os.replace(temp, final)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def _mark(self) -> None:
        # After the first claim exists: a crash in between leaves a claim without marker
        # (healed later), never a marker without claim.
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            fd = os.open(self.marker_path, flags, PRIVATE_FILE)
        except FileExistsError:
            return
        try:
            os.write(fd, _MARKER)
            if self._durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if self._durable:
            sync_directory(self._dir)

    def _housekeep(self, activation: int) -> None:
        """Best effort, by the holder of `activation`: delete the files of activations below
        activation - KEEP_BEHIND, temporary files of exited writers, and heal the marker."""
        try:
            names = self._list()
            claims, leases, marked = _parse_names(names)
            if not marked:
                self._mark()
            floor = activation - KEEP_BEHIND
            for n in sorted(n for n in claims if n < floor):  # the claim first: a lone old
                self.activation_path(n).unlink(missing_ok=True)  # lease is ignored, never the
            for n in sorted(n for n in leases if n < floor):  # reverse (renew needs the claim)
                self.lease_path(n).unlink(missing_ok=True)
            ours = self._host.pid_ns or 0
            for name in names:
                match = _TEMP_RE.fullmatch(name)
                if match is None or int(match[1]) != ours or ours == 0:
                    continue
                pid = int(match[2])
                if pid != os.getpid() and not _process_runs(pid):
                    (self._dir / name).unlink(missing_ok=True)
        except OSError:
            pass

    # --- helpers --------------------------------------------------------------------------------

    def _new_claim(
        self,
        activation: int,
        holder: str | None,
        addrs: tuple[str, ...],
        granted_at: float,
        kind: Kind,
        not_before: float,
        *,
        holder_pid: int | None,
    ) -> _Claim:
        return _Claim(
            activation=activation,
            holder=holder,
            addresses=addrs,
            granted_at=granted_at,
            lease=self._timing.lease,
            holder_pid=holder_pid,
            kind=kind,
            not_before=None if not_before == _NEVER else not_before,
            host=self._host,
        )

    def _new_lease(
        self, activation: int, renewed_at: float, not_before: float, *, released: bool = False
    ) -> _LeaseRecord:
        return _LeaseRecord(
            activation=activation,
            renewed_at=renewed_at,
            lease=self._timing.lease,
            holder_pid=os.getpid(),
            released=released,
            not_before=None if not_before == _NEVER else not_before,
            host=self._host,
        )

    def _not_holder(self, claim: _Claim | None, node_id: str, activation: int) -> str | None:
        if claim is None:
            return f"{self.activation_path(activation)} does not exist: nobody holds it"
        if claim.holder != node_id:
            return f"activation {activation} names {claim.holder or 'nobody'}, not {node_id}"
        if self._relation(claim.host, raising=True) != "same":
            return f"activation {activation} dates from a previous boot"
        return None

    def _relation(self, *hosts: Host, raising: bool = False) -> _Relation:
        """How these writers' clocks compare with ours; the first one decides, any foreign one
        raises WitnessClockError when `raising`."""
        ours = self._host
        relations: list[_Relation] = []
        for host in hosts:
            if host.boot_id and ours.boot_id and host.boot_id != ours.boot_id:
                relations.append("previous_boot")
            elif host.clock_offset and ours.clock_offset and host.clock_offset != ours.clock_offset:
                if raising:
                    raise WitnessClockError(
                        f"a file in {self._dir} was written in this boot by a process whose "
                        f"CLOCK_MONOTONIC offset is {host.clock_offset!r}, ours is "
                        f"{ours.clock_offset!r} (another time namespace): leases cannot be "
                        f"compared; run both nodes in one time namespace"
                    )
                relations.append("foreign")
            else:
                relations.append("same")
        return relations[0]

    def _exited(self, pid: int | None, host: Host) -> bool:
        ours = self._host
        comparable = (
            pid is not None
            and bool(host.boot_id)
            and host.boot_id == ours.boot_id
            and host.pid_ns is not None
            and host.pid_ns == ours.pid_ns
        )
        return comparable and pid is not None and not _process_runs(pid)


def _state(claim: _Claim, lease: _LeaseRecord | None) -> WitnessState:
    released = claim.holder is None or (lease is not None and lease.released)
    source = lease if lease is not None else claim
    renewed_at = lease.renewed_at if lease is not None else claim.granted_at
    not_before = claim.not_before
    if lease is not None and lease.not_before is not None:
        not_before = max(lease.not_before, _or_never(not_before))
    return WitnessState(
        activation=claim.activation,
        holder=None if released else claim.holder,
        addresses=() if released else claim.addresses,
        renewed_at=renewed_at,
        lease=source.lease,
        holder_pid=None if released else source.holder_pid,
        boot_id=source.host.boot_id,
        clock_offset=source.host.clock_offset,
        pid_ns=source.host.pid_ns,
        kind=claim.kind,
        released=released,
        not_before=not_before,
    )


def _fenced(reason: str) -> Decision:
    return Decision(Outcome.FENCED, reason)


def _superseded_reason(activation: int) -> str:
    return f"activation {activation} was superseded: a higher activation has been claimed"


def _or_never(value: float | None) -> float:
    return _NEVER if value is None else value


def _parse_names(names: Sequence[str]) -> tuple[list[int], list[int], bool]:
    claims: list[int] = []
    leases: list[int] = []
    for name in names:
        if match := _CLAIM_RE.fullmatch(name):
            claims.append(int(match[1]))
        elif match := _LEASE_RE.fullmatch(name):
            leases.append(int(match[1]))
    return claims, leases, MARKER_NAME in names


# --- encoding -----------------------------------------------------------------------------------


def _host_fields(host: Host) -> dict[str, object]:
    return {"boot_id": host.boot_id, "clock_offset": host.clock_offset, "pid_ns": host.pid_ns}


def _encode_claim(claim: _Claim) -> bytes:
    return _seal(
        {
            "format": CLAIM_FORMAT,
            "version": FORMAT_VERSION,
            "activation": claim.activation,
            "holder": claim.holder,
            "addresses": list(claim.addresses),
            "granted_at": float(claim.granted_at),
            "lease": float(claim.lease),
            "holder_pid": claim.holder_pid,
            "kind": claim.kind,
            "not_before": None if claim.not_before is None else float(claim.not_before),
            **_host_fields(claim.host),
        }
    )


def _encode_lease(record: _LeaseRecord) -> bytes:
    return _seal(
        {
            "format": LEASE_FORMAT,
            "version": FORMAT_VERSION,
            "activation": record.activation,
            "renewed_at": float(record.renewed_at),
            "lease": float(record.lease),
            "holder_pid": record.holder_pid,
            "released": record.released,
            "not_before": None if record.not_before is None else float(record.not_before),
            **_host_fields(record.host),
        }
    )


def _seal(body: dict[str, object]) -> bytes:
    body["crc32"] = zlib.crc32(_canonical(body))
    return json.dumps(body, indent=2, sort_keys=True, allow_nan=False).encode() + b"\n"


def _canonical(body: dict[str, object]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number JSON allows")


class _Reader:
    """Checks the fields of one decoded file; every failure is a WitnessCorruptError."""

    def __init__(self, raw: bytes, path: Path, fmt: str, fields: frozenset[str]) -> None:
        self.path = path
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise self.bad(f"not JSON ({exc})") from None
        if not isinstance(body, dict):
            raise self.bad("not a JSON object")
        if body.get("format") != fmt or body.get("version") != FORMAT_VERSION:
            raise self.bad(f"not a {fmt} version {FORMAT_VERSION} file")
        if set(body) != fields | {"crc32"}:
            raise self.bad(f"fields {sorted(body)} differ from {sorted(fields | {'crc32'})}")
        crc = body.pop("crc32")
        if not _is_int(crc) or crc != zlib.crc32(_canonical(body)):
            raise self.bad("checksum mismatch")
        self.body: dict[str, object] = body

    def bad(self, reason: str) -> WitnessCorruptError:
        return WitnessCorruptError(self.path, reason)

    def activation(self, expected: int) -> int:
        value = self.body["activation"]
        if not _is_int(value) or value != expected:
            raise self.bad(f"activation {value!r} does not match the file name ({expected})")
        return expected

    def seconds(self, name: str, *, positive: bool = False, null: bool = False) -> float | None:
        value = self.body[name]
        if value is None and null:
            return None
        if not isinstance(value, float) or not math.isfinite(value) or (positive and value <= 0):
            raise self.bad(
                f"{name} {value!r} is not a {'positive' if positive else 'finite'} number"
            )
        return value

    def pid(self, name: str, *, null: bool) -> int | None:
        value = self.body[name]
        if value is None and null:
            return None
        if not _is_int(value) or not isinstance(value, int) or value <= 0:
            raise self.bad(f"{name} {value!r} is not a pid")
        return value

    def host(self) -> Host:
        boot_id, clock_offset, pid_ns = (
            self.body[k] for k in ("boot_id", "clock_offset", "pid_ns")
        )
        if not isinstance(boot_id, str) or not isinstance(clock_offset, str):
            raise self.bad("boot_id and clock_offset must be strings")
        if pid_ns is not None and (not _is_int(pid_ns) or not isinstance(pid_ns, int)):
            raise self.bad(f"pid_ns {pid_ns!r} is not an inode number")
        return Host(boot_id, clock_offset, pid_ns)


def _decode_claim(raw: bytes, path: Path, activation: int) -> _Claim:
    reader = _Reader(raw, path, CLAIM_FORMAT, _CLAIM_FIELDS)
    body = reader.body
    holder, addresses, kind = body["holder"], body["addresses"], body["kind"]
    if kind not in _KINDS:
        raise reader.bad(f"kind {kind!r} is not one of {_KINDS}")
    if holder is not None and (not isinstance(holder, str) or not holder):
        raise reader.bad(f"holder {holder!r} is neither null nor a node id")
    if not isinstance(addresses, list) or not all(isinstance(a, str) and a for a in addresses):
        raise reader.bad(f"addresses {addresses!r} is not a list of addresses")
    holder_pid = reader.pid("holder_pid", null=True)
    if (holder is None) != (kind == "reset"):
        raise reader.bad("only a reset claim has no holder, and it always has none")
    if kind in ("reset", "hand_over") and holder_pid is not None:
        raise reader.bad(f"a {kind} claim names a process")
    if holder is None and addresses:
        raise reader.bad("a claim without holder has addresses")
    granted_at = reader.seconds("granted_at")
    lease = reader.seconds("lease", positive=True)
    assert granted_at is not None
    assert lease is not None
    return _Claim(
        activation=reader.activation(activation),
        holder=holder,
        addresses=tuple(addresses),
        granted_at=granted_at,
        lease=lease,
        holder_pid=holder_pid,
        kind=kind,  # type: ignore[arg-type]  # checked against _KINDS above
        not_before=reader.seconds("not_before", null=True),
        host=reader.host(),
    )


def _decode_lease(raw: bytes, path: Path, activation: int) -> _LeaseRecord:
    reader = _Reader(raw, path, LEASE_FORMAT, _LEASE_FIELDS)
    released = reader.body["released"]
    if not isinstance(released, bool):
        raise reader.bad(f"released {released!r} is not a boolean")
    renewed_at = reader.seconds("renewed_at")
    lease = reader.seconds("lease", positive=True)
    holder_pid = reader.pid("holder_pid", null=False)
    assert renewed_at is not None
    assert lease is not None
    assert holder_pid is not None
    return _LeaseRecord(
        activation=reader.activation(activation),
        renewed_at=renewed_at,
        lease=lease,
        holder_pid=holder_pid,
        released=released,
        not_before=reader.seconds("not_before", null=True),
        host=reader.host(),
    )


# --- checks and system helpers ------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_node(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or value != value.strip():
        raise WitnessUsageError(
            f"{name} must be a non-empty node id without edge spaces: {value!r}"
        )


def _check_activation(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise WitnessUsageError(f"activation must be an integer >= 1, not {value!r}")


def _check_addresses(addresses: Sequence[str]) -> tuple[str, ...]:
    # A lone string is a Sequence[str] too; taking it letter by letter would be a silent bug.
    if isinstance(addresses, str | bytes):
        raise WitnessUsageError(f"addresses must be a list of addresses, not {addresses!r}")
    addrs = tuple(addresses)
    if not all(isinstance(a, str) and a for a in addrs):
        raise WitnessUsageError(f"addresses must be non-empty strings: {addrs!r}")
    return addrs


def _process_runs(pid: int) -> bool:
    """False only when the process with this pid can provably never run again."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False  # reaped between the two calls
    except OSError:
        return True
    # "pid (comm) S ...": comm may hold spaces and parentheses, so split at the last ")".
    # A zombie has exited and keeps its pid until reaped, so no other process can have it.
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")
