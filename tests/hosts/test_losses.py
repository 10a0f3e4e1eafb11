"""Issue 25's two losses of acknowledged durable writes, each as its own test on the test
hosts: the official SDK writes at durability MAJORITY (fresh keys and CAS read-modify-writes
on hot keys) while the fault repeats; after healing and convergence no acknowledged write may
be missing (``workload.check``). They fail on the code of the issue's time (the cut-off active
keeps acknowledging, the promotion decides from stale seqnos); the fencing of item 2 fixes them.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from support.hosts import HostCluster

from .test_faults import LEASE_S, chain_of, others
from .workload import run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HEALED_S = 4.0  # between two cuts: the returning node catches up (writes go on meanwhile)


def test_split_of_an_active_and_a_replica_from_the_rest_and_etcd_loses_nothing(
    workdir: Path, rng: random.Random
) -> None:
    # 5 nodes, 2 replicas. vb 0's active and one of its replicas on one side, the other nodes
    # and etcd on the other; the client reaches both sides, so the cut-off pair (a majority of
    # vb 0's three copies) can go on acknowledging MAJORITY writes until it is fenced.
    with HostCluster(workdir, nodes=5, replicas=2, failover_timeout_s=LEASE_S) as hosts:

        def splits(cluster: HostCluster) -> None:
            for _ in range(2):
                active, replicas = chain_of(cluster, 0)
                pair = [active, replicas[0]]
                cluster.network.partition(pair, [*others(cluster, *pair), *cluster.etcd_hosts])
                time.sleep(LEASE_S + 5.0)
                cluster.network.heal()
                time.sleep(HEALED_S)
                cluster.run(cluster.wait_settled())

        report = run_scenario(
            hosts, workdir, splits, seed=rng.randrange(1, 10**6), workers=6, hot=4
        )
        assert report.acked > 0, report
        assert not report.lost_fresh, report
        assert not report.lost_cas, report
        assert report.ok, report


def test_an_active_cut_from_etcd_only_loses_nothing(workdir: Path, rng: random.Random) -> None:
    # 3 nodes, 2 replicas. vb 0's active loses etcd but still reaches its replicas and the
    # client; repeated, with the active of the moment each time.
    with HostCluster(workdir, nodes=3, replicas=2, failover_timeout_s=LEASE_S) as hosts:

        def cuts(cluster: HostCluster) -> None:
            for _ in range(4):
                active, _ = chain_of(cluster, 0)
                cluster.network.cut([active], cluster.etcd_hosts)
                time.sleep(LEASE_S + 3.0)
                cluster.network.heal()
                time.sleep(HEALED_S)
                cluster.run(cluster.wait_settled())

        report = run_scenario(hosts, workdir, cuts, seed=rng.randrange(1, 10**6), workers=6, hot=4)
        assert report.acked > 0, report
        assert not report.lost_fresh, report
        assert not report.lost_cas, report
        assert report.ok, report
