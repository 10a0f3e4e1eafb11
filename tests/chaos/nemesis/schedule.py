"""The seeded fault schedule and the nemesis that plays it on node processes.

A schedule is a list of ``Step``s drawn from one seed, so a failing run replays with the same
seed (``CHANGEFEED_CHAOS_SEED``): the same faults on the same nodes after the same delays. The
timing of the system under test still varies; the schedule does not.

Faults (Jepsen's ``kill`` and ``pause`` nemeses):

* ``kill``: SIGKILL to the node's process group (nothing flushed), down for a while, started
  again on the same port and data (a restart after a crash);
* ``restart``: SIGTERM (a clean stop: flush, clean-shutdown flag), down, started again;
* ``pause``: SIGSTOP, then SIGCONT — the process holds its sockets and its etcd lease lapses,
  so it may be failed over while frozen and wake up believing it is still active.

Targets: ``one`` picks one node per step (schedule A); ``minority`` a minority together
(schedule B: (n-1)//2 nodes — 1 of 3, 2 of 5). Downtimes are drawn around the failover
timeout, so some faults end before the lease lapses (no failover: the node comes back as
it was) and some after (failover, then rejoin as a replica with a rollback). Steps do not
overlap: each is healed before the next starts, after a gap that lets the cluster catch up.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from changefeed.cli.node_process import NodeProcess

from .history import FaultRecord

Kind = Literal["kill", "restart", "pause"]
Targets = Literal["one", "minority"]
# Drawn as from a bag, shuffled and refilled: every five steps hold each kind, kill and
# pause twice as often as a clean restart.
KINDS: tuple[Kind, ...] = ("kill", "kill", "restart", "pause", "pause")
DOWN_S = (0.5, 8.0)  # how long a node stays down or frozen
GAP_S = (2.0, 6.0)  # healthy time between two faults
RESTART_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Step:
    """One fault: ``kind`` on the nodes at ``targets`` (indexes) for ``down_s`` seconds,
    ``gap_s`` seconds after the previous step was healed."""

    gap_s: float
    kind: Kind
    targets: tuple[int, ...]
    down_s: float


def minority(count: int) -> int:
    """The largest minority of ``count`` nodes (1 of 3, 2 of 5)."""
    return (count - 1) // 2


def make_schedule(
    seed: int, *, nodes: int, duration_s: float, targets: Targets, first_gap_s: float = 3.0
) -> list[Step]:
    """The steps filling about ``duration_s`` seconds (gaps plus downtimes; restarts add
    their own start-up time when played), drawn from ``seed`` alone."""
    assert nodes >= 3, "one fault at a time needs a majority left"
    rng = random.Random(seed)
    size = 1 if targets == "one" else minority(nodes)
    steps: list[Step] = []
    bag: list[Kind] = []
    elapsed = 0.0
    while elapsed < duration_s:
        gap = first_gap_s if not steps else rng.uniform(*GAP_S)
        if not bag:
            bag = list(KINDS)
            rng.shuffle(bag)
        kind = bag.pop()
        chosen = tuple(sorted(rng.sample(range(nodes), size)))
        down = rng.uniform(*DOWN_S)
        steps.append(Step(round(gap, 2), kind, chosen, round(down, 2)))
        elapsed += gap + down
    return steps


def describe(steps: Sequence[Step]) -> str:
    return "; ".join(f"+{s.gap_s}s {s.kind} {list(s.targets)} {s.down_s}s" for s in steps)


class Nemesis:
    """Plays a schedule on ``nodes`` (blocking: run it in a thread), recording each fault.

    ``stop`` ends it at the next step (the current fault is still healed); ``heal_all``
    continues frozen nodes and starts stopped ones, whatever happened — the test calls it in a
    ``finally`` so the fixtures can stop every node by pid (a frozen process ignores SIGTERM).
    """

    def __init__(self, nodes: Sequence[NodeProcess], names: Sequence[str], clock: float) -> None:
        self.nodes = list(nodes)
        self.names = list(names)
        self.clock = clock  # time.monotonic() at the start of the run
        self.faults: list[FaultRecord] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._paused: set[int] = set()

    def now(self) -> float:
        return time.monotonic() - self.clock

    def stop(self) -> None:
        self._stop.set()

    def run(self, steps: Sequence[Step]) -> None:
        for step in steps:
            if self._stop.wait(step.gap_s):
                return
            at = self.now()
            note = self._inject(step)
            self._stop.wait(step.down_s)  # a stop request shortens the fault, never skips healing
            note += self._heal(step)
            names = tuple(self.names[i] for i in step.targets)
            self.faults.append(FaultRecord(step.kind, names, at, self.now(), note.strip()))

    def _inject(self, step: Step) -> str:
        note = ""
        for i in step.targets:
            node = self.nodes[i]
            if step.kind == "kill":
                node.kill()
            elif step.kind == "restart":
                try:
                    node.stop(timeout_s=30.0, check=False)
                except TimeoutError:  # it was killed instead
                    note += f" {self.names[i]} ignored SIGTERM (killed)"
            else:
                self._signal(i, signal.SIGSTOP)
                self._paused.add(i)
        return note

    def _heal(self, step: Step) -> str:
        note = ""
        for i in step.targets:
            if step.kind == "pause":
                self._signal(i, signal.SIGCONT)
                self._paused.discard(i)
            else:
                note += self._start(i)
        return note

    def _signal(self, i: int, sig: signal.Signals) -> None:
        node = self.nodes[i]
        if node.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, sig)  # the node's own process group (start_new_session)

    def _start(self, i: int) -> str:
        """Start a stopped node again; a start that fails is retried, then recorded."""
        node = self.nodes[i]
        for attempt in range(RESTART_ATTEMPTS):
            if node.alive:
                return ""
            try:
                node.start()
                return "" if attempt == 0 else f" {self.names[i]} started at attempt {attempt + 1}"
            except RuntimeError as error:
                self.errors.append(f"{self.names[i]} failed to start: {str(error)[-500:]}")
                time.sleep(1.0)
        return f" {self.names[i]} DID NOT START"

    def heal_all(self) -> None:
        """Continue every frozen node, start every stopped one."""
        for i in sorted(self._paused):
            self._signal(i, signal.SIGCONT)
        self._paused.clear()
        for i, node in enumerate(self.nodes):
            if not node.alive:
                self._start(i)
