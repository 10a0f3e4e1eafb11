"""A node that will join a cluster refuses a manifest change until its agent has joined.

Between the listener coming up and the cluster agent's etcd connection (``Node.run`` starts
the agent after the listener: it needs the port), a SET_COLLECTIONS_MANIFEST used to be
applied to the node's own file alone: no fence, no etcd, and the nodes' manifests diverged
(a lower uid in etcd was then kept out, a higher one could fail against the extra collection).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from changefeed.consumer.collections_admin import edit_manifest, get_manifest
from changefeed.consumer.handshake import connect
from changefeed.protocol.errors import StatusError
from changefeed.protocol.status import Status
from changefeed.server.config import NodeConfig
from changefeed.server.node import Node
from support.clients import HOST, PASSWORD, USER


def test_a_joining_node_refuses_a_manifest_change_and_keeps_its_manifest(tmp_path: Path) -> None:
    async def scenario() -> None:
        node = Node(NodeConfig(data_dir=tmp_path, port=0, vbuckets=4, durable=False))
        node.context.manifests.joining_cluster = True  # what Node.run sets with a cluster agent
        await node.start()
        try:
            conn = await connect(
                HOST, node.port, agent="t", user=USER, password=PASSWORD, bucket="default"
            )
            try:
                before = await get_manifest(conn)
                with pytest.raises(StatusError) as refused:
                    await edit_manifest(conn, lambda m: m.with_collection("_default", "orders"))
                assert refused.value.code == Status.ETMPFAIL, refused.value
                assert "not joined its cluster" in str(refused.value)
                assert (await get_manifest(conn)) == before
                assert node.context.manifests.current == before
                # Once joined without a cluster proposer (a single node), changes apply here.
                node.context.manifests.joining_cluster = False
                after = await edit_manifest(conn, lambda m: m.with_collection("_default", "orders"))
                assert after.uid > before.uid and node.context.manifests.current == after
            finally:
                await conn.close()
        finally:
            await node.stop()

    asyncio.run(scenario())
