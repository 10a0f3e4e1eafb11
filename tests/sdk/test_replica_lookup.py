"""``lookup_in_any_replica`` through the official SDK (issue 26): its C++ core refuses the call
with FeatureUnavailableException unless the bucket's config lists ``subdoc.ReplicaRead`` in
``bucketCapabilities``; with it, the lookup is answered by the active and by each replica
(the ReplicaRead document flag, HELLO SubdocReplicaRead)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import couchbase.subdocument as SD
import pytest
from couchbase.collection import Collection
from couchbase.exceptions import DocumentUnretrievableException

from changefeed.cli.node_process import NodeProcess
from support.cluster import start_cluster, wait_replicated
from support.etcd import running_etcd
from support.nodes import node_factory

from .conftest import connect

pytestmark = pytest.mark.timeout(180)
DOC = {"name": "ada", "tags": ["a", "b"]}


def test_lookup_in_any_replica_is_answered(collection: Collection, key: str) -> None:
    written = collection.upsert(key, DOC)
    result = collection.lookup_in_any_replica(key, [SD.get("name"), SD.count("tags")])
    assert result.content_as[str](0) == "ada"
    assert result.content_as[int](1) == 2
    assert result.cas == written.cas
    assert not result.is_replica  # one node, no replicas: the active answers
    with pytest.raises(DocumentUnretrievableException):
        collection.lookup_in_any_replica(f"{key}-missing", [SD.get("name")])


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    work: Path = tmp_path_factory.mktemp("replica-lookup")
    with running_etcd(work) as etcd, node_factory(work) as nodes:
        yield start_cluster(nodes, etcd.endpoint, "lookup", count=3, replicas=2)


def test_lookup_in_any_replica_on_a_cluster(three: list[NodeProcess]) -> None:
    sdk = connect(three[0])
    try:
        collection = sdk.bucket("default").default_collection()
        for i in range(16):  # every vbucket: each node's actives
            collection.upsert(f"doc-{i}", {"n": i, "tags": ["x"] * i})
        asyncio.run(wait_replicated(three))
        for i in range(16):
            result = collection.lookup_in_any_replica(f"doc-{i}", [SD.get("n"), SD.count("tags")])
            assert (result.content_as[int](0), result.content_as[int](1)) == (i, i)
        copies = list(collection.lookup_in_all_replicas("doc-3", [SD.get("n")]))
        assert [c.content_as[int](0) for c in copies if not c.is_replica] == [3]
    finally:
        sdk.close()


def test_every_replica_answers_lookup_in_all_replicas(three: list[NodeProcess]) -> None:
    sdk = connect(three[1])
    try:
        collection = sdk.bucket("default").default_collection()
        collection.upsert("all-replicas", {"n": 7})
        asyncio.run(wait_replicated(three))
        copies = list(collection.lookup_in_all_replicas("all-replicas", [SD.get("n")]))
        assert sum(1 for c in copies if c.is_replica) == 2
        assert [c.content_as[int](0) for c in copies] == [7, 7, 7]
    finally:
        sdk.close()
