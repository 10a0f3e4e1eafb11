"""Which production rules the simulated cluster decides with.

Every decision is one call into `changefeed`: a copy's state (`cluster.rules.wanted_state`,
agent.py), the commit rule (`server.sync_writes.durability_met`, durability.py), the in-sync
rule (`server.replication.ReplicationTracker`, node.py), the promotion
(`cluster.failover.plan_failover`, here). This module only says which of them apply while the
partition fixes of issue 25 landed: `TodayRules` is the node as it was (an active serves until
it applies a newer map; the commit rule counts acks of the chain; the orchestrator promotes
from the last published in-sync record); `FencedRules` adds the fixes, calling the new
functions of `changefeed.cluster.rules`. `rules_for_tree()` picks by what the tree has.

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
    """The rules as they were before the partition fixes (fae8c28)."""

    name = "today"
    fencing = False
    recovered_pending = False  # a restarted node's recovered actives serve at once
    # Members registered again since their in-sync record are not promoted from it, and an
    # active writes its record again once such a member caught up (agent.py, orchestrator.py).
    registration_aware = False
    # A node does not take a vbucket whose activation was decided on an earlier process of
    # it, unless its disk vouches for the copy; it asks for that vbucket's failover instead
    # (`cluster.rules.refuses_activation`, agent.py, orchestrator.py).
    refuses_stale_activation = False

    def may_serve(self, node: SimNode, vb: int) -> bool:
        """An active serves until it applies a newer map (node_agent.py): always."""
        return True

    def required_replicas(self, node: SimNode, vb: int) -> frozenset[str] | None:
        """No confirmed in-sync record: the commit rule counts the chain."""
        return None

    def in_sync_members(
        self, members: frozenset[str], record_revision: int, registered: Mapping[str, int]
    ) -> frozenset[str]:
        """The members of an in-sync record the orchestrator may promote: all of them."""
        return members

    def plan_failover(
        self,
        current: ClusterMap,
        live: Set[str],
        in_sync: Mapping[int, cluster_failover.InSyncRecord],
        highs: Mapping[str, Mapping[int, int]],
        hold: Set[str],
        refusals: Mapping[int, str] | None = None,
    ) -> cluster_failover.FailoverPlan:
        if refusals:  # only the rules that refuse make requests: older plans are unchanged
            return cluster_failover.plan_failover(
                current, set(live), in_sync, highs, hold=hold, refusals=refusals
            )
        return cluster_failover.plan_failover(current, set(live), in_sync, highs, hold=hold)


class FencedRules(TodayRules):
    """The partition fixes of issue 25 (fae8c28), each decision a call into
    `changefeed.cluster.rules`: an active fences itself at `membership_valid_until` and its
    actives wait PENDING (`serving_state`) until the lease is renewed and the map re-read; a
    commit needs the acks of `InSyncKeeper.required` (`durability_met(..., required_acks)`),
    whose record is written fenced by the applied map's revision; a failover map is written
    only while the nodes it fails over stay unregistered; a crash confirmed by refused
    connections (`CrashConfirmer`) revokes the node's leases (agent.py, orchestrator.py).

    And a member of an in-sync record registered again after the record (a restart: it may
    have lost what it acknowledged from memory) is not promoted from it
    (`promotable_members`, the node key's mod revision against the record's); the active
    writes the record again once such a member is caught up on a stream opened since its
    registration was seen (`InSyncKeeper.target`'s `reregistered`, agent.py).

    And a node whose process registered after the map made it a vbucket's active (promoted
    while its lease still ran, then restarted after the map landed) does not take the
    vbucket unless its disk vouches for the copy (`refuses_activation`,
    `copy_holds_its_branch`): it waits as a replica and asks for the vbucket's failover, and
    the orchestrator promotes another promotable member (`plan_failover`'s `refusals`)."""

    name = "fenced"
    fencing = True
    recovered_pending = True  # `cluster.rules.recovered_state` (416253a)
    registration_aware = True
    refuses_stale_activation = True

    def in_sync_members(
        self, members: frozenset[str], record_revision: int, registered: Mapping[str, int]
    ) -> frozenset[str]:
        return cluster_rules.promotable_members(members, record_revision, registered)

    def may_serve(self, node: SimNode, vb: int) -> bool:
        """The fence is checked before a request is served (a node back from a pause checks
        before it acts); the vbucket's state (PENDING while fenced) does the refusing."""
        node.agent.check_fence()
        return True

    def required_replicas(self, node: SimNode, vb: int) -> frozenset[str] | None:
        keeper = node.agent.keepers.get(vb)
        return keeper.required if keeper is not None else frozenset()


class FencedRulesTrusting(FencedRules):
    """The fencing rules before activations were judged against the activated process: a
    member promoted while its lease still ran, dead already, that restarts after the map
    landed takes the vbucket with what its disk kept (scenario `promoted_while_dead`)."""

    name = "fenced-trusting"
    refuses_stale_activation = False


class FencedRulesUnaware(FencedRules):
    """The fencing rules before members registered since their record were told apart
    (before c787bdc): any member of the record may be promoted, and a record is written only
    when its members change (seeds 8805 and 15775 lose a write on them)."""

    name = "fenced-unaware"
    registration_aware = False
    refuses_stale_activation = False

    def in_sync_members(
        self, members: frozenset[str], record_revision: int, registered: Mapping[str, int]
    ) -> frozenset[str]:
        return members


class FencedRulesFirstCut(FencedRulesUnaware):
    """The fencing rules as first committed (fae8c28), before `recovered_state`: a restarted
    node served the actives its store kept before it read a map (the simulator's seed 611)."""

    name = "fenced-fae8c28"
    recovered_pending = False


def new_rules_available() -> bool:
    """True once `changefeed.cluster.rules` has more than `wanted_state` (issue 25's rules)."""
    public = {n for n in dir(cluster_rules) if not n.startswith("_")}
    return {"InSyncKeeper", "membership_valid_until", "serving_state"} <= public


def rules_for_tree() -> TodayRules:
    """The rule set matching the source tree: the fencing rules once they are there."""
    return FencedRules() if new_rules_available() else TodayRules()


def rule_sets() -> dict[str, type[TodayRules]]:
    """Every rule set by name (`python -m tests.sim.run --rules NAME`)."""
    kinds = (TodayRules, FencedRules, FencedRulesTrusting, FencedRulesUnaware, FencedRulesFirstCut)
    return {kind.name: kind for kind in kinds}
