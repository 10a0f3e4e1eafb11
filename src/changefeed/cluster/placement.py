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

``rebalance_chains`` is the target of a rebalance (``changefeed cluster add/remove``): the same
rules over a new set of nodes, starting from the chains there are, keeping every copy it can
(each copy it does not keep is a vbucket streamed to another node). Actives first: each node's
quota is floor or ceil of the mean, the ceils going to the nodes that hold most actives now;
a node keeps actives up to its quota, the rest go to nodes under quota, preferring one that
holds a copy already (a takeover, no data to send). Replicas then: quotas the same way (the
ceils to the nodes holding most copies, never to one that would then need more copies than
vbuckets it does not lead),
existing copies kept up to the quota, missing ones given to the least loaded node that has
no copy of that vbucket; when every node with room already has one, an augmenting path moves
some other vbucket's replica along to make room (a max-flow step: it never unbalances).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

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


def rebalance_chains(
    current: Sequence[Sequence[str | None]], nodes: Iterable[str], replicas: int
) -> list[tuple[str | None, ...]]:
    """The chains (node names, active first, None where no node is left) of a balanced map
    over `nodes` that keeps as many of `current`'s copies as balance allows.

    Args:
        current: per vbucket, the names of its copies now (active first; None for none).
            Names not in `nodes` are copies that go (their node leaves).
        nodes: the names of the nodes of the new map.
        replicas: replica copies per vbucket (fewer are placed when there are too few nodes).

    Raises:
        ValueError: no nodes, no vbuckets, or `replicas` out of range.
    """
    names = sorted(set(nodes))
    if not names:
        raise ValueError("a cluster map needs at least one node")
    if not current:
        raise ValueError("a cluster map needs at least one vbucket")
    if not 0 <= replicas <= REPLICAS_MAX:
        raise ValueError(f"replicas {replicas} outside 0..{REPLICAS_MAX}")
    members = set(names)
    vbuckets, count = len(current), len(names)
    placed = min(replicas, count - 1)
    holders = [[n for n in chain if n is not None and n in members] for chain in current]

    # Actives: quotas floor/ceil, the ceils to the nodes holding the most actives now.
    now = Counter(chain[0] for chain in current if chain and chain[0] in members)
    base, extra = divmod(vbuckets, count)
    ceils = set(sorted(names, key=lambda n: (-now[n], n))[:extra])
    quota = {n: base + (n in ceils) for n in names}
    load: Counter[str] = Counter()
    active: list[str | None] = [None] * vbuckets
    for vb, chain in enumerate(current):
        keep = chain[0] if chain else None
        if keep is not None and keep in members and load[keep] < quota[keep]:
            active[vb] = keep
            load[keep] += 1
    for vb in range(vbuckets):
        if active[vb] is None:
            room = [n for n in names if load[n] < quota[n]]
            pick = min(room, key=lambda n: (n not in holders[vb], load[n] - quota[n], n))
            active[vb] = pick
            load[pick] += 1

    # Replicas: quotas floor/ceil, the ceils to the nodes with the fewest actives.
    copies_now = Counter(n for vb in range(vbuckets) for n in holders[vb] if n != active[vb])
    rbase, rextra = divmod(placed * vbuckets, count)
    # A ceil never goes to a node that would then need more copies than vbuckets it does
    # not lead (with replicas = nodes - 1 the ceils are forced onto the nodes with fewer
    # actives); among the others, to the nodes holding most copies now.
    rceils = set(
        sorted(
            names,
            key=lambda n: (rbase + 1 > vbuckets - load[n], -copies_now[n], load[n], n),
        )[:rextra]
    )
    rquota = {n: rbase + (n in rceils) for n in names}
    rload: Counter[str] = Counter()
    kept: list[list[str]] = [[] for _ in range(vbuckets)]
    for vb, chain in enumerate(current):
        # Its replicas in chain order, then its active if that is demoted (it has the data).
        for n in [*chain[1:], *chain[:1]]:
            if len(kept[vb]) >= placed:
                break
            if n is None or n not in members or n == active[vb] or n in kept[vb]:
                continue
            if rload[n] < rquota[n]:
                kept[vb].append(n)
                rload[n] += 1
    for vb in range(vbuckets):
        while len(kept[vb]) < placed:
            taken = {active[vb], *kept[vb]}
            room = [n for n in names if n not in taken and rload[n] < rquota[n]]
            if room:
                pick = min(room, key=lambda n: (rload[n] - rquota[n], n))
                kept[vb].append(pick)
                rload[pick] += 1
            else:
                _make_room(vb, names, holders, active, kept, rload, rquota)
    result = []
    for vb in range(vbuckets):
        chain = [active[vb], *kept[vb]]
        result.append(tuple(chain + [None] * (replicas + 1 - len(chain))))
    return result


def _make_room(
    vb: int,
    names: list[str],
    holders: list[list[str]],
    active: list[str | None],
    kept: list[list[str]],
    rload: Counter[str],
    rquota: dict[str, int],
) -> None:
    """Give `vb` one more replica when every node with room already holds a copy of it: a
    breadth-first augmenting path vb <- m0, m0's copy of vb1 -> m1, ..., ending at a node
    with room (each node on the path gives one copy and takes one: loads stay in quota).
    Nodes that hold a copy of the vbucket they would take are tried first (no data to send).

    Raises:
        AssertionError: no path (the quotas cannot be met: a bug in the quotas).
    """
    owners: dict[str, list[int]] = {n: [] for n in names}
    for other, copies in enumerate(kept):
        for n in copies:
            owners[n].append(other)
    taken = {active[vb], *kept[vb]}
    starts = sorted((n for n in names if n not in taken), key=lambda n: n not in holders[vb])
    parent: dict[str, tuple[str, int] | None] = {n: None for n in starts}
    queue = deque(parent)
    end: str | None = None
    while queue and end is None:
        node = queue.popleft()
        for other in owners[node]:
            if other == vb:
                continue
            busy = {active[other], *kept[other]}
            for n in sorted(names, key=lambda n: n not in holders[other]):
                if n in parent or n in busy:
                    continue
                parent[n] = (node, other)
                if rload[n] < rquota[n]:
                    end = n
                    break
                queue.append(n)
            if end is not None:
                break
    assert end is not None, f"vb {vb}: no room for a replica within the quotas"
    rload[end] += 1
    node = end
    step = parent[node]
    while step is not None:  # walk back: each hop hands one vbucket's copy to the next node
        giver, other = step
        kept[other][kept[other].index(giver)] = node
        node, step = giver, parent[giver]
    kept[vb].append(node)
