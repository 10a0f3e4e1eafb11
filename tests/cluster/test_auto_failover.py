"""Automatic and manual failover, and rejoin, over real processes (issue 12, item 2-3).

A killed active's in-sync replica with the highest seqno is promoted once the node's lease
lapses; clients follow the new map; the node that returns becomes a replica again, rolls back
to the common history and catches up.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.consumer import KvClient
from changefeed.vbmap import ClusterMap
from support.cluster import (
    assert_copies_equal,
    cluster_map,
    start_cluster,
    wait_in_sync_published,
)
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(300)
FAST = 2  # seconds of lease: kill to promotion


def active_port(cmap: ClusterMap, vb: int) -> int | None:
    active = cmap.active(vb)
    return None if active is None else active.port


async def write_all(node: NodeProcess, prefix: bytes, count: int) -> dict[bytes, bytes]:
    async with await KvClient.connect("127.0.0.1", node.port) as kv:
        items = {prefix + b"%05d" % i: b"v-%d" % i for i in range(count)}
        await kv.upsert_many(list(items.items()))
        return items


def test_a_killed_active_is_failed_over_and_rejoins_as_a_replica(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str
) -> None:
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=2, failover_timeout_s=FAST
    )
    n1, n2, _n3 = cluster
    before = asyncio.run(write_all(n1, b"before", 600))
    asyncio.run(assert_copies_equal(cluster))
    asyncio.run(wait_in_sync_published(etcd.endpoint, cluster_name))  # else refused, rightly
    old = asyncio.run(cluster_map(n2))
    n1_vbs = [vb for vb in range(old.vbuckets) if (a := old.active(vb)) and a.port == n1.port]
    assert n1_vbs

    async def write_through_failover() -> float:
        async with await KvClient.connect("127.0.0.1", n2.port) as kv:
            key = next(
                k for k in (b"probe%d" % i for i in range(1000)) if kv.vbucket_of(k) in n1_vbs
            )
            n1.kill()
            killed = time.monotonic()
            await kv.upsert(key, b"after-failover")  # follows the map through the failover
            serving = time.monotonic() - killed
            assert (await kv.get(key)).value == b"after-failover"
            for k, v in before.items():  # everything replicated before the kill is there
                assert (await kv.get(k)).value == v, k
            return serving

    serving_s = asyncio.run(write_through_failover())
    print(f"kill-to-serving {serving_s:.2f} s")
    assert serving_s < 15  # lease 2 s + election + promotion; generous for a loaded machine
    moved = asyncio.run(cluster_map(n2))
    assert moved.rev > old.rev
    assert all(active_port(moved, vb) not in (None, n1.port) for vb in n1_vbs)

    after = asyncio.run(write_all(n2, b"after", 300))
    # The failover kept n1 as the last replica of the vbuckets it led: when it starts again
    # it is their replica (rolled back to the common history, then caught up), no map change.
    n1.start()
    asyncio.run(assert_copies_equal(cluster))
    rejoined = asyncio.run(cluster_map(n2))
    assert rejoined.rev == moved.rev
    assert all(n1.port in [r.port for r in rejoined.replica_nodes(vb)] for vb in n1_vbs), (
        rejoined.chains
    )
    assert len(after) == 300


def test_manual_failover_moves_actives_and_refuses_without_an_in_sync_replica(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str
) -> None:
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=1, failover_timeout_s=FAST
    )
    n1, n2, n3 = cluster
    asyncio.run(write_all(n1, b"k", 300))
    asyncio.run(assert_copies_equal(cluster))
    asyncio.run(wait_in_sync_published(etcd.endpoint, cluster_name))
    cli = [sys.executable, "-m", "changefeed", "cluster", "failover"]
    where = ["--etcd", etcd.endpoint, "--cluster", cluster_name]

    done = subprocess.run([*cli, "n1", *where, "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    m = asyncio.run(cluster_map(n2))
    assert all(active_port(m, vb) not in (None, n1.port) for vb in range(m.vbuckets))
    asyncio.run(assert_copies_equal(cluster))

    # n3 down: the vbuckets n2 leads whose only replica is n3 have no in-sync replica left.
    n3.stop()
    refused = subprocess.run([*cli, "n2", *where], capture_output=True, text=True)
    current = asyncio.run(cluster_map(n2))
    lonely = [
        vb
        for vb in range(current.vbuckets)
        if (a := current.active(vb)) is not None
        and a.port == n2.port
        and [r.port for r in current.replica_nodes(vb)] == [n3.port]
    ]
    assert lonely, current.chains  # placement spreads n2's replicas over both other nodes
    assert refused.returncode == 1, refused.stdout
    assert "no live replica was in sync" in refused.stderr
    assert asyncio.run(cluster_map(n2)).rev == current.rev  # nothing changed
