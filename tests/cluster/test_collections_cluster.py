"""Collections on a 3-node cluster (issue 28): the manifest is kept in etcd and changed under
the orchestrator's fence (cluster/manifest_store.py), every node applies it, and a collection
created while an active is down — before the failover that promotes its replicas — is on the
promoted copies: they write the system events they lack when they become active.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import pytest
from click.testing import CliRunner

from changefeed.cli.main import cli
from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.manifest_store import MANIFEST_KEY
from changefeed.cluster.metadata import ClusterMetadata
from changefeed.consumer import DcpClient
from changefeed.consumer.collections_admin import edit_manifest, get_manifest
from changefeed.consumer.connection import Connection
from changefeed.consumer.events import Changes, CollectionEvent, StreamEnded, StreamRefused
from changefeed.consumer.handshake import call, connect
from changefeed.protocol.collections import SystemEvent, encode_leb128, split_key
from changefeed.protocol.collections_manifest import Manifest
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.vbmap import ClusterMap
from support.clients import BUCKET, PASSWORD, USER, dcp_config
from support.cluster import (
    assert_copies_equal,
    cluster_map,
    seqnos,
    start_cluster,
    wait_in_sync_published,
)
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(300)
VBUCKETS = 8
WAIT_S = 60.0


async def kv(node: NodeProcess) -> Connection:
    features = [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.COLLECTIONS]
    return await connect(
        HOST, node.port, agent="collections-cluster", user=USER, password=PASSWORD,
        bucket=BUCKET, features=features,
    )  # fmt: skip


async def manifest_of(node: NodeProcess) -> Manifest:
    conn = await kv(node)
    try:
        return await get_manifest(conn)
    finally:
        await conn.close()


async def etcd_manifest(endpoint: str, cluster: str) -> Manifest | None:
    async with await ClusterMetadata.connect(endpoint, cluster) as metadata:
        found = await metadata.read_document(MANIFEST_KEY)
    return None if found is None else Manifest.decode(found[0])


async def write_everywhere(
    nodes: list[NodeProcess], cmap: ClusterMap, cid: int, prefix: bytes
) -> dict[int, bytes]:
    """One document per vbucket in collection `cid`, each through its active (found by port);
    each read back there. Returns vb -> key."""
    by_port = {n.port: n for n in nodes}
    written: dict[int, bytes] = {}
    for vb in range(cmap.vbuckets):
        active = cmap.active(vb)
        assert active is not None, vb
        conn = await kv(by_port[active.port])
        try:
            key = encode_leb128(cid) + prefix + b"%d" % vb
            await call(
                conn, Opcode.SET, vbucket=vb, extras=struct.pack(">II", 0, 0), key=key,
                value=b'{"vb": %d}' % vb,
            )  # fmt: skip
            got = await call(conn, Opcode.GET, vbucket=vb, key=key)
            assert got.value == b'{"vb": %d}' % vb
        finally:
            await conn.close()
        written[vb] = key
    return written


async def node_copy(
    node: NodeProcess, vbuckets: list[int]
) -> tuple[dict[int, set[int]], dict[int, set[bytes]]]:
    """`node`'s own copy (active or replica) of `vbuckets`: per vb, the collections its
    BeginCollection events open, and its keys (with their collection id)."""
    begun: dict[int, set[int]] = {vb: set() for vb in vbuckets}
    keys: dict[int, set[bytes]] = {vb: set() for vb in vbuckets}
    config = dcp_config(node, follow_map=False, collections_aware=True)
    async with DcpClient(config) as client:
        await client.stream(vbuckets)
        ended = 0
        async for event in client.events():
            if isinstance(event, Changes):
                cols = event.columns
                for vb, key in zip(cols.vbucket, cols.key, strict=True):
                    keys[int(vb)].add(bytes(key))
            elif isinstance(event, CollectionEvent):
                message = event.message
                if message.event is SystemEvent.BEGIN_COLLECTION:
                    assert message.collection_id is not None
                    begun[event.vbucket].add(message.collection_id)
            elif isinstance(event, StreamRefused):
                raise AssertionError(f"{node.root.name} refused vb {event.vbucket}: {event}")
            elif isinstance(event, StreamEnded):
                ended += 1
                if ended == len(vbuckets):
                    break
    return begun, keys


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `check` until it returns True (bounded by WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.1)


def test_manifest_in_etcd_and_a_collection_created_during_a_failover(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str
) -> None:
    cluster = start_cluster(nodes, etcd.endpoint, cluster_name, count=3, replicas=2)
    n1, n2, _ = cluster

    # `changefeed collection create` through n1: the etcd copy changes, every node has it.
    created = CliRunner().invoke(
        cli,
        ["collection", "create", "shop.orders", "--json", "--port", str(n1.port),
         "--user", USER, "--password", PASSWORD],
    )  # fmt: skip
    assert created.exit_code == 0, created.output
    report = json.loads(created.output)
    assert set(report["nodes"].values()) == {"set"}, report
    stored = asyncio.run(etcd_manifest(etcd.endpoint, cluster_name))
    assert stored is not None and stored.resolve("shop.orders")[1] is not None
    orders = stored.resolve("shop.orders")[1]
    assert orders is not None
    for node in cluster:
        assert asyncio.run(manifest_of(node)) == stored, node.root.name

    # Usable through every node's vbuckets, and on every copy.
    before = asyncio.run(cluster_map(n2))
    orders_keys = asyncio.run(write_everywhere(cluster, before, orders.uid, b"o"))
    asyncio.run(assert_copies_equal(cluster))
    for node in cluster:
        begun, keys = asyncio.run(node_copy(node, list(range(VBUCKETS))))
        assert all(orders.uid in begun[vb] for vb in range(VBUCKETS)), (node.root.name, begun)
        assert all(orders_keys[vb] in keys[vb] for vb in range(VBUCKETS)), node.root.name

    # A node that is not the orchestrator dies (kill -9); while it is down and still the
    # active of its vbuckets, a collection is created (a KV management call through another
    # node). Then it is failed over (manually: the test decides the order).
    asyncio.run(wait_in_sync_published(etcd.endpoint, cluster_name))
    leader = asyncio.run(leader_name(etcd.endpoint, cluster_name))
    names = {node: f"n{i}" for i, node in enumerate(cluster, start=1)}
    victim = next(node for node in cluster if names[node] != leader)
    survivors = [node for node in cluster if node is not victim]
    editor = survivors[0]
    victim_vbs = [
        vb for vb in range(VBUCKETS) if (a := before.active(vb)) and a.port == victim.port
    ]
    assert victim_vbs, before.chains
    victim.kill()

    async def create_late() -> Manifest:
        conn = await kv(editor)
        try:
            return await edit_manifest(conn, lambda m: m.with_collection("shop", "late"))
        finally:
            await conn.close()

    late_manifest = asyncio.run(create_late())
    late = late_manifest.resolve("shop.late")[1]
    assert late is not None
    assert asyncio.run(etcd_manifest(etcd.endpoint, cluster_name)) == late_manifest
    assert asyncio.run(cluster_map(editor)).rev == before.rev  # no failover has happened yet
    failover = subprocess.run(
        [sys.executable, "-m", "changefeed", "cluster", "failover", names[victim],
         "--etcd", etcd.endpoint, "--cluster", cluster_name],
        capture_output=True, text=True,
    )  # fmt: skip
    assert failover.returncode == 0, failover.stderr
    after = asyncio.run(cluster_map(editor))
    promoted = {vb: after.active(vb) for vb in victim_vbs}
    assert all(a is not None and a.port != victim.port for a in promoted.values()), promoted

    # Writes to the new collection after the failover land on the promoted copies ...
    late_keys = asyncio.run(write_everywhere(survivors, after, late.uid, b"late"))
    asyncio.run(wait_survivors_replicated(survivors, after))
    # ... whose streams (and every surviving copy's) open it, each vbucket once.
    for node in survivors:
        begun, keys = asyncio.run(node_copy(node, list(range(VBUCKETS))))
        for vb in range(VBUCKETS):
            assert {orders.uid, late.uid} <= begun[vb], (node.root.name, vb, begun[vb])
            assert late_keys[vb] in keys[vb] and orders_keys[vb] in keys[vb], (node.root.name, vb)
            assert {split_key(k)[0] for k in keys[vb]} <= {orders.uid, late.uid}
        assert asyncio.run(manifest_of(node)) == late_manifest

    # The victim comes back: it applies the etcd copy it missed and its copies catch up.
    victim.start()

    async def victim_has_late() -> bool:
        return (await manifest_of(victim)).uid == late_manifest.uid

    asyncio.run(eventually(victim_has_late, "the restarted node never applied the manifest"))
    asyncio.run(assert_copies_equal(cluster))


async def wait_survivors_replicated(survivors: list[NodeProcess], cmap: ClusterMap) -> None:
    """Wait until each survivor's copy of each vbucket is at its active's high seqno (the
    dead node, still a replica in the map, is left out)."""
    by_port = {n.port: n for n in survivors}

    async def caught_up() -> bool:
        high = {n.port: await seqnos(n) for n in survivors}
        for vb in range(cmap.vbuckets):
            active = cmap.active(vb)
            assert active is not None
            want = high[active.port][vb][0]
            for port in by_port:
                if high[port].get(vb, (-1, -1))[0] != want:
                    return False
        return True

    await eventually(caught_up, "survivors' copies did not catch up")


async def leader_name(endpoint: str, cluster: str) -> str:
    async with await ClusterMetadata.connect(endpoint, cluster) as metadata:
        found = await metadata.leader()
    assert found is not None, "no orchestrator"
    return found[0]
