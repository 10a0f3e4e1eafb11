"""A member promoted while its lease still ran, dead already, does not take the vbucket when it
restarts after the map landed (issue 25's crash race; the simulator's scenario
`promoted_while_dead`, docs/simulator.md).

Real processes and a real etcd on loopback, failover by request only (`--no-crash-failover`,
a 30 s lease): A and B (not the orchestrator C) are killed (-9) together once every copy of
A's vbuckets is caught up, and A is failed over: B, whose lease still runs, is promoted for
some of A's vbuckets (equally caught up copies share them: `plan_failover`). B then restarts.
Its process registered after those activations and its disk held the vbuckets as a replica
(what it acknowledged from memory may be gone), so it must not serve them: it waits as their
replica and asks for their failover, and the orchestrator promotes C, a member of the record
that holds every acknowledged write. On the code before, B took them.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.metadata import ClusterMetadata
from changefeed.consumer import KvClient
from changefeed.vbmap import ClusterMap
from support.cluster import fail_over_by_request, start_cluster, wait_in_sync_published
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
    others = [n for n in names if n != leader]
    leads = {n: [vb for vb, chain in enumerate(cmap.chains) if names[chain[0]] == n] for n in names}
    a_name = max(others, key=lambda n: len(leads[n]))
    b_name = next(n for n in others if n != a_name)
    a, b, c = by_name[a_name], by_name[b_name], by_name[leader]
    written: dict[bytes, bytes] = {}
    for vb in leads[a_name]:
        written |= asyncio.run(_write_majority(c, vb, b"acked%d-" % vb, 10))
    copies = [a_name, b_name, leader]
    asyncio.run(_wait_equal_highs(etcd.endpoint, cluster_name, leads[a_name], copies))

    a.kill()
    b.kill()  # its lease runs on for LEASE_S: it counts as live
    promoted = asyncio.run(fail_over_by_request(etcd.endpoint, cluster_name, a_name))
    to_b = [vb for vb in leads[a_name] if getattr(promoted.active(vb), "name", None) == b_name]
    assert to_b, promoted.chains  # equally caught up: B gets some of A's vbuckets

    b.start()  # registers after those activations; its disk held them as a replica
    for vb in to_b:
        moved = asyncio.run(_wait_active(etcd.endpoint, cluster_name, vb, leader))
        assert b_name in [moved.nodes[i].name for i in moved.chains[vb][1:]], moved.chains
        assert f"vb {vb}: not taking it as active" in b.log_text(), b.log_tail()
    asyncio.run(_read_all(b, written))  # through B: it routes to the actives
    assert not asyncio.run(_pending_vbucket_requests(etcd.endpoint, cluster_name))


async def _wait_equal_highs(
    endpoint: str, cluster: str, vbuckets: list[int], copies: list[str]
) -> None:
    """Until `copies` (the active among them) published the same high seqno, past the writes'
    start (> 0), for each of `vbuckets`: all caught up. Equal alone was not enough: statuses
    published before the writes (all 0) passed, and the orchestrator then saw only its own
    copy caught up and took every vbucket itself."""
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        deadline = time.monotonic() + WAIT_S
        while True:  # bounded by the deadline
            statuses = await md.node_statuses()
            highs = {
                vb: {int(statuses.get(n, {}).get("high", {}).get(str(vb), -1)) for n in copies}
                for vb in vbuckets
            }
            if all(len(found) == 1 and min(found) > 0 for found in highs.values()):
                return
            assert time.monotonic() < deadline, f"copies never caught up: {highs}"
            await asyncio.sleep(0.05)


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
