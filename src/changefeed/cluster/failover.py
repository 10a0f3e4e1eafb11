"""Failover and rejoin as a pure function of the map, the live nodes and the in-sync sets.

The orchestrator calls `plan_failover` whenever the live set changes. For each vbucket whose
active is gone (its lease expired, or an operator named it in `changefeed cluster failover`):
- promote, among its replicas that are live, one that was in the dead active's last published
  in-sync set (Kafka: only an ISR member may lead; unclean election loses data by design), the
  one with the highest seqno;
- if none was in sync, leave the vbucket as it is (unavailable until its active returns) and
  say why — unless forced, then
  take the live replica with the highest seqno and accept that writes it never received are
  lost (consumers are told by the rollback that follows);
- keep the vbucket's other replicas, live or not (a replica that is down resumes when it
  returns); the failed active becomes the last replica.
Rejoin: the failed active keeps a replica slot in the vbuckets it led, so a node that comes
back is their replica again and catches up (its replica streams roll back to the common
history first); meanwhile no other node is given a copy to make. Free (-1) slots — a map made
when there were fewer nodes than copies — go to live nodes that hold no copy of the vbucket.

Sans-IO: everything it reads is passed in; the orchestrator fetches it from etcd.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Set

from changefeed.vbmap import ClusterMap


@dataclasses.dataclass(frozen=True, slots=True)
class InSyncRecord:
    """What an active last published for one vbucket (etcd ``insync/<vb>``): its name and the
    replicas that were in sync then."""

    active: str
    members: frozenset[str]


@dataclasses.dataclass(frozen=True, slots=True)
class FailoverPlan:
    """The next map (None: no change) and what happened per vbucket, for logs and the CLI."""

    new_map: ClusterMap | None
    promoted: dict[int, str]
    refused: dict[int, str]
    rejoined: dict[int, str]
    # Of `promoted`, the vbuckets given back to the active that wrote their record, after the
    # node made active since declined them and no member was promotable: that active's
    # commits were persisted before they were acknowledged, so its copy holds them if its
    # disk still holds its branch — which it judges itself (its activation is stored on the
    # record's revision: rules.refuses_activation).
    reinstated: dict[int, str] = dataclasses.field(default_factory=dict)


def plan_failover(
    current: ClusterMap,
    live: Set[str],
    in_sync: Mapping[int, InSyncRecord],
    high_seqnos: Mapping[str, Mapping[int, int]],
    *,
    failed: Set[str] = frozenset(),
    force: bool = False,
    hold: Set[str] = frozenset(),
    refusals: Mapping[int, str] | None = None,
) -> FailoverPlan:
    """Plan promotions for vbuckets whose active is not live (or is in `failed`), and rejoins.

    Args:
        current: the map now.
        live: names of the nodes whose lease is alive.
        in_sync: per vbucket, the last in-sync set its active published.
        high_seqnos: per live node, its high seqno per vbucket (its published status).
        failed: nodes an operator asked to fail over although they may be live.
        force: promote a replica that was not in sync when no in-sync one is live.
        hold: nodes that are not live but must not be failed over yet (the orchestrator's
            guards); their actives stay, and they are not given slots.
        refusals: per vbucket, the node that refused to become its active (its process
            registered after the activation: rules.refuses_activation) and asked for this
            vbucket's failover; it counts as failed for that vbucket only, and is never
            promoted back by this plan. The record may then be an earlier active's: the node
            wrote none since it never acted, and an active that wrote none required every
            replica placed with it (rules.InSyncKeeper), so each member still holds every
            write either committed. With no record at all (no active ever wrote one: a node
            restarted before it applied the first map) every live replica is eligible.
    """
    refusals = refusals or {}
    names = [n.name for n in current.nodes]
    usable = {n for n in live if n not in failed}
    # Actives each node leads (kept or promoted so far): between replicas equally caught up,
    # the one leading fewest takes the vbucket, so a dead node's load is spread, not piled
    # onto the first survivor.
    leading = [0] * len(names)
    for chain in current.chains:
        if chain[0] != -1 and names[chain[0]] in usable:
            leading[chain[0]] += 1
    chains: list[tuple[int, ...]] = []
    promoted: dict[int, str] = {}
    refused: dict[int, str] = {}
    rejoined: dict[int, str] = {}
    reinstated: dict[int, str] = {}
    for vb, chain in enumerate(current.chains):
        active = chain[0]
        # Replicas stay in the chain while down (they resume when back).
        replicas = [i for i in chain[1:] if i != -1]
        declined = active != -1 and names[active] == refusals.get(vb)
        if active != -1 and (names[active] in usable or names[active] in hold) and not declined:
            new_chain = [active, *replicas]
        else:
            lost = names[active] if active != -1 else "nobody"
            record = in_sync.get(vb)
            candidates = [i for i in replicas if names[i] in usable and names[i] not in failed]
            eligible = [
                i
                for i in candidates
                if record is not None
                and (record.active == lost or declined)
                and names[i] in record.members
            ]
            if not eligible and declined and record is None:
                # No active ever wrote a record, so any that committed required every replica
                # placed with it (rules.InSyncKeeper): each live one holds every commit.
                eligible = candidates
            if not eligible and force:
                eligible = candidates
            if not eligible and declined and record is not None:
                writer = names.index(record.active) if record.active in names else -1
                if writer in candidates:  # see FailoverPlan.reinstated
                    eligible = [writer]
                    reinstated[vb] = record.active
            if not eligible:
                why = "promoting one could lose durable writes (force to accept)"
                refused[vb] = f"vb {vb}: no live replica was in sync with {lost}: " + (
                    why if candidates else "no live replica"
                )
                if declined:
                    refused[vb] += f" ({lost} declined it: it restarted since it was made active)"
                new_chain = list(chain)  # unchanged: it serves again when its active returns
            else:
                best = max(
                    eligible,
                    key=lambda i: (high_seqnos.get(names[i], {}).get(vb, -1), -leading[i], -i),
                )
                leading[best] += 1
                promoted[vb] = names[best]
                # The old active keeps a replica slot of its vbucket: when it returns it is
                # that vbucket's replica again (rolling back to the common history first), and
                # no other node is made to copy the vbucket meanwhile.
                new_chain = [best, *[i for i in replicas if i != best], active]
        for i, name in enumerate(names):  # free replica slots (too few nodes at first) to live ones
            if len(new_chain) > current.replicas:
                break
            if name in usable and i not in new_chain:
                new_chain.append(i)
                rejoined[vb] = name
        new_chain += [-1] * (current.replicas + 1 - len(new_chain))
        chains.append(tuple(new_chain))
    new_map = None
    if tuple(chains) != current.chains:
        new_map = ClusterMap(current.rev + 1, current.nodes, tuple(chains), current.replicas)
    return FailoverPlan(new_map, promoted, refused, rejoined, reinstated)
