"""Each fault of the test hosts (``docs/test-hosts.md``) under the official SDK writing at
durability MAJORITY, with CAS read-modify-writes on hot keys; after healing and convergence the
checker (``workload.check``) finds every acknowledged write on every copy, with its CAS.

The fault hits the active of vbucket 0 (and, in the split, one of its replicas) while the
writer writes to every vbucket. The node lease (``--failover-timeout-s``) is ``LEASE_S``, and
every fault lasts longer than it, so the cluster fails over before the heal.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from support.hosts import Host, HostCluster, leftovers

from .workload import run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LEASE_S = 3
FAULT_S = LEASE_S + 4.0  # past the lease: a failover happens while the fault lasts


def chain_of(cluster: HostCluster, vb: int) -> tuple[Host, list[Host]]:
    """The hosts of ``vb``'s active and of its replicas, from the newest map."""
    cmap = cluster.run(cluster.newest_map())
    active = cmap.active(vb)
    assert active is not None, vb
    host = cluster.host_of(cluster.node_at(active.host))
    replicas = [cluster.host_of(cluster.node_at(r.host)) for r in cmap.replica_nodes(vb)]
    return host, replicas


def others(cluster: HostCluster, *excluded: Host) -> list[Host]:
    return [h for h in cluster.node_hosts if h not in excluded]


@pytest.fixture
def seed(rng: random.Random) -> int:
    return rng.randrange(1, 10**6)


def run_and_check(cluster: HostCluster, workdir: Path, fault: object, seed: int) -> None:
    report = run_scenario(cluster, workdir, fault, seed=seed)  # type: ignore[arg-type]
    assert report.acked > 0, report
    assert report.ok, report


def test_full_partition_of_one_node(workdir: Path, seed: int) -> None:
    with HostCluster(workdir, nodes=3, replicas=2, failover_timeout_s=LEASE_S) as hosts:

        def isolate(cluster: HostCluster) -> None:
            active, _ = chain_of(cluster, 0)
            cluster.network.isolate(active)
            time.sleep(FAULT_S)
            cluster.network.heal()

        run_and_check(hosts, workdir, isolate, seed)
        prefix = hosts.prefix
    assert leftovers(prefix) == []


def test_minority_majority_split(workdir: Path, seed: int) -> None:
    # 5 nodes, 2 replicas: vb 0's active and one replica on the minority side, its other
    # replica with the majority and etcd; the client reaches the majority only.
    with HostCluster(workdir, nodes=5, replicas=2, failover_timeout_s=LEASE_S) as hosts:

        def split(cluster: HostCluster) -> None:
            active, replicas = chain_of(cluster, 0)
            minority = [active, replicas[0]]
            assert cluster.client is not None
            majority = [*others(cluster, *minority), *cluster.etcd_hosts, cluster.client]
            cluster.network.partition(minority, majority)
            time.sleep(FAULT_S)
            cluster.network.heal()

        run_and_check(hosts, workdir, split, seed)


def test_one_way_loss(workdir: Path, seed: int) -> None:
    # vb 0's active still receives everything, but nothing it sends reaches the other nodes
    # or etcd (the client still hears it).
    with HostCluster(workdir, nodes=3, replicas=2, failover_timeout_s=LEASE_S) as hosts:

        def one_way(cluster: HostCluster) -> None:
            active, _ = chain_of(cluster, 0)
            cluster.network.block([active], [*others(cluster, active), *cluster.etcd_hosts])
            time.sleep(FAULT_S)
            cluster.network.heal()

        run_and_check(hosts, workdir, one_way, seed)


def test_a_node_cut_from_etcd_only(workdir: Path, seed: int) -> None:
    # Peers and clients still reach vb 0's active; etcd does not (it loses its lease).
    with HostCluster(workdir, nodes=3, replicas=2, failover_timeout_s=LEASE_S) as hosts:

        def cut_from_etcd(cluster: HostCluster) -> None:
            active, _ = chain_of(cluster, 0)
            cluster.network.cut([active], cluster.etcd_hosts)
            time.sleep(FAULT_S)
            cluster.network.heal()

        run_and_check(hosts, workdir, cut_from_etcd, seed)


def test_etcd_losing_a_member_then_its_leader(workdir: Path, seed: int) -> None:
    # Every node has every member (``--etcd a,b,c``, its own first): the nodes on a killed
    # member fail over to another one, and the cluster goes on through the remaining quorum.
    with HostCluster(workdir, nodes=3, replicas=2, failover_timeout_s=LEASE_S) as hosts:

        def lose_members(cluster: HostCluster) -> None:
            leader = cluster.etcd_leader()
            follower = next(i for i in range(len(cluster.etcd)) if i != leader)
            for index in (follower, cluster.etcd_leader()):
                cluster.etcd[index].kill()
                time.sleep(FAULT_S)
                if index != follower:
                    assert cluster.etcd_leader() != index
                cluster.restart_etcd(index)
                time.sleep(2.0)

        run_and_check(hosts, workdir, lose_members, seed)
