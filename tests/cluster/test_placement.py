"""The initial map: distinct nodes per chain, balanced actives and replicas, deterministic."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cluster.placement import initial_map
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
