"""The test hosts in the default suite: a 3-node cluster with a 3-member etcd, each on a network
namespace of its own; the official SDK writes at durability MAJORITY while one node is cut off
and healed; every acknowledged write is then found on every copy; nothing is left behind, also
after a test failing inside the harness."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.hosts import HostCluster, leftovers, process_gone

from .workload import run_scenario

pytestmark = pytest.mark.timeout(180)


def test_a_cluster_on_test_hosts_keeps_every_acknowledged_write_across_a_partition(
    workdir: Path,
) -> None:
    # A lease longer than the cut: no failover, the isolated node's vbuckets just wait.
    with HostCluster(workdir, nodes=3, replicas=2, failover_timeout_s=10) as hosts:
        cmap = hosts.run(hosts.newest_map())
        assert {n.host for n in cmap.nodes} == {n.host for n in hosts.nodes}
        assert all(n.host.startswith("10.77.") for n in cmap.nodes), cmap.nodes

        def cut_n3(cluster: HostCluster) -> None:
            cluster.network.isolate(cluster.node_hosts[2])
            time.sleep(3.0)
            cluster.network.heal()

        report = run_scenario(hosts, workdir, cut_n3, seed=1, warmup_s=1.5, settle_s=1.5)
        assert report.acked > 0, report
        assert report.ok, report
        prefix, pids = hosts.prefix, hosts.pids
    assert leftovers(prefix) == []
    assert all(process_gone(pid) for pid in pids), pids


def test_nothing_is_left_behind_after_a_failure_inside_the_harness(workdir: Path) -> None:
    hosts = HostCluster(workdir, nodes=2, replicas=1, members=1)
    with pytest.raises(ZeroDivisionError), hosts:
        hosts.network.isolate(hosts.node_hosts[0])  # a fault in place when the test fails
        assert leftovers(hosts.prefix)  # namespaces exist while it runs
        1 / 0  # noqa: B018  # the deliberate failure
    assert leftovers(hosts.prefix) == []
    assert hosts.pids
    assert all(process_gone(pid) for pid in hosts.pids), hosts.pids
