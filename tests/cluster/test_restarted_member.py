"""An in-sync member that restarted after its record is not promoted from it, and is once it
has caught up (issue 25; the simulator's seeds 8805 and 15775, docs/simulator.md).

A replica acknowledges MAJORITY writes from memory; if it crashes and restarts it has lost
them, and the in-sync record written before it restarted must not make it the new active.
etcd orders the two: the node key's mod revision (its registration) after the record's.
Real processes and a real etcd on loopback: the active is paused (SIGSTOP) so it cannot write
a newer record while the replica restarts; a failover of it then leaves the vbucket where it
is; resumed, the active sees the replica caught up and writes its record again, and the next
failover promotes the replica, with every write acknowledged before."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.metadata import ClusterMetadata, PromotableInSync
from changefeed.consumer import KvClient
from changefeed.vbmap import ClusterMap, NodeAddress
from support.cluster import fail_over_by_request, start_cluster, wait_in_sync_published
from support.etcd import running_etcd
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(180)
LEASE_S = 30  # no failover by lease in this test: only the ones it asks for
WAIT_S = 30.0


def test_registrations_are_node_keys_mod_revisions_and_filter_the_records(
    etcd: EtcdServer, cluster_name: str
) -> None:
    """`promotable_in_sync` leaves out a member whose registration is newer than the record,
    also when it registered again while its old lease still ran (the key's create revision
    would not have moved: its mod revision does)."""

    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            leadership = await md.campaign("orch", ttl_s=5)
            first = await md.write_map(_a_map(), None, leadership)
            assert first is not None
            await md.register_node(_address("n1"), 30)
            await md.register_node(_address("n2"), 30)
            record = await md.put_in_sync(0, "n0", ["n1", "n2"], first)
            assert record is not None
            view = await md.promotable_in_sync()
            assert view.records[0].members == {"n1", "n2"}
            assert view.revisions[0] == record and not view.held_back
            await md.register_node(_address("n2"), 30)  # the old lease still runs
            view = await md.promotable_in_sync()
            assert view.registrations["n2"] > record
            assert view.records[0].members == {"n1"}
            assert view.held_back == {0: frozenset({"n2"})}
            assert (await md.in_sync_sets())[0].members == {"n1"}
            again = await md.put_in_sync(0, "n0", ["n1", "n2"], first)
            assert again is not None and again > view.registrations["n2"]
            assert (await md.promotable_in_sync()).records[0].members == {"n1", "n2"}

    asyncio.run(body())


def test_a_record_is_not_written_over_a_registration_its_writer_has_not_seen(
    etcd: EtcdServer, cluster_name: str
) -> None:
    """The active judges a record by the registrations its watch has shown it. A member that
    registered again since (a restart the watch has not delivered yet: the active still
    counts it in sync on its old acks) must not be named by a record written after that
    registration, which would make it promotable: the write is refused, and lands once the
    writer judges by the registration etcd holds."""

    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            leadership = await md.campaign("orch", ttl_s=5)
            first = await md.write_map(_a_map(), None, leadership)
            assert first is not None
            await md.register_node(_address("n1"), 30)
            await md.register_node(_address("n2"), 30)
            seen = (await md.promotable_in_sync()).registrations
            assert await md.put_in_sync(0, "n0", ["n1", "n2"], first, seen)
            await md.register_node(_address("n2"), 30)  # restarted: not yet seen by the writer
            assert await md.put_in_sync(0, "n0", ["n1", "n2"], first, seen) is None
            assert (await md.promotable_in_sync()).records[0].members == {"n1"}
            assert await md.put_in_sync(0, "n0", ["n1"], first, seen)  # n2 not named: fine
            now = (await md.promotable_in_sync()).registrations
            assert await md.put_in_sync(0, "n0", ["n1", "n2"], first, now)

    asyncio.run(body())


def _address(name: str) -> NodeAddress:
    return NodeAddress(name, "127.0.0.1", 1)


def _a_map() -> ClusterMap:
    nodes = tuple(NodeAddress(f"n{i}", "127.0.0.1", 1 + i) for i in range(3))
    return ClusterMap(1, nodes, ((0, 1, 2),), 2)


def test_a_replica_restarted_since_its_record_is_promoted_only_once_caught_up_again(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str
) -> None:
    cluster = start_cluster(
        nodes,
        etcd.endpoint,
        cluster_name,
        count=3,
        replicas=1,
        failover_timeout_s=LEASE_S,
        crash_failover=False,
    )
    asyncio.run(wait_in_sync_published(etcd.endpoint, cluster_name))
    by_name = {f"n{i}": node for i, node in enumerate(cluster, 1)}
    cmap, leader = asyncio.run(_map_and_leader(etcd.endpoint, cluster_name))
    # An active A and its replica B, neither the orchestrator, and a vbucket chained A, B.
    names = [n.name for n in cmap.nodes]
    vb, a_name, b_name = next(
        (vb, names[chain[0]], names[chain[1]])
        for vb, chain in enumerate(cmap.chains)
        if leader not in (names[chain[0]], names[chain[1]])
    )
    a, b = by_name[a_name], by_name[b_name]
    other = by_name[leader]
    written = asyncio.run(_write_majority(other, vb, b"before", 40))

    os.kill(a.pid, signal.SIGSTOP)  # A can write no record while B restarts
    try:
        record_revision = asyncio.run(_record_revision(etcd.endpoint, cluster_name, vb))
        b.kill()  # MAJORITY acks come from memory: a restart may lose them
        b.start()
        asyncio.run(_wait_registered_after(etcd.endpoint, cluster_name, b_name, record_revision))
        view = asyncio.run(_promotable(etcd.endpoint, cluster_name))
        assert view.records[vb].active == a_name
        assert b_name not in view.records[vb].members
        assert view.held_back[vb] == {b_name}

        # A failover of A now must leave vb where it is: its only replica restarted since.
        after = asyncio.run(fail_over_by_request(etcd.endpoint, cluster_name, a_name))
        assert after.active(vb) is not None
        assert after.active(vb).name == a_name, after.chains  # type: ignore[union-attr]
        logs = other.log_text()
        assert f"vb {vb}: {b_name} registered again after its in-sync record" in logs, logs[-3000:]
    finally:
        os.kill(a.pid, signal.SIGCONT)

    # Resumed, A sees B caught up on a stream opened since B registered, and writes its
    # record again: B is promotable, and the next failover of A promotes it.
    asyncio.run(_wait_promotable(etcd.endpoint, cluster_name, vb, b_name))
    a.kill()
    moved = asyncio.run(fail_over_by_request(etcd.endpoint, cluster_name, a_name))
    promoted = moved.active(vb)
    assert promoted is not None and promoted.name == b_name, moved.chains
    asyncio.run(_read_all(b, written))


@pytest.mark.slow  # ~20-35 s here; the simulator's lease faults cover it in the default suite
def test_members_that_only_lost_their_leases_become_promotable_again(
    nodes: NodeFactory, tmp_path: Path
) -> None:
    """etcd paused past the lease: every node registers again when it is back (no restart,
    the replica streams never closed), so every record's members registered after it. Each
    active closes the replica connections older than the registrations it sees, counts the
    replicas caught up afresh and writes its records again: every replica is promotable."""
    with running_etcd(tmp_path) as etcd:
        start_cluster(
            nodes, etcd.endpoint, "relapse", count=3, replicas=2, failover_timeout_s=2,
            crash_failover=False,
        )  # fmt: skip
        asyncio.run(wait_in_sync_published(etcd.endpoint, "relapse"))
        before = asyncio.run(_registrations(etcd.endpoint, "relapse"))
        os.kill(etcd.pid, signal.SIGSTOP)
        time.sleep(3)  # past the 2 s lease: the nodes fence themselves and register again
        os.kill(etcd.pid, signal.SIGCONT)
        deadline = time.monotonic() + WAIT_S
        while True:  # bounded by the deadline
            after = asyncio.run(_registrations(etcd.endpoint, "relapse"))
            if len(after) == 3 and all(after[n] > before[n] for n in before):
                break
            assert time.monotonic() < deadline, f"not all registered again: {before} {after}"
            time.sleep(0.1)
        asyncio.run(wait_in_sync_published(etcd.endpoint, "relapse", timeout_s=WAIT_S))


async def _registrations(endpoint: str, cluster: str) -> dict[str, int]:
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        return await md.registrations()


async def _map_and_leader(endpoint: str, cluster: str) -> tuple[ClusterMap, str]:
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        stored, leader = await md.read_map(), await md.leader()
        assert stored is not None and leader is not None
        return stored[0], leader[0]


async def _write_majority(
    node: NodeProcess, vb: int, prefix: bytes, count: int
) -> dict[bytes, bytes]:
    async with await KvClient.connect("127.0.0.1", node.port) as kv:
        keys = [k for k in (prefix + b"%05d" % i for i in range(20_000)) if kv.vbucket_of(k) == vb]
        items = {key: b"v-" + key for key in keys[:count]}
        for key, value in items.items():
            await kv.upsert(key, value, durability="majority")
        return items


async def _read_all(node: NodeProcess, items: dict[bytes, bytes]) -> None:
    async with await KvClient.connect("127.0.0.1", node.port) as kv:
        for key, value in items.items():
            assert (await kv.get(key)).value == value, key


async def _record_revision(endpoint: str, cluster: str, vb: int) -> int:
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        _, revisions = await md.in_sync_records()
        return revisions[vb]


async def _promotable(endpoint: str, cluster: str) -> PromotableInSync:
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        return await md.promotable_in_sync()


async def _wait_registered_after(endpoint: str, cluster: str, name: str, revision: int) -> None:
    deadline = time.monotonic() + WAIT_S
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        while (await md.registrations()).get(name, 0) <= revision:
            assert time.monotonic() < deadline, f"{name} never registered again"
            await asyncio.sleep(0.05)


async def _wait_promotable(endpoint: str, cluster: str, vb: int, name: str) -> None:
    deadline = time.monotonic() + WAIT_S
    async with await ClusterMetadata.connect(endpoint, cluster) as md:
        while name not in (await md.promotable_in_sync()).records[vb].members:
            assert time.monotonic() < deadline, f"vb {vb}: {name} never named in a newer record"
            await asyncio.sleep(0.05)
