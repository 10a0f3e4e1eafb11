"""The initial map: distinct nodes per chain, balanced actives and replicas, deterministic."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cluster.placement import initial_map, rebalance_chains
from changefeed.vbmap import REPLICAS_MAX, NodeAddress


def nodes(count: int) -> list[NodeAddress]:
    return [NodeAddress(f"node{i:02d}", "127.0.0.1", 11000 + i) for i in range(count)]


def spread(counter: Counter[int], population: int) -> int:
    """max - min of per-node counts, counting nodes with none."""
    counts = [counter.get(i, 0) for i in range(population)]
    return max(counts) - min(counts)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(0, REPLICAS_MAX),
    st.one_of(st.integers(1, 130), st.sampled_from([256, 1000, 1024])),
)
def test_initial_map_properties(node_count: int, replicas: int, vbuckets: int) -> None:
    cluster_map = initial_map(nodes(node_count), replicas, vbuckets)
    assert cluster_map.rev == 1 and cluster_map.vbuckets == vbuckets
    assert cluster_map.replicas == replicas
    placed = min(replicas, node_count - 1)
    actives: Counter[int] = Counter()
    replica_copies: Counter[int] = Counter()
    for chain in cluster_map.chains:
        assert len(chain) == replicas + 1
        copies = [i for i in chain if i != -1]
        assert len(copies) == len(set(copies)) == placed + 1  # distinct, as many as fit
        assert chain[: placed + 1] == tuple(copies)  # the -1s only at the end
        actives[chain[0]] += 1
        replica_copies.update(copies[1:])
    assert spread(actives, node_count) <= 1
    assert spread(replica_copies, node_count) <= 1
    assert sum(replica_copies.values()) == placed * vbuckets


@settings(max_examples=50, deadline=None)
@given(st.permutations(nodes(5)), st.integers(0, 3), st.integers(1, 64))
def test_initial_map_is_deterministic(shuffled: list[NodeAddress], replicas: int, vbs: int) -> None:
    """Whatever order the live nodes are listed in (etcd, a dict), the same map."""
    assert initial_map(shuffled, replicas, vbs) == initial_map(nodes(5), replicas, vbs)


def test_replicas_of_a_node_come_from_every_other_node() -> None:
    """When a node fails, its actives are promoted on many nodes, not one."""
    cluster_map = initial_map(nodes(4), 1, 64)
    pairs = Counter((chain[0], chain[1]) for chain in cluster_map.chains)
    for active in range(4):
        partners = {replica for (a, replica) in pairs if a == active}
        assert partners == set(range(4)) - {active}
        counts = [pairs[(active, p)] for p in partners]
        assert max(counts) - min(counts) <= 1


def test_too_few_nodes_leave_copies_unplaced() -> None:
    cluster_map = initial_map(nodes(2), 2, 4)
    assert all(chain[2] == -1 and chain[1] != -1 for chain in cluster_map.chains)
    single = initial_map(nodes(1), 1, 3)
    assert single.chains == ((0, -1),) * 3


@pytest.mark.parametrize(
    ("node_list", "replicas", "vbuckets", "message"),
    [
        ([], 1, 4, "at least one node"),
        (nodes(2) + nodes(1), 1, 4, "not unique"),
        (nodes(2), 4, 4, "replicas 4 outside"),
        (nodes(2), 1, 0, "vbuckets 0"),
    ],
)
def test_bad_arguments_are_named(
    node_list: list[NodeAddress], replicas: int, vbuckets: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        initial_map(node_list, replicas, vbuckets)


# -- rebalance targets ------------------------------------------------------------------------


def names_of(node_count: int, replicas: int, vbuckets: int) -> list[list[str | None]]:
    """An initial map's chains by node name."""
    cluster_map = initial_map(nodes(node_count), replicas, vbuckets)
    return [[cluster_map.nodes[i].name if i != -1 else None for i in c] for c in cluster_map.chains]


