"""Faults, drawn from the seed or written down as a scenario, and how each is applied and healed.

A `Fault` is a value (kind, start, duration, targets, amount) with a short text form
(`crash:n1@2.50+1.20`), so a failing schedule prints, shrinks (drop one fault at a time) and
replays (`--faults`). Kinds:

| kind        | targets            | effect while it lasts                                      |
|-------------|--------------------|------------------------------------------------------------|
| crash       | a node             | kill -9 at start (memory lost), restarted at the end       |
| pause       | a node             | processes nothing; its timers and messages run late        |
| isolate     | a node             | cut from every other endpoint, both ways                   |
| oneway      | a, b               | a → b is cut (b still reaches a)                          |
| split       | one side's members | everything across the two sides is cut (minority/majority) |
| cut_etcd    | a node             | the node and the metadata store cannot reach each other    |
| lease       | a node             | etcd loses the node's lease at start (its keys go)         |
| slow_disk   | a node             | each flush waits `amount` seconds more                     |
| slow_link   | a, b               | `amount` seconds more on a → b and b → a                   |
| reorder     | -                  | datagrams get up to `amount` seconds of jitter             |
| duplicate   | -                  | datagrams are sent twice with probability `amount`         |
| drop        | -                  | datagrams are lost with probability `amount`               |
"""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING

from . import metastore

if TYPE_CHECKING:
    from .cluster import SimCluster

