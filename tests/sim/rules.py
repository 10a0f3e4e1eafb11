"""Which production rules the simulated cluster decides with.

Every decision is one call into `changefeed`: a copy's state (`cluster.rules.wanted_state`,
agent.py), the commit rule (`server.sync_writes.durability_met`, durability.py), the in-sync
rule (`server.replication.ReplicationTracker`, node.py), the promotion
(`cluster.failover.plan_failover`, here). This module only says which of them apply while the
partition fixes of issue 25 land: `TodayRules` is the node as it is (an active serves until it
applies a newer map; the commit rule counts acks of the chain; the orchestrator promotes from
the last published in-sync record). When `changefeed.cluster.rules` grows the fencing rules,
`rules_for_tree()` returns a set that calls them too.

Functions are looked up through their modules at call time, so the mutation tests can replace
one (`monkeypatch.setattr(sync_writes, "durability_met", ...)`).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import TYPE_CHECKING

from changefeed.cluster import failover as cluster_failover
from changefeed.cluster import rules as cluster_rules
from changefeed.vbmap import ClusterMap

if TYPE_CHECKING:
    from .node import SimNode


class TodayRules:
    """The rules as they are before the partition fixes."""

    name = "today"

    def may_serve(self, node: SimNode, vb: int) -> bool:
        """An active serves until it applies a newer map (node_agent.py): always."""
        return True

    def required_acks(self, vb: int, replicas: list[str]) -> None:
        """No confirmed in-sync record yet: the commit rule counts the chain."""
        return None

    def plan_failover(
        self,
        current: ClusterMap,
        live: Set[str],
        in_sync: Mapping[int, cluster_failover.InSyncRecord],
        highs: Mapping[str, Mapping[int, int]],
        hold: Set[str],
    ) -> cluster_failover.FailoverPlan:
        return cluster_failover.plan_failover(current, set(live), in_sync, highs, hold=hold)


def new_rules_available() -> bool:
    """True once `changefeed.cluster.rules` has more than `wanted_state` (issue 25's rules)."""
    public = {n for n in dir(cluster_rules) if not n.startswith("_")}
    known = {"ClusterMap", "VBucketState", "annotations", "wanted_state"}
    return bool(public - known)


def rules_for_tree() -> TodayRules:
    """The rule set matching the source tree (today's until the fencing rules land)."""
    return TodayRules()