def check_balanced(chains: list[tuple[str | None, ...]], names: list[str], replicas: int) -> None:
    placed = min(replicas, len(names) - 1)
    actives: Counter[str] = Counter()
    replica_copies: Counter[str] = Counter()
    for chain in chains:
        assert len(chain) == replicas + 1
        copies = [n for n in chain if n is not None]
        assert len(copies) == len(set(copies)) == placed + 1, chain  # one active, distinct
        assert chain[: placed + 1] == tuple(copies)  # the Nones only at the end
        assert set(copies) <= set(names)
        actives[copies[0]] += 1
        replica_copies.update(copies[1:])
    for counter in (actives, replica_copies):
        counts = [counter.get(n, 0) for n in names]
        assert max(counts) - min(counts) <= 1, (counter, names)


def created(before: list[list[str | None]], after: list[tuple[str | None, ...]]) -> list[str]:
    """The copies the target adds (each one is data streamed to a node)."""
    return [n for old, new in zip(before, after, strict=True) for n in new if n and n not in old]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(0, REPLICAS_MAX),
    st.integers(1, 130),
    st.sets(st.integers(0, 11), min_size=1, max_size=10),
)
def test_rebalance_target_is_balanced_from_any_map(
    start_count: int, replicas: int, vbuckets: int, wanted: set[int]
) -> None:
    """From any initial map to any node set: a valid, balanced map (every vbucket one active
    and as many distinct replicas as fit), and a fixed point (rebalancing it moves nothing)."""
    before = names_of(start_count, replicas, vbuckets)
    names = [f"node{i:02d}" for i in sorted(wanted)]
    target = rebalance_chains(before, names, replicas)
    check_balanced(target, names, replicas)
    assert rebalance_chains([list(c) for c in target], reversed(names), replicas) == target


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, REPLICAS_MAX), st.integers(1, 130))
def test_adding_a_node_only_copies_to_it(count: int, replicas: int, vbuckets: int) -> None:
    """Minimal moves: the copies made are on the new node (the greedy replica pass may make
    one more elsewhere: not an optimal assignment, checked over every small map: 14 of 3380),
    and no more actives move than the new node's share (old nodes only give)."""
    if min(replicas, count) != min(replicas, count - 1):
        return  # the new node also makes room for more replicas: old nodes gain copies too
    before = names_of(count, replicas, vbuckets)
    names = [f"node{i:02d}" for i in range(count + 1)]
    target = rebalance_chains(before, names, replicas)
    check_balanced(target, names, replicas)
    assert sum(1 for n in created(before, target) if n != names[-1]) <= 1
    moved = sum(1 for old, new in zip(before, target, strict=True) if old[0] != new[0])
    assert moved == sum(1 for chain in target if chain[0] == names[-1])


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 9), st.integers(0, REPLICAS_MAX), st.integers(1, 130), st.data())
def test_removing_a_node_recreates_only_its_copies(
    count: int, replicas: int, vbuckets: int, data: st.DataObject
) -> None:
    """Minimal moves: as many copies are made as the leaving node held (when the number of
    replicas that fit does not change)."""
    if min(replicas, count - 1) != min(replicas, count - 2):
        return
    before = names_of(count, replicas, vbuckets)
    gone = data.draw(st.integers(0, count - 1))
    names = [f"node{i:02d}" for i in range(count) if i != gone]
    target = rebalance_chains(before, names, replicas)
    check_balanced(target, names, replicas)
    held = sum(1 for chain in before for n in chain if n == f"node{gone:02d}")
    assert len(created(before, target)) <= held + len(names)  # its copies, plus a rebalance


def test_a_balanced_map_is_left_alone() -> None:
    before = names_of(3, 1, 16)
    assert rebalance_chains(before, ["node00", "node01", "node02"], 1) == [tuple(c) for c in before]


def test_rebalance_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        rebalance_chains([["a"]], [], 0)
    with pytest.raises(ValueError, match="replicas 5 outside"):
        rebalance_chains([["a"]], ["a"], 5)
