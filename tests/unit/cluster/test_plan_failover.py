"""cluster/failover.py: who is promoted, what is refused, who rejoins — properties over random
maps, live sets, in-sync sets and seqnos (the orchestrator's decision is a pure function)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cluster.failover import InSyncRecord, plan_failover
from changefeed.cluster.placement import initial_map
from changefeed.vbmap import ClusterMap, NodeAddress

NAMES = ["n1", "n2", "n3", "n4"]


def cluster(nodes: int, replicas: int, vbuckets: int = 8) -> ClusterMap:
    addresses = [NodeAddress(n, "127.0.0.1", 1000 + i) for i, n in enumerate(NAMES[:nodes])]
    return initial_map(addresses, replicas, vbuckets, rev=1)


def test_the_in_sync_replica_with_the_highest_seqno_is_promoted() -> None:
    current = cluster(3, 2)
    dead = "n1"
    vbs = [vb for vb in range(8) if current.nodes[current.chains[vb][0]].name == dead]
    in_sync = {vb: InSyncRecord(dead, frozenset({"n2", "n3"})) for vb in vbs}
    highs = {"n2": dict.fromkeys(vbs, 10), "n3": dict.fromkeys(vbs, 12)}
    plan = plan_failover(current, {"n2", "n3"}, in_sync, highs)
    assert plan.new_map is not None and plan.new_map.rev == 2
    assert plan.promoted == dict.fromkeys(vbs, "n3")
    assert not plan.refused
    for vb in vbs:  # the old active is the last replica (it resumes as one when back)
        names = [plan.new_map.nodes[i].name for i in plan.new_map.chains[vb]]
        assert names == ["n3", "n2", "n1"]


def test_equally_caught_up_replicas_share_a_dead_nodes_vbuckets() -> None:
    """Replicas 2 on 3 nodes puts every chain of a node in the same replica order: a tie on
    the seqno must not hand all of the dead node's vbuckets to the first survivor."""
    current = cluster(3, 2, vbuckets=12)
    dead = "n1"
    vbs = [vb for vb in range(12) if current.nodes[current.chains[vb][0]].name == dead]
    in_sync = {vb: InSyncRecord(dead, frozenset({"n2", "n3"})) for vb in vbs}
    highs = {"n2": dict.fromkeys(vbs, 10), "n3": dict.fromkeys(vbs, 10)}
    plan = plan_failover(current, {"n2", "n3"}, in_sync, highs)
    assert plan.new_map is not None
    leading = {
        name: sum(1 for chain in plan.new_map.chains if plan.new_map.nodes[chain[0]].name == name)
        for name in ("n2", "n3")
    }
    assert abs(leading["n2"] - leading["n3"]) <= 1, (leading, plan.promoted)


def test_no_in_sync_replica_is_refused_unless_forced() -> None:
    current = cluster(2, 1)
    vbs = [vb for vb in range(8) if current.nodes[current.chains[vb][0]].name == "n1"]
    in_sync = {vb: InSyncRecord("n1", frozenset()) for vb in vbs}  # n2 had fallen behind
    plan = plan_failover(current, {"n2"}, in_sync, {"n2": {}})
    assert set(plan.refused) == set(vbs) and not plan.promoted
    assert plan.new_map is None  # no silent promotion: unavailable until n1 returns
    forced = plan_failover(current, {"n2"}, in_sync, {"n2": {}}, force=True)
    assert forced.promoted == dict.fromkeys(vbs, "n2") and not forced.refused


def test_a_returning_node_is_its_old_vbuckets_replica_and_free_slots_are_filled() -> None:
    current = cluster(3, 1)
    in_sync = {vb: InSyncRecord("n1", frozenset({"n2", "n3"})) for vb in range(8)}
    after = plan_failover(current, {"n2", "n3"}, in_sync, {"n2": {}, "n3": {}}).new_map
    assert after is not None
    led = [vb for vb in range(8) if current.chains[vb][0] == 0]
    assert all(after.chains[vb][1] == 0 for vb in led)  # n1 kept a replica slot: no copying
    assert plan_failover(after, {"n1", "n2", "n3"}, {}, {}).new_map is None  # it just returns
    # A map made with fewer nodes than copies has free slots: a live node gets them.
    sparse = ClusterMap(5, current.nodes, tuple((c[0], -1) for c in current.chains), 1)
    filled = plan_failover(sparse, {"n1", "n2", "n3"}, {}, {}).new_map
    assert filled is not None and all(-1 not in chain for chain in filled.chains)


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.integers(2, 4),
    replicas=st.integers(1, 3),
    live_mask=st.lists(st.booleans(), min_size=4, max_size=4),
    data=st.data(),
)
def test_properties(nodes: int, replicas: int, live_mask: list[bool], data: st.DataObject) -> None:
    current = cluster(nodes, replicas)
    names = [n.name for n in current.nodes]
    live = {n for n, up in zip(names, live_mask, strict=False) if up}
    in_sync = {
        vb: InSyncRecord(
            data.draw(st.sampled_from(names)), frozenset(data.draw(st.sets(st.sampled_from(names))))
        )
        for vb in range(current.vbuckets)
    }
    highs = {n: {vb: data.draw(st.integers(0, 5)) for vb in range(current.vbuckets)} for n in names}
    force = data.draw(st.booleans())
    plan = plan_failover(current, live, in_sync, highs, force=force)
    result = plan.new_map or current
    for vb, chain in enumerate(result.chains):
        old_active = current.chains[vb][0]
        if old_active != -1 and names[old_active] in live:
            assert chain[0] == old_active  # a live active is never moved
            continue
        if vb in plan.promoted:
            winner = plan.promoted[vb]
            assert winner in live and names[chain[0]] == winner
            assert names.index(winner) in current.chains[vb][1:]  # it held a copy
            record = in_sync[vb]
            if not force:
                assert record.active == names[old_active] and winner in record.members
            candidates = [i for i in current.chains[vb][1:] if i != -1 and names[i] in live]
            synced = [
                names[i]
                for i in candidates
                if record.active == names[old_active] and names[i] in record.members
            ]
            # In-sync replicas first; any live replica only when forced and none was in sync.
            rivals = synced or [names[i] for i in candidates]
            assert winner in rivals
            assert all(highs[winner][vb] >= highs[r][vb] for r in rivals)
        else:
            assert chain == current.chains[vb] and vb in plan.refused
    # Every chain stays valid (ClusterMap checks distinct nodes and the length).
    ClusterMap(result.rev, result.nodes, result.chains, result.replicas)


def test_a_held_node_keeps_its_actives_and_gets_no_slots() -> None:
    """The orchestrator's guards (no majority live, a term's first TTL) hold absent nodes:
    nothing of theirs moves, and they are not placed anywhere new."""
    current = cluster(3, 2)
    in_sync = {vb: InSyncRecord("n1", frozenset({"n2", "n3"})) for vb in range(8)}
    held = plan_failover(current, {"n2", "n3"}, in_sync, {"n2": {}, "n3": {}}, hold={"n1"})
    assert held.new_map is None and not held.promoted
    moved = plan_failover(current, {"n2", "n3"}, in_sync, {"n2": {}, "n3": {}}).new_map
    assert moved is not None
    back = plan_failover(moved, {"n2", "n3"}, {}, {}, hold={"n1"})
    assert back.new_map is None and not back.rejoined  # held, not placed
