"""Named collections on a 3-node cluster: `changefeed collection create` sets the manifest on
every node, the official SDK writes and reads the collection on every node's actives, and a
filtered DCP client streams it from every active with one creation event per vbucket."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from changefeed.cli.main import cli
from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import DcpClient
from changefeed.consumer.events import Changes, CollectionEvent, StreamEnded
from changefeed.protocol.collections import SystemEvent, split_key
from support.clients import PASSWORD, USER, dcp_config
from support.cluster import start_cluster, wait_replicated
from support.etcd import running_etcd
from support.nodes import node_factory

from .conftest import connect

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
VBUCKETS = 8


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    work: Path = tmp_path_factory.mktemp("collections-cluster")
    with running_etcd(work) as etcd, node_factory(work) as nodes:
        yield start_cluster(nodes, etcd.endpoint, "coll", count=3, replicas=1, vbuckets=VBUCKETS)


def test_a_collection_made_on_a_cluster_is_served_and_streamed_by_every_node(
    three: list[NodeProcess],
) -> None:
    made = CliRunner().invoke(
        cli,
        ["collection", "create", "app.orders", "--json", "--host", HOST,
         "--port", str(three[0].port), "--user", USER, "--password", PASSWORD],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    answer = json.loads(made.output)
    assert sorted(answer["nodes"]) == sorted(f"{HOST}:{n.port}" for n in three)
    assert set(answer["nodes"].values()) == {"set"}

    cluster = connect(three[1])
    try:
        orders = cluster.bucket("default").scope("app").collection("orders")
        for i in range(48):  # every vbucket, so every node's actives
            orders.upsert(f"order-{i}", {"n": i})
        assert orders.get("order-7").content_as[dict] == {"n": 7}
    finally:
        cluster.close()
    asyncio.run(wait_replicated(three))

    async def stream() -> tuple[set[bytes], dict[int, list[SystemEvent]]]:
        keys: set[bytes] = set()
        events: dict[int, list[SystemEvent]] = {}
        config = dcp_config(three[2], to_latest=True, collections=("app.orders",))
        async with DcpClient(config) as client:
            await client.stream(list(range(VBUCKETS)))
            ended = 0
            async for event in client.events():
                if isinstance(event, Changes):
                    keys.update(split_key(bytes(k))[1] for k in event.columns.key)
                elif isinstance(event, CollectionEvent):
                    events.setdefault(event.vbucket, []).append(event.message.event)
                elif isinstance(event, StreamEnded):
                    ended += 1
                    if ended == VBUCKETS:
                        break
        return keys, events

    keys, events = asyncio.run(stream())
    assert keys == {f"order-{i}".encode() for i in range(48)}
    assert events == {vb: [SystemEvent.BEGIN_COLLECTION] for vb in range(VBUCKETS)}
