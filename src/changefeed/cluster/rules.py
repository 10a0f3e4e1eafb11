"""The cluster's decisions about one node, as pure functions of what the node knows.

The node agent (node_agent.py) and the deterministic cluster simulator (tests/sim/) both decide
with these, so a rule is written once and a simulated schedule exercises the real rule. The
orchestrator's decision is `failover.plan_failover`; the commit rule is
`server.sync_writes.durability_met`; the in-sync rule is `server.replication.ReplicationTracker`.
"""

from __future__ import annotations

from changefeed.vbmap import ClusterMap
from changefeed.vbucket_state import VBucketState


def wanted_state(cluster_map: ClusterMap, name: str, vb: int) -> VBucketState:
    """Node `name`'s state for `vb` under `cluster_map`: its place in the chain (first →
    ACTIVE, or PENDING while a rebalance takes the vbucket over; later → REPLICA), a REPLICA
    when a rebalance builds a copy on it, else DEAD."""
    role = cluster_map.role_of(name, vb)
    move = cluster_map.move_of(vb)
    if role == 0:
        return VBucketState.PENDING if move is not None and move.takeover else VBucketState.ACTIVE
    if role is not None:
        return VBucketState.REPLICA
    index = cluster_map.node_index(name)
    if move is not None and index is not None and index in move.chain:
        return VBucketState.REPLICA
    return VBucketState.DEAD