KINDS = (
    "crash", "pause", "isolate", "oneway", "split", "cut_etcd", "lease",
    "slow_disk", "slow_link", "reorder", "duplicate", "drop",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    start_s: float
    duration_s: float
    targets: tuple[str, ...] = ()
    amount: float = 0.0

    def __str__(self) -> str:
        text = f"{self.kind}:{','.join(self.targets)}@{self.start_s:.2f}+{self.duration_s:.2f}"
        return text + (f"*{self.amount:g}" if self.amount else "")

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, rest = text.split(":", 1)
        targets, rest = rest.split("@", 1)
        amount = 0.0
        if "*" in rest:
            rest, amount_text = rest.split("*", 1)
            amount = float(amount_text)
        start, duration = rest.split("+", 1)
        names = tuple(t for t in targets.split(",") if t)
        return cls(kind, float(start), float(duration), names, amount)


def random_faults(
    rng: random.Random,
    nodes: list[str],
    clients: list[str],
    window_s: float,
    count_max: int = 4,
    victim: tuple[str, ...] = (),
) -> list[Fault]:
    """Up to `count_max` faults inside [0, window_s), drawn from `rng`.

    Swarm testing (as FoundationDB and TigerBeetle do): each schedule enables a few kinds
    only, and most faults aim at the copies of one `victim` vbucket chain, so that the
    combinations that lose data (a replica lagging while the others go away) are common.
    Durations are short (a blip) or longer than a lease (a failover follows).
    """
    kinds = rng.sample(KINDS, rng.randint(2, 5))
    faults: list[Fault] = []
    for _ in range(rng.randint(1, count_max)):
        kind = rng.choice(kinds)
        start = round(rng.uniform(0.0, window_s * 0.7), 2)
        longest = max(0.3, window_s - start)
        if rng.random() < 0.5:
            duration = round(rng.uniform(0.2, min(1.5, longest)), 2)
        else:
            duration = round(rng.uniform(min(2.5, longest * 0.8), min(4.5, longest)), 2)
        pool = list(victim) if victim and rng.random() < 0.75 else nodes
        node = rng.choice(pool)
        if kind in ("oneway", "slow_link"):
            a = node
            b = rng.choice([n for n in [*pool, *nodes, metastore.ENDPOINT] if n != a])
            amount = round(rng.uniform(0.005, 0.2), 3) if kind == "slow_link" else 0.0
            faults.append(Fault(kind, start, duration, (a, b), amount))
        elif kind == "split":
            size = rng.randint(1, max(1, len(nodes) // 2))
            side = sorted({node, *rng.sample(nodes, size)})[: max(1, len(nodes) // 2)]
            if node not in side:
                side[0] = node
            side += rng.sample(clients, rng.randint(0, len(clients)))
            if rng.random() < 0.3:
                side.append(metastore.ENDPOINT)
            faults.append(Fault(kind, start, duration, tuple(sorted(set(side)))))
        elif kind == "slow_disk":
            faults.append(Fault(kind, start, duration, (node,), round(rng.uniform(0.02, 0.5), 3)))
        elif kind == "reorder":
            faults.append(Fault(kind, start, duration, (), round(rng.uniform(0.005, 0.05), 3)))
        elif kind in ("duplicate", "drop"):
            faults.append(Fault(kind, start, duration, (), round(rng.uniform(0.01, 0.2), 3)))
        else:
            faults.append(Fault(kind, start, duration, (node,)))
    return sorted(faults, key=lambda f: (f.start_s, str(f)))


def template_faults(
    rng: random.Random, nodes: list[str], clients: list[str], window_s: float,
    victim: tuple[str, ...],
) -> list[Fault]:  # fmt: skip
    """A random instance of a pattern known to be dangerous, aimed at the `victim` chain
    (active first): the timings, sides and extra noise come from `rng`.

    - split: the active and one replica (and some clients) cut from the rest and etcd;
    - etcd_cut: the active cut from the metadata store only;
    - lag_then_fail: one replica falls behind (cut from the active one way, paused, or on a
      slow link), then the active and the other replicas go away for longer than a lease.
    """
    active, replicas = victim[0], list(victim[1:])
    start = round(rng.uniform(0.2, 1.0), 2)
    long_s = round(rng.uniform(3.0, max(3.0, window_s - start - 0.2)), 2)
    pattern = rng.choice(("split", "etcd_cut", "lag_then_fail"))
    faults: list[Fault] = []
    if pattern == "split" and replicas:
        side = {active, rng.choice(replicas), *rng.sample(clients, rng.randint(1, len(clients)))}
        faults.append(Fault("split", start, long_s, tuple(sorted(side))))
    elif pattern == "lag_then_fail" and len(replicas) >= 2:
        lagging, others = replicas[-1], replicas[:-1]
        how = rng.choice(("oneway", "pause", "slow_link"))
        lag_s = round(long_s + 2.0, 2)
        if how == "oneway":
            faults.append(Fault("oneway", start, lag_s, (active, lagging)))
        elif how == "pause":
            faults.append(Fault("pause", start, round(rng.uniform(2.5, 3.5), 2), (lagging,)))
        else:
            faults.append(Fault("slow_link", start, lag_s, (active, lagging), 0.5))
        later = round(start + rng.uniform(2.5, 3.5), 2)
        gone_s = round(max(2.6, window_s - later), 2)
        for node in [active, *others]:
            faults.append(Fault(rng.choice(("crash", "isolate")), later, gone_s, (node,)))
    else:
        faults.append(Fault("cut_etcd", start, long_s, (active,)))
    if rng.random() < 0.5:  # noise the pattern does not need (shrinking drops it)
        faults.extend(random_faults(rng, nodes, clients, window_s, 1, victim))
    return sorted(faults, key=lambda f: (f.start_s, str(f)))


class FaultInjector:
    """Schedules each fault's start and end on the cluster; `heal_all` ends every one."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.active: dict[int, Fault] = {}

    def schedule(self, faults: list[Fault], offset_s: float) -> None:
        sched = self.cluster.sched
        for index, fault in enumerate(faults):
            sched.at(offset_s + fault.start_s, self._begin, index, fault)
            sched.at(offset_s + fault.start_s + fault.duration_s, self._end, index)

    def heal_all(self) -> None:
        for index in sorted(self.active):
            self._end(index)

    def _endpoints(self) -> list[str]:
        c = self.cluster
        return [*sorted(c.nodes_by_name), *sorted(c.clients_by_name), metastore.ENDPOINT]

    def _pairs(self, fault: Fault) -> list[tuple[str, str]]:
        """The directed links a partition fault cuts."""
        kind, targets = fault.kind, fault.targets
        if kind == "isolate":
            return [p for o in self._endpoints() if o != targets[0] for p in
                    ((targets[0], o), (o, targets[0]))]  # fmt: skip
        if kind == "oneway":
            return [(targets[0], targets[1])]
        if kind == "cut_etcd":
            return [(targets[0], metastore.ENDPOINT), (metastore.ENDPOINT, targets[0])]
        if kind == "split":
            side = set(targets)
            others = [e for e in self._endpoints() if e not in side]
            return [p for a in sorted(side) for b in others for p in ((a, b), (b, a))]
        return []

    def _begin(self, index: int, fault: Fault) -> None:
        c = self.cluster
        self.active[index] = fault
        c.sched.record("fault", str(fault))
        faults = c.net.faults
        kind = fault.kind
        if kind == "crash":
            c.nodes_by_name[fault.targets[0]].crash()
        elif kind == "pause":
            c.nodes_by_name[fault.targets[0]].pause(fault.duration_s)
        elif kind in ("isolate", "oneway", "cut_etcd", "split"):
            for pair in self._pairs(fault):
                faults.cut[pair] += 1
            c.net.cut_changed()
        elif kind == "lease":
            node = c.nodes_by_name[fault.targets[0]]
            if node.up and node.agent.lease:
                c.meta.revoke(node.agent.lease)
        elif kind == "slow_disk":
            c.nodes_by_name[fault.targets[0]].disk_delay_s = fault.amount
        elif kind == "slow_link":
            a, b = fault.targets
            for pair in ((a, b), (b, a)):
                faults.extra_delay_s[pair] = faults.extra_delay_s.get(pair, 0.0) + fault.amount
        elif kind == "reorder":
            faults.jitter_s = max(faults.jitter_s, fault.amount)
        elif kind == "duplicate":
            faults.duplicate_p = max(faults.duplicate_p, fault.amount)
        elif kind == "drop":
            faults.drop_p = max(faults.drop_p, fault.amount)

    def _end(self, index: int) -> None:
        fault = self.active.pop(index, None)
        if fault is None:
            return
        c = self.cluster
        c.sched.record("heal", str(fault))
        faults = c.net.faults
        kind = fault.kind
        if kind == "crash":
            node = c.nodes_by_name[fault.targets[0]]
            if not node.up:
                node.start()
        elif kind == "pause":
            node = c.nodes_by_name[fault.targets[0]]
            node.paused_until = min(node.paused_until, c.sched.now)
        elif kind in ("isolate", "oneway", "cut_etcd", "split"):
            for pair in self._pairs(fault):
                faults.cut[pair] -= 1
                if faults.cut[pair] <= 0:
                    del faults.cut[pair]
        elif kind == "slow_disk":
            c.nodes_by_name[fault.targets[0]].disk_delay_s = 0.0
        elif kind == "slow_link":
            a, b = fault.targets
            for pair in ((a, b), (b, a)):
                faults.extra_delay_s[pair] = max(0.0, faults.extra_delay_s[pair] - fault.amount)
        elif kind == "reorder":
            faults.jitter_s = 0.0
        elif kind == "duplicate":
            faults.duplicate_p = 0.0
        elif kind == "drop":
            faults.drop_p = 0.0
