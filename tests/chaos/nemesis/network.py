"""The seeded nemesis on test hosts (``support.hosts``, ``docs/test-hosts.md``): every node and
etcd member in a network namespace of its own behind a router, so faults can be network faults.

A schedule is a list of ``HostStep``s drawn from one seed (``make_host_schedule``), so a failing
run replays with the same seed: the same faults on the same nodes and members after the same
delays (the system's own timing still varies). Kinds, drawn as from a bag (shuffled, refilled,
so every bag of ``len(HOST_KINDS)`` steps holds each kind once):

* ``kill``: SIGKILL to a node's process group, started again after ``down_s``;
* ``pause``: SIGSTOP / SIGCONT of a node (its lease lapses while it is frozen);
* ``isolate``: a full partition of one node from every other host (nodes, etcd, the client);
* ``split``: a minority of the nodes (1 of 3, 2 of 5) with one etcd member, against the rest
  with the other two members; the client is on neither side and reaches both, so both sides
  may try to acknowledge (with 5 nodes the minority holds an active and one of its replicas
  for several vbuckets: the split of issue 25's first loss);
* ``drop_out`` / ``drop_in``: one-way loss: what a node sends to the other nodes and etcd is
  dropped (it still hears them), or what they send to it;
* ``etcd_cut``: a node cut from every etcd member, not from its peers or the client;
* ``etcd_kill``: SIGKILL of one etcd member (``targets`` names it; ``-1``: whichever member is
  the raft leader when the step starts), started again after ``down_s`` (the nodes talking to
  it lose etcd meanwhile: a node takes one endpoint).

Steps do not overlap: each is healed before the next begins, after a gap.
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

from support.hosts import Host, HostCluster

from .history import FaultRecord
from .schedule import minority

NETWORK_KINDS = ("isolate", "split", "drop_out", "drop_in", "etcd_cut", "etcd_kill")
HOST_KINDS = ("kill", "pause", *NETWORK_KINDS)
DOWN_S = (1.0, 8.0)  # around the test hosts' lease (3 s): some faults outlast it, some not
GAP_S = (2.0, 5.0)
LEADER = -1  # etcd_kill of the member that leads when the step starts
RESTART_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class HostStep:
    """One fault: ``kind`` on ``targets`` (node indexes; for ``etcd_kill`` a member index or
    ``LEADER``; for ``split`` the minority's nodes then, last, its etcd member) for
    ``down_s`` seconds, ``gap_s`` after the previous step was healed."""

    gap_s: float
    kind: str
    targets: tuple[int, ...]
    down_s: float


def make_host_schedule(
    seed: int,
    *,
    nodes: int,
    members: int,
    duration_s: float,
    kinds: Sequence[str] = HOST_KINDS,
    down_s: tuple[float, float] = DOWN_S,
    gap_s: tuple[float, float] = GAP_S,
    first_gap_s: float = 2.0,
) -> list[HostStep]:
    """The steps filling about ``duration_s`` seconds of gaps and faults, from ``seed`` alone
    (fault lengths drawn from ``down_s``, gaps between them from ``gap_s``)."""
    assert nodes >= 3, "a fault needs a majority of the nodes left"
    assert set(kinds) <= set(HOST_KINDS), kinds
    rng = random.Random(seed)
    steps: list[HostStep] = []
    bag: list[str] = []
    elapsed = 0.0
    while elapsed < duration_s:  # bounded: every step adds at least GAP_S[0]
        gap = first_gap_s if not steps else rng.uniform(*gap_s)
        if not bag:
            bag = list(kinds)
            rng.shuffle(bag)
        kind = bag.pop()
        if kind == "etcd_kill":
            targets: tuple[int, ...] = (rng.choice([LEADER, *range(members)]),)
        elif kind == "split":
            side = tuple(sorted(rng.sample(range(nodes), minority(nodes))))
            targets = (*side, rng.randrange(members))
        else:
            targets = (rng.randrange(nodes),)
        down = rng.uniform(*down_s)
        steps.append(HostStep(round(gap, 2), kind, targets, round(down, 2)))
        elapsed += gap + down
    return steps


def describe_host(steps: Sequence[HostStep]) -> str:
    return "; ".join(f"+{s.gap_s}s {s.kind} {list(s.targets)} {s.down_s}s" for s in steps)


class HostNemesis:
    """Plays a schedule on a ``HostCluster`` (blocking: run it in a thread), recording each
    fault. ``stop`` ends it at the next step (the current fault is still healed); ``heal_all``
    heals the network, continues frozen nodes, starts stopped nodes and members, whatever
    happened (the test calls it in a ``finally``)."""

    def __init__(self, cluster: HostCluster, clock: float) -> None:
        self.cluster = cluster
        self.clock = clock  # time.monotonic() at the start of the run
        self.faults: list[FaultRecord] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._paused: set[int] = set()
        self._killed_member = 0  # the etcd member an etcd_kill step stopped
        self._lock = threading.Lock()  # heal_all may run while a step heals

    def now(self) -> float:
        return time.monotonic() - self.clock

    def stop(self) -> None:
        self._stop.set()

    def run(self, steps: Sequence[HostStep]) -> None:
        for step in steps:
            if self._stop.wait(step.gap_s):
                return
            at = self.now()
            try:
                names, note = self._inject(step)
            except Exception as error:  # recorded; the step is still healed
                names, note = (step.kind,), f"inject failed: {error!r}"
                self.errors.append(f"{step}: {note}")
            self._stop.wait(step.down_s)  # a stop request shortens the fault, never skips healing
            note += self._heal(step)
            self.faults.append(FaultRecord(step.kind, names, at, self.now(), note.strip()))

    def _node(self, i: int) -> Host:
        return self.cluster.node_hosts[i]

    def _inject(self, step: HostStep) -> tuple[tuple[str, ...], str]:
        cluster, network = self.cluster, self.cluster.network
        kind = step.kind
        if kind == "etcd_kill":
            member = step.targets[0]
            if member == LEADER:
                try:
                    member = cluster.etcd_leader()
                except LookupError:
                    member = 0
            cluster.etcd[member].kill()
            self._killed_member = member
            return (cluster.etcd_hosts[member].name,), ""
        if kind == "split":
            *side, member = step.targets
            small = [self._node(i) for i in side] + [cluster.etcd_hosts[member]]
            large = [h for h in [*cluster.node_hosts, *cluster.etcd_hosts] if h not in small]
            network.partition(small, large)
            return tuple(h.name for h in small), f"| {','.join(h.name for h in large)}"
        i = step.targets[0]
        host = self._node(i)
        others = [h for h in cluster.node_hosts if h != host]
        if kind == "kill":
            cluster.nodes[i].kill()
        elif kind == "pause":
            self._signal(i, signal.SIGSTOP)
            self._paused.add(i)
        elif kind == "isolate":
            network.isolate(host)
        elif kind == "drop_out":
            network.block([host], [*others, *cluster.etcd_hosts])
        elif kind == "drop_in":
            network.block([*others, *cluster.etcd_hosts], [host])
        elif kind == "etcd_cut":
            network.cut([host], cluster.etcd_hosts)
        else:
            raise AssertionError(f"unknown fault {kind!r}")
        return (host.name,), ""

    def _heal(self, step: HostStep) -> str:
        with self._lock:
            note = ""
            self.cluster.network.heal()
            if step.kind == "pause":
                for i in step.targets:
                    self._signal(i, signal.SIGCONT)
                    self._paused.discard(i)
            elif step.kind == "kill":
                note += self._start_node(step.targets[0])
            elif step.kind == "etcd_kill":
                note += self._start_member(self._killed_member)
            return note

    def _signal(self, i: int, sig: signal.Signals) -> None:
        node = self.cluster.nodes[i]
        if node.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, sig)  # the node's own process group (start_new_session)

    def _start_node(self, i: int) -> str:
        node = self.cluster.nodes[i]
        for attempt in range(RESTART_ATTEMPTS):
            if node.alive:
                return ""
            try:
                self.cluster.restart_node(i)
                return "" if attempt == 0 else f" n{i + 1} started at attempt {attempt + 1}"
            except RuntimeError as error:
                self.errors.append(f"n{i + 1} failed to start: {str(error)[-500:]}")
                time.sleep(1.0)
        return f" n{i + 1} DID NOT START"

    def _start_member(self, member: int) -> str:
        server = self.cluster.etcd[member]
        for attempt in range(RESTART_ATTEMPTS):
            if server.alive:
                return ""
            try:
                self.cluster.restart_etcd(member)
                return "" if attempt == 0 else f" e{member + 1} started at attempt {attempt + 1}"
            except (RuntimeError, TimeoutError) as error:
                self.errors.append(f"e{member + 1} failed to start: {str(error)[-500:]}")
                time.sleep(1.0)
        return f" e{member + 1} DID NOT START"

    def heal_all(self) -> None:
        """Heal the network, continue every frozen node, start every stopped node and member."""
        with self._lock:
            self.cluster.network.heal()
            for i in sorted(self._paused):
                self._signal(i, signal.SIGCONT)
            self._paused.clear()
        for member, server in enumerate(self.cluster.etcd):
            if not server.alive:
                self._start_member(member)
        for i, node in enumerate(self.cluster.nodes):
            if not node.alive:
                self._start_node(i)
