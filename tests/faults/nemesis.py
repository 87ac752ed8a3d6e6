"""A randomized fault schedule against the pair, in the spirit of Jepsen's nemesis.

``schedule(seed, duration)`` draws a sequence of faults from a seeded generator: each step
says when it starts (seconds after the traffic began), which fault, and how long it is held
before it is healed. The same seed and duration give the same schedule, always: replaying a
failing run (HAFAILOVER_CHAOS_SEED=N) repeats the faults in the same order with the same
holds, not the same timing of the traffic around them.

The faults, each aimed at whichever node is live when it starts:

- ``kill``: SIGKILL; healed by a restart (the node rejoins as backup, then fails back);
- ``pause``: SIGSTOP; healed by SIGCONT (a live past its lease fences itself);
- ``black-hole``: every client's packets to and from the live dropped;
- ``reject``: every client's packets to the live answered with a TCP reset;
- ``isolate``: the live cut off from the backup and every client;
- ``one-way-in`` / ``one-way-out``: only the clients' packets to the live, or only the
  live's packets to the clients, dropped;
- ``replication``: live and backup cut off from each other, the clients see both.

``Nemesis.run`` applies the schedule, and before each fault waits (boundedly) for the pair
to be whole again: live, and a synchronized backup. It never touches anything but the
pair's processes (by pid) and the test network's namespaces.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import attrs

from reference_broker import BrokerPair
from reference_broker.pair import NodeProcess, PairError

from .netns import Network

__all__ = ["FAULTS", "Nemesis", "Step", "schedule"]

FAULTS = (
    "kill",
    "pause",
    "black-hole",
    "reject",
    "isolate",
    "one-way-in",
    "one-way-out",
    "replication",
)
HOLD = (0.5, 3.0)  # seconds a fault is held, drawn uniformly
QUIET = (1.0, 3.0)  # seconds of calm after a heal
SETTLE = 60.0  # seconds a pair may take to be live with a synchronized backup after a heal


@attrs.frozen
class Step:
    at: float
    fault: str
    hold: float

    def __str__(self) -> str:
        return f"t+{self.at:5.1f}s {self.fault:<12} held {self.hold:.1f}s"


def schedule(seed: int, duration: float) -> list[Step]:
    """The faults of a run of ``duration`` seconds, from ``seed``."""
    if duration <= 0:
        raise ValueError(f"duration {duration}: must be positive")
    rng = random.Random(seed)
    steps = []
    at = rng.uniform(*QUIET)
    while True:
        hold = round(rng.uniform(*HOLD), 2)
        if at + hold > duration:
            break
        steps.append(Step(round(at, 2), rng.choice(FAULTS), hold))
        at += hold + rng.uniform(*QUIET)
    return steps


class Nemesis:
    """Applies a schedule to ``pair`` on ``network`` (clients on ``clients``)."""

    def __init__(
        self,
        pair: BrokerPair,
        network: Network,
        clients: list[str],
        log: Callable[[str], None] = print,
    ) -> None:
        self.pair = pair
        self.network = network
        self.clients = clients
        self.log = log
        self.applied: list[tuple[Step, str, float]] = []  # (step, victim, when)
        self.settle_times: list[float] = []  # how long the pair took to be whole again

    def run(self, steps: list[Step], started: float) -> None:
        """Apply ``steps``; each starts at its time after ``started``, or once the pair is
        whole again if that takes longer (then the rest of the schedule moves later)."""
        lag = 0.0
        for step in steps:
            lag += self._settle()
            delay = started + lag + step.at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            victim = self.pair.live
            self.log(f"nemesis: {step} on {victim.name}")
            heal = self._apply(step.fault, victim)
            self.applied.append((step, victim.name, time.monotonic()))
            try:
                time.sleep(step.hold)
            finally:
                heal()
        self._settle()

    def _settle(self) -> float:
        """Wait until the pair is live with a synchronized backup; how long it took. A pair
        that is not whole again within SETTLE seconds of a heal is a failure."""
        began = time.monotonic()
        try:
            self.pair.wait_synchronized(SETTLE)
        except PairError as exc:
            raise AssertionError(
                f"the pair was not whole again {SETTLE}s after the last heal "
                f"({self.applied[-1:]}): {exc}\n{_tails(self.pair)}"
            ) from exc
        took = time.monotonic() - began
        self.settle_times.append(took)
        return took

    def _apply(self, fault: str, victim: NodeProcess) -> Callable[[], None]:
        pair, network = self.pair, self.network
        other = pair.nodes[1] if victim is pair.nodes[0] else pair.nodes[0]
        if fault == "kill":
            pair.kill(victim)
            return lambda: pair.restart(victim)
        if fault == "pause":
            pair.pause(victim)
            return lambda: pair.resume(victim)
        if fault in ("black-hole", "reject"):
            for client in self.clients:
                network.partition(client, victim.name, reject=fault == "reject")
        elif fault == "isolate":
            network.isolate(victim.name)
        elif fault == "one-way-in":
            for client in self.clients:
                network.block(client, victim.name)
        elif fault == "one-way-out":
            for client in self.clients:
                network.block(victim.name, client)
        elif fault == "replication":
            network.partition(victim.name, other.name)
        else:
            raise ValueError(f"unknown fault {fault!r}; the faults are {FAULTS}")
        return network.heal


def _tails(pair: BrokerPair, lines: int = 15) -> str:
    out = []
    for node in pair.nodes:
        try:
            text = node.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            text = [f"(no log: {exc})"]
        out.append(f"--- {node.name} {node.status()} ---\n" + "\n".join(text))
    return "\n".join(out)
