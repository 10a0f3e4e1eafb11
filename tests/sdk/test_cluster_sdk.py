"""The official SDK against a 3-node cluster (issue 14 with issue 11): it bootstraps from one
node, routes by the real map, reads replicas (get_any_replica, get_all_replicas), follows a
failover, and a durable write is acknowledged only once a majority of its copies hold it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from couchbase.cluster import Cluster
from couchbase.durability import Durability, ServerDurability
from couchbase.exceptions import (
    AmbiguousTimeoutException,
    DurabilityImpossibleException,
    DurabilitySyncWriteAmbiguousException,
)
from couchbase.options import UpsertOptions

from changefeed.cli.node_process import NodeProcess
from changefeed.vbmap import vbucket_for_key
from support.cluster import (
    cluster_map,
    start_cluster,
    wait_in_sync_published,
    wait_replicated,
)
from support.etcd import running_etcd
from support.nodes import node_factory

from .conftest import connect

pytestmark = pytest.mark.timeout(180)


ETCD: list[str] = []  # the module's etcd endpoint
DOCUMENTS = 64


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    work: Path = tmp_path_factory.mktemp("sdk-cluster")
    with running_etcd(work) as etcd, node_factory(work) as nodes:
        ETCD[:] = [etcd.endpoint]
        yield start_cluster(nodes, etcd.endpoint, "sdk", count=3, replicas=2, failover_timeout_s=2)


@pytest.fixture(scope="module")
def sdk(three: list[NodeProcess]) -> Iterator[Cluster]:
    cluster = connect(three[1])  # bootstrap from any node
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def documents(sdk: Cluster, three: list[NodeProcess]) -> int:
    """doc-0..doc-63 written through the SDK (every vbucket, so every node's actives are
    written) and replicated to every copy. A fixture, not the first test's side effect: under
    pytest-xdist a module's tests may run on two workers, each with its own cluster, and the
    failover test read doc-0 as DocumentNotFound on a cluster where nothing wrote it."""
    collection = sdk.bucket("default").default_collection()
    for i in range(DOCUMENTS):
        collection.upsert(f"doc-{i}", {"n": i})
    asyncio.run(wait_replicated(three))
    return DOCUMENTS


def test_the_sdk_routes_by_the_map_and_reads_every_replica(sdk: Cluster, documents: int) -> None:
    collection = sdk.bucket("default").default_collection()
    for i in range(0, documents, 7):
        assert collection.get(f"doc-{i}").content_as[dict] == {"n": i}
        replica = collection.get_any_replica(f"doc-{i}")
        assert replica.content_as[dict] == {"n": i}
        copies = list(collection.get_all_replicas(f"doc-{i}"))
        assert len(copies) == 3  # the active and both replicas
        assert sum(1 for c in copies if c.is_replica) == 2
        assert all(c.content_as[dict] == {"n": i} for c in copies)


def test_a_durable_write_is_acknowledged_once_a_majority_holds_it(sdk: Cluster) -> None:
    collection = sdk.bucket("default").default_collection()
    options = UpsertOptions(durability=ServerDurability(Durability.MAJORITY))
    for i in range(16):
        key = f"durable-{i}"
        result = collection.upsert(key, {"x": i}, options)
        assert collection.get(key).cas == result.cas
        # At the ack a majority (the active and a replica) holds the prepare; the commit
        # follows it to every copy. (That a promoted replica commits what it holds is
        # tests/cluster/test_sync_writes.py's business.)
        deadline = time.monotonic() + 10
        while True:
            copies = [c for c in collection.get_all_replicas(key) if c.cas == result.cas]
            if len(copies) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert len(copies) == 3, (key, len(copies))
        assert all(c.content_as[dict] == {"x": i} for c in copies)


def test_the_sdk_follows_a_failover(sdk: Cluster, three: list[NodeProcess], documents: int) -> None:
    collection = sdk.bucket("default").default_collection()
    before = asyncio.run(cluster_map(three[1]))
    # Until the actives have published their in-sync sets a failover is refused (no replica
    # is known to be in sync): that is the rule, so wait for them.
    asyncio.run(wait_in_sync_published(ETCD[0], "sdk"))
    victim = three[0]
    victim.kill()
    deadline = time.monotonic() + 60  # the failover and the SDK's new map, slow under load
    written = 0
    while time.monotonic() < deadline and written < 64:
        try:
            collection.upsert(f"after-{written}", {"n": written})
            written += 1
        except Exception:  # the SDK's own timeout while the map moves
            time.sleep(0.2)
    assert written == 64, "writes did not resume after the failover"
    after = asyncio.run(cluster_map(three[1]))
    assert after.rev > before.rev
    assert all(
        (a := after.active(vb)) is not None and a.port != victim.port
        for vb in range(after.vbuckets)
    )
    for i in range(0, documents, 5):
        assert collection.get(f"doc-{i}").content_as[dict] == {"n": i}


def test_a_durable_write_without_enough_copies_is_impossible_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """Replicas 1, the replica node stopped and not failed over: a majority of 2 copies is 2,
    one is reachable, so the SDK gets DurabilityImpossibleException and nothing is written;
    a plain upsert still goes through."""
    with running_etcd(tmp_path) as etcd, node_factory(tmp_path) as nodes:
        n1, n2 = start_cluster(nodes, etcd.endpoint, "sdk-two", count=2, replicas=1)
        asyncio.run(wait_replicated([n1, n2]))
        n2.stop()
        cluster = connect(n1)
        try:
            collection = cluster.bucket("default").default_collection()
            led = asyncio.run(cluster_map(n1))
            key = next(
                k for k in (f"lonely-{i}" for i in range(1000))
                if (a := led.active(vbucket_for_key(k.encode(), led.vbuckets))) is not None
                and a.port == n1.port
            )  # fmt: skip
            written = collection.upsert(key, {"plain": True})
            options = UpsertOptions(durability=ServerDurability(Durability.MAJORITY))
            deadline = time.monotonic() + 45
            while True:  # until n1 notices the replica stream is gone
                try:
                    collection.upsert(key, {"durable": True}, options)
                except DurabilityImpossibleException:
                    break
                except (DurabilitySyncWriteAmbiguousException, AmbiguousTimeoutException):
                    # Sent before n1 saw n2's stream end (late under load) the write waited
                    # for n2's ack and timed out, aborted: not one that went through. Again.
                    pass
                else:
                    pytest.fail("a durable write went through with one copy of two")
                assert time.monotonic() < deadline, "n1 never refused the durable write"
                time.sleep(0.1)
            current = collection.get(key)
            assert current.cas == written.cas  # the refused write changed nothing
        finally:
            cluster.close()
