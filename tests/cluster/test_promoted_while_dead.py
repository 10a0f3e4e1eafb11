"""A member promoted while its lease still ran, dead already, does not take the vbucket when it
restarts after the map landed (issue 25's crash race; the simulator's scenario
`promoted_while_dead`, docs/simulator.md).

Real processes and a real etcd on loopback, failover by request only (`--no-crash-failover`,
a 30 s lease): for a vbucket chained A, B, C (C the orchestrator), C is paused while
durable writes are prepared on A, so B publishes the higher seqno; A and B are killed (-9)
together, C resumed, and A failed over: B, whose lease still runs, is promoted. B then
restarts. Its process registered after that activation and its disk held the vbucket as a
replica (what it acknowledged from memory may be gone), so it must not serve it: it waits as a
replica and asks for the vbucket's failover, and the orchestrator promotes C, a member of the
record that holds every acknowledged write. On the code before, B took the vbucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.metadata import ClusterMetadata
from changefeed.consumer import KvClient
from changefeed.vbmap import ClusterMap
from support.cluster import start_cluster, wait_in_sync_published
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(180)
LEASE_S = 30  # no failover by lease: only the one the test asks for
WAIT_S = 30.0


def test_a_member_promoted_while_dead_asks_for_the_vbuckets_failover_when_it_restarts(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str
) -> None:
    cluster = start_cluster(
        nodes, etcd.endpoint, cluster_name, count=3, replicas=2,
        failover_timeout_s=LEASE_S, crash_failover=False,
    )  # fmt: skip
    asyncio.run(wait_in_sync_published(etcd.endpoint, cluster_name))
    by_name = {f"n{i}": node for i, node in enumerate(cluster, 1)}
    cmap, leader = asyncio.run(_map_and_leader(etcd.endpoint, cluster_name))
    names = [n.name for n in cmap.nodes]
    vb, a_name, b_name = next(
        (vb, names[chain[0]], names[chain[1]])
        for vb, chain in enumerate(cmap.chains)
        if names[chain[2]] == leader
    )
    a, b, c = by_name[a_name], by_name[b_name], by_name[leader]
    written = asyncio.run(_write_majority(c, vb, b"acked", 20))

    os.kill(c.pid, signal.SIGSTOP)  # its acks stop: prepares reach B, commits wait for C
    try:
        asyncio.run(_prepare_until_ahead(etcd.endpoint, cluster_name, a, vb, b_name, leader))
        a.kill()
        b.kill()  # its lease runs on for LEASE_S: it counts as live
    finally:
        os.kill(c.pid, signal.SIGCONT)
    promoted = asyncio.run(_fail_over(etcd.endpoint, cluster_name, a_name))
    assert promoted.active(vb) is not None
    assert promoted.active(vb).name == b_name, promoted.chains  # type: ignore[union-attr]

    b.start()  # registers after its activation; its disk held vb as a replica
    moved = asyncio.run(_wait_active(etcd.endpoint, cluster_name, vb, leader))
    assert b_name in [moved.nodes[i].name for i in moved.chains[vb][1:]], moved.chains
    assert f"vb {vb}: not taking it as active" in b.log_text(), b.log_tail()
    asyncio.run(_read_all(b, written))  # through B: it routes to the new active
    assert not asyncio.run(_pending_vbucket_requests(etcd.endpoint, cluster_name))


async def _map_and_leader(endpoint: str, cluster: str) -> tuple[ClusterMap, str]:
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        stored, leader = await md.read_map(), await md.leader()
        assert stored is not None and leader is not None
        return stored[0], leader[0]


def _keys_of(kv: KvClient, vb: int, prefix: bytes, count: int) -> list[bytes]:
    keys = [k for k in (prefix + b"%05d" % i for i in range(20_000)) if kv.vbucket_of(k) == vb]
    return keys[:count]


async def _write_majority(
    node: NodeProcess, vb: int, prefix: bytes, count: int
) -> dict[bytes, bytes]:
    async with await KvClient.connect("127.0.0.1", node.port) as kv:
        items = {key: b"v-" + key for key in _keys_of(kv, vb, prefix, count)}
        for key, value in items.items():
            await kv.upsert(key, value, durability="majority")
        return items


async def _prepare_until_ahead(
    endpoint: str, cluster: str, active: NodeProcess, vb: int, ahead: str, behind: str
) -> None:
    """Send durable writes to `vb` on `active` (they wait: `behind` is paused) until `ahead`
    publishes a higher seqno for `vb` than `behind` did."""
    async with (
        await KvClient.connect("127.0.0.1", active.port) as kv,
        await ClusterMetadata.connect(endpoint, cluster) as md,
    ):
        pending = [
            asyncio.create_task(kv.upsert(key, b"pending", durability="majority"))
            for key in _keys_of(kv, vb, b"pending", 5)
        ]
        try:
            deadline = time.monotonic() + WAIT_S
            while True:  # bounded by the deadline
                statuses = await md.node_statuses()
                highs = {n: int(s.get("high", {}).get(str(vb), -1)) for n, s in statuses.items()}
                if highs.get(ahead, -1) > highs.get(behind, -1) >= 0:
                    return
                assert time.monotonic() < deadline, f"{ahead} never published more: {highs}"
                await asyncio.sleep(0.05)
        finally:
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


async def _fail_over(endpoint: str, cluster: str, name: str) -> ClusterMap:
    """Ask the orchestrator to fail `name` over; the map once it answered the request."""
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        await md.request_failover(name)
        deadline = time.monotonic() + WAIT_S
        while await md.failover_requests():
            assert time.monotonic() < deadline, f"the failover of {name} was never answered"
            await asyncio.sleep(0.05)
        stored = await md.read_map()
        assert stored is not None
        return stored[0]


async def _wait_active(endpoint: str, cluster: str, vb: int, name: str) -> ClusterMap:
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        deadline = time.monotonic() + WAIT_S
        while True:  # bounded by the deadline
            stored = await md.read_map()
            assert stored is not None
            active = stored[0].active(vb)
            if active is not None and active.name == name:
                return stored[0]
            assert time.monotonic() < deadline, f"vb {vb} never moved to {name}: {stored[0]}"
            await asyncio.sleep(0.05)


async def _read_all(node: NodeProcess, items: dict[bytes, bytes]) -> None:
    async with await KvClient.connect("127.0.0.1", node.port) as kv:
        for key, value in items.items():
            assert (await kv.get(key)).value == value, key


async def _pending_vbucket_requests(endpoint: str, cluster: str) -> dict[int, str]:
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        return await md.vbucket_failover_requests()
