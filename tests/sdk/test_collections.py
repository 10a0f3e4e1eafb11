"""Named collections through the official SDK: scopes and collections made with ``changefeed
collection``, then CRUD, sub-document and multi operations in two collections of two scopes,
maxTTL, a collection dropped and recreated under writes, and the SDK refreshing a collection id
the node answers UNKNOWN_COLLECTION for."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta

import couchbase.subdocument as SD
import pytest
from click.testing import CliRunner
from couchbase.cluster import Cluster
from couchbase.durability import DurabilityLevel, ServerDurability
from couchbase.exceptions import (
    CollectionNotFoundException,
    CouchbaseException,
    DocumentExistsException,
    DocumentNotFoundException,
)
from couchbase.options import GetOptions, UpsertMultiOptions, UpsertOptions

from changefeed.cli.main import cli
from changefeed.cli.node_process import HOST, NodeProcess
from support.clients import PASSWORD, USER

from .conftest import SHORT_TIMEOUT


def run_cli(node: NodeProcess, *args: str) -> dict[str, object]:
    """``changefeed collection ARGS --json`` against the node (in this process); its JSON."""
    result = CliRunner().invoke(
        cli,
        ["collection", *args, "--json", "--host", HOST, "--port", str(node.port),
         "--user", USER, "--password", PASSWORD],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.output)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def made(node: NodeProcess) -> NodeProcess:
    """The node with inventory.orders, tenants.users and _default.short (maxTTL 1000 s)."""
    run_cli(node, "create", "inventory.orders")
    run_cli(node, "create", "tenants.users")
    run_cli(node, "create", "_default.short", "--max-ttl", "1000")
    return node


def test_the_cli_lists_what_it_created(made: NodeProcess) -> None:
    listed = run_cli(made, "list")
    names = {(row["scope"], row["collection"]) for row in listed["collections"]}  # type: ignore[attr-defined]
    assert {("_default", "_default"), ("inventory", "orders"), ("tenants", "users")} <= names
    short = [row for row in listed["collections"] if row["collection"] == "short"]  # type: ignore[attr-defined]
    assert short[0]["max_ttl"] == 1000
    failed = subprocess.run(  # the installed command, once
        [sys.executable, "-m", "changefeed", "collection", "create", "inventory.orders",
         "--port", str(made.port), "--user", USER, "--password", PASSWORD],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert failed.returncode == 1 and "inventory.orders exists" in failed.stderr


def test_crud_and_subdoc_in_two_collections_of_two_scopes(
    made: NodeProcess, cluster: Cluster
) -> None:
    bucket = cluster.bucket("default")
    orders = bucket.scope("inventory").collection("orders")
    users = bucket.scope("tenants").collection("users")
    default = bucket.default_collection()
    orders.upsert("k", {"kind": "order", "n": 1})
    users.upsert("k", {"kind": "user", "tags": []})
    assert orders.get("k").content_as[dict] == {"kind": "order", "n": 1}
    assert users.get("k").content_as[dict] == {"kind": "user", "tags": []}
    with pytest.raises(DocumentNotFoundException):
        default.get("k")  # the same key elsewhere is another document
    with pytest.raises(DocumentExistsException):
        orders.insert("k", {})
    orders.replace("k", {"kind": "order", "n": 2})
    orders.mutate_in("k", [SD.increment("n", 3), SD.upsert("paid", True)])
    users.mutate_in("k", [SD.array_append("tags", "admin")])
    looked = orders.lookup_in("k", [SD.get("n"), SD.exists("paid")])
    assert looked.content_as[int](0) == 5 and looked.exists(1)
    assert users.lookup_in("k", [SD.get("tags")]).content_as[list](0) == ["admin"]
    counter = orders.binary().increment("counter")
    assert counter.content == 0  # created with the initial value
    durable = ServerDurability(DurabilityLevel.MAJORITY)
    users.upsert("durable", {"d": 1}, UpsertOptions(durability=durable))
    assert users.get("durable").content_as[dict] == {"d": 1}
    users.remove("k")
    with pytest.raises(DocumentNotFoundException):
        users.get("k")
    assert orders.get("k").content_as[dict]["n"] == 5


def test_multi_operations_in_a_named_collection(made: NodeProcess, cluster: Cluster) -> None:
    users = cluster.bucket("default").scope("tenants").collection("users")
    docs = {f"multi-{i}": {"i": i} for i in range(20)}
    result = users.upsert_multi(docs, UpsertMultiOptions())
    assert result.all_ok
    got = users.get_multi(list(docs))
    assert got.all_ok
    assert {k: r.content_as[dict] for k, r in got.results.items()} == docs


def test_max_ttl_gives_documents_an_expiry(made: NodeProcess, cluster: Cluster) -> None:
    short = cluster.bucket("default").scope("_default").collection("short")
    before = datetime.now().timestamp()
    short.upsert("ttl", "x")
    after = datetime.now().timestamp()
    expiry = short.get("ttl", GetOptions(with_expiry=True)).expiry_time
    assert expiry is not None
    assert before + 1000 - 2 <= expiry.timestamp() <= after + 1000 + 2
    short.upsert("ttl", "y", expiry=timedelta(seconds=5000))  # capped to the maxTTL
    capped = short.get("ttl", GetOptions(with_expiry=True)).expiry_time
    assert capped is not None and capped.timestamp() <= after + 1000 + 60


def test_unknown_collection_is_refreshed_by_the_sdk(made: NodeProcess, cluster: Cluster) -> None:
    """The SDK caches a collection's id; after the collection is dropped and made again under
    a new id, the node answers the old id UNKNOWN_COLLECTION and the SDK fetches the new one."""
    run_cli(made, "create", "inventory.refresh")
    coll = cluster.bucket("default").scope("inventory").collection("refresh")
    coll.upsert("a", 1)  # the SDK now holds the first id
    first = run_cli(made, "drop", "inventory.refresh")
    again = run_cli(made, "create", "inventory.refresh")
    assert again["id"] != first["id"]
    coll.upsert("b", 2)  # old id -> UNKNOWN_COLLECTION -> GET_COLLECTION_ID -> retried
    assert coll.get("b").content_as[int] == 2
    with pytest.raises(DocumentNotFoundException):
        coll.get("a")  # the dropped collection's document is not in the new one


def test_a_collection_dropped_and_recreated_under_writes(
    made: NodeProcess, cluster: Cluster
) -> None:
    run_cli(made, "create", "tenants.busy")
    busy = cluster.bucket("default").scope("tenants").collection("busy")
    written: list[str] = []
    failed: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():  # bounded by the test's stop below
            key = f"w{i}"
            try:
                # The SDK's own timeout: it waits 500 ms before it asks for a collection's id
                # again, so a shorter one never sees the re-created collection.
                busy.upsert(key, i)
                written.append(key)
            except CouchbaseException as error:
                failed.append(error)
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        _wait(lambda: len(written) >= 20)
        run_cli(made, "drop", "tenants.busy")
        with pytest.raises((CollectionNotFoundException, CouchbaseException)):
            cluster.bucket("default").scope("tenants").collection("busy").get(
                "w0", timeout=SHORT_TIMEOUT
            )
        run_cli(made, "create", "tenants.busy")
        mark = len(written)
        _wait(lambda: len(written) >= mark + 20)
    finally:
        stop.set()
        thread.join(30)
    late = written[mark:]
    for key in late[:10]:
        busy.get(key)  # written after the re-creation: readable
    old = written[0]
    if old not in late:
        with pytest.raises(DocumentNotFoundException):
            busy.get(old)  # written before the drop: gone with the old collection


def _wait(predicate: object, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the writer made no progress"
        time.sleep(0.02)
