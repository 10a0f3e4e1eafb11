"""Where each vbucket's copies go in a new cluster: the initial map (sans-IO, deterministic).

Rules, in order of importance:

1. The copies of one vbucket are on distinct nodes (a node holding two copies would lose both
   at once); with fewer than ``replicas + 1`` nodes the missing copies are -1 (unplaced).
2. Actives are balanced: every node holds ``V // N`` or ``V // N + 1`` of them (round robin).
3. Replica copies are balanced the same way (every node holds floor or ceil of the mean), and
   each node's replicas come from the actives of every other node in turn (so when a node
   fails, the promotions of its vbuckets fall on many nodes, not one).

How: vbuckets go in rounds of N. In a full round every node is active once and, for replica
slot j, vbucket ``a`` goes to node ``a + d_j`` with distinct offsets that move on each round:
every node gets exactly one copy per slot. The last, partial round (actives 0..r-1) cannot be a
rotation (with N=4, r=2, R=2 one node would get two copies more than another), so its replicas
are placed by a small max flow with per-node capacities floor, then ceil, of the mean.
(Couchbase's vbmap tool solves the whole map as a flow problem; a greedy "least-loaded node"
pass is not enough: it leaves imbalances of 2.)

The same inputs always give the same map: nodes are taken in name order.
"""

from __future__ import annotations

from collections.abc import Iterable

from changefeed.vbmap import REPLICAS_MAX, ClusterMap, NodeAddress


def initial_map(
    nodes: Iterable[NodeAddress], replicas: int, vbuckets: int, rev: int = 1
) -> ClusterMap:
    """The first map of a cluster of ``nodes`` with ``replicas`` replicas of each of
    ``vbuckets`` vbuckets.

    Raises:
        ValueError: no nodes, two nodes with one name, or ``replicas``/``vbuckets`` out of range.
    """
    ordered = sorted(nodes, key=lambda n: n.name)
    if not ordered:
        raise ValueError("a cluster map needs at least one node")
    names = [n.name for n in ordered]
    if len(set(names)) != len(names):
        raise ValueError(f"node names are not unique: {names}")
    if not 0 <= replicas <= REPLICAS_MAX:
        raise ValueError(f"replicas {replicas} outside 0..{REPLICAS_MAX}")
    if vbuckets < 1:
        raise ValueError(f"vbuckets {vbuckets} must be at least 1")
    return ClusterMap(rev, tuple(ordered), chains(len(ordered), replicas, vbuckets), replicas)


def chains(nodes: int, replicas: int, vbuckets: int) -> tuple[tuple[int, ...], ...]:
    """Per vbucket, node indexes of its copies (active first, -1 where no node is left)."""
    assert nodes >= 1 and replicas >= 0 and vbuckets >= 1, (nodes, replicas, vbuckets)
    placed = min(replicas, nodes - 1)  # replicas that fit on distinct nodes
    unplaced = (-1,) * (replicas - placed)
    full_rounds, partial = divmod(vbuckets, nodes)
    result: list[tuple[int, ...]] = []
    for round_ in range(full_rounds):
        # Every node is active once and holds each replica slot once in a round; the offsets
        # move on each round, so a node's replicas come from every other node in turn.
        first = (round_ * placed) % max(1, nodes - 1)
        offsets = [1 + (first + j) % (nodes - 1) for j in range(placed)]
        for active in range(nodes):
            chain = [active, *((active + d) % nodes for d in offsets)]
            result.append((*chain, *unplaced))
    if partial:
        # Actives 0..partial-1 only: a rotation would load some nodes twice more than others,
        # so place these replicas by a flow that fills every node to the floor, then the rest.
        for active, copies in enumerate(_spread(nodes, partial, placed)):
            result.append((active, *copies, *unplaced))
    assert len(result) == vbuckets
    return tuple(result)


def _spread(nodes: int, actives: int, placed: int) -> list[list[int]]:
    """Replica nodes for vbuckets active on nodes 0..actives-1 (``actives`` < ``nodes``):
    ``placed`` distinct nodes each, never the active, every node loaded floor or ceil of the
    mean. A max flow (source -> vbucket, cap ``placed``; vbucket -> other node, cap 1; node ->
    sink, cap floor) raised to cap ceil: augmenting never lowers a node's load, so the second
    pass only adds."""
    total = actives * placed
    low, high = total // nodes, -(-total // nodes)
    source, sink = 0, 1 + actives + nodes
    size = sink + 1
    capacity = [[0] * size for _ in range(size)]
    for vb in range(actives):
        capacity[source][1 + vb] = placed
        for node in range(nodes):
            if node != vb:
                capacity[1 + vb][1 + actives + node] = 1
    for cap in (low, high):
        for node in range(nodes):
            already = capacity[sink][1 + actives + node]  # flow on node -> sink so far
            capacity[1 + actives + node][sink] = cap - already
        while _augment(capacity, source, sink):
            pass
    copies = []
    for vb in range(actives):
        # a vbucket -> node edge used by the flow has its capacity moved to the reverse edge
        chosen = [n for n in range(nodes) if n != vb and capacity[1 + actives + n][1 + vb] > 0]
        assert len(chosen) == placed, (nodes, actives, placed, chosen)
        copies.append(sorted(chosen, key=lambda n: (n - vb) % nodes))
    return copies


def _augment(capacity: list[list[int]], source: int, sink: int) -> bool:
    """One shortest augmenting path of one unit (BFS, lowest vertex first: deterministic)."""
    parent = [-1] * len(capacity)
    parent[source] = source
    frontier = [source]
    while frontier and parent[sink] == -1:
        following = []
        for u in frontier:
            for v, residual in enumerate(capacity[u]):
                if residual > 0 and parent[v] == -1:
                    parent[v] = u
                    following.append(v)
        frontier = following
    if parent[sink] == -1:
        return False
    v = sink
    while v != source:
        u = parent[v]
        capacity[u][v] -= 1
        capacity[v][u] += 1
        v = u
    return True
