"""The two losses of issue 25 ("Partitions") as written schedules.

- `split`: 5 nodes, 2 replicas. An active and one of its replicas (n0 and the first replica
  of n0's first vbucket) with client c0 are split from the other nodes, the metadata store
  and client c1 for longer than a lease: c0 keeps writing durably to the cut-off pair, the
  orchestrator fails n0 over to the third copy on the strength of an in-sync record written
  before the cut, and when the split heals the pair rolls back to the new active.
- `etcd_cut`: 3 nodes, 2 replicas. The active n1 (not the orchestrator: n0 is elected first)
  is cut from the metadata store only; its peers and the clients still reach it. It keeps
  serving until it applies a newer map, which it cannot read; the orchestrator promotes
  another copy while the third still follows n1 and acknowledges its writes.

Found by the simulator on the fencing rules (fae8c28), random seed 611:

- `restart_before_map`: 5 nodes, 2 replicas. The active n1 crashes for 0.34 s and is failed
  over meanwhile (its crash confirmed by refused connections). When it restarts, its
  vbuckets come back in the state the store kept (ACTIVE) and it serves them before it has
  read a map: the commit rule counts a chain of one (no map: no replicas) and no in-sync
  keeper requires anything, so a client still routing by the old map gets durable writes
  acknowledged by n1 alone, which roll back once n1 applies the map that made it a replica.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from changefeed.cluster import placement

from .cluster import SimConfig
from .faults import Fault

BUSY_S = (0.005, 0.04)  # clients' think time: busy, so writes fall inside the loss windows


def split() -> tuple[SimConfig, list[Fault]]:
    config = SimConfig(
        nodes=5, replicas=2, vbuckets=5, clients=2, work_s=6.0, think_s=(0.02, 0.1), settle_s=7.0
    )
    chain = placement.chains(config.nodes, config.replicas, config.vbuckets)[0]
    side = (f"n{chain[0]}", f"n{chain[1]}", "c0")
    return config, [Fault("split", 0.5, 4.5, tuple(sorted(side)))]


def etcd_cut() -> tuple[SimConfig, list[Fault]]:
    config = SimConfig(
        nodes=3, replicas=2, vbuckets=4, clients=2, work_s=6.0, think_s=BUSY_S, settle_s=7.0
    )
    return config, [Fault("cut_etcd", 0.5, 4.5, ("n1",))]


def restart_before_map() -> tuple[SimConfig, list[Fault]]:
    """Random seed 611's schedule: one short crash of an active."""
    config = SimConfig(
        nodes=5, replicas=2, vbuckets=5, clients=3, think_s=(0.03, 0.12), settle_s=6.0
    )
    return config, [Fault.parse("crash:n1@1.92+0.34")]


def promoted_while_dead() -> tuple[SimConfig, list[Fault]]:
    """3 nodes, 2 replicas; vb 1's chain is n1, n2, n0 and n0 orchestrates. n0 cannot reach
    n2 (its crash probes time out: not confirmed), n2's disk is slow (it acknowledges from
    memory well before it persists) and n0 lags n1 a little (n2 publishes the higher seqno).
    n1 and n2 crash together: n1's crash is confirmed and it is failed over to n2, whose
    lease still runs; n2 restarts after the map landed and its old lease ran out."""
    config = SimConfig(
        nodes=3, replicas=2, vbuckets=4, clients=2, think_s=BUSY_S, work_s=6.0, settle_s=7.0
    )
    return config, [
        Fault.parse(text)
        for text in (
            "slow_disk:n2@1.00+1.00*1.5",
            "slow_link:n1,n0@1.00+1.00*0.1",
            "oneway:n0,n2@1.95+0.85",
            "crash:n1@2.00+3.50",
            "crash:n2@2.00+0.80",
        )
    ]


def crash_race_faults(
    rng: random.Random, config: SimConfig, orchestrator: str = "n0"
) -> list[Fault]:
    """A random instance of `promoted_while_dead` for the random seeds (cluster.run): on a
    chain whose active and first replica are not `orchestrator`, the replica's disk is slow
    and the third copy lags, the orchestrator loses its way to the replica just before the
    active and the replica crash together, and the replica restarts after its failover."""
    chains = [
        chain
        for chain in placement.chains(config.nodes, config.replicas, config.vbuckets)
        if len(chain) > 2 and orchestrator not in (f"n{chain[0]}", f"n{chain[1]}")
    ]
    if not chains:
        return []
    active, replica, third = (f"n{i}" for i in rng.choice(chains)[:3])
    crash = round(rng.uniform(1.5, 3.0), 2)
    slow = round(rng.uniform(0.8, 1.2), 2)
    back = round(rng.uniform(0.6, 1.0), 2)
    before = round(crash - slow, 2)
    return [
        Fault("slow_disk", before, slow, (replica,), round(rng.uniform(1.0, 2.0), 2)),
        Fault("slow_link", before, slow, (active, third), round(rng.uniform(0.05, 0.15), 3)),
        Fault("oneway", round(crash - 0.05, 2), round(back + 0.05, 2), (orchestrator, replica)),
        Fault("crash", crash, round(rng.uniform(2.5, 3.5), 2), (active,)),
        Fault("crash", crash, back, (replica,)),
    ]  # fmt: skip


SCENARIOS: dict[str, Callable[[], tuple[SimConfig, list[Fault]]]] = {
    "split": split,
    "etcd_cut": etcd_cut,
    "restart_before_map": restart_before_map,
    "promoted_while_dead": promoted_while_dead,
}
