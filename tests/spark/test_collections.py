"""Spark per collection on one real node and one local[2] session (issue 28 item 5).

- the source with ``collections`` / ``scope``: rows carry ``scope`` and ``collection``, keys
  without the collection id, only the chosen collections (batch read, against the store);
- the mirror of two collections in two scopes: one table pair each under
  ``tables/<scope>/<collection>``, equal to the store on every column; a collection created
  between runs gets its tables (even with no documents yet), a dropped one is marked and keeps
  its rows; a replayed micro-batch (its commit removed from the checkpoint) changes nothing.

The truth is an independent DCP read of each collection (``read_current_state`` with a
collections filter), not the Spark source. Writes go over a collections KV connection with
the key's collection id in front (as the SDK sends them), with flags and expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import read_current_state
from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA
from changefeed.consumer.collections_admin import edit_manifest, get_manifest
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import call, connect
from changefeed.protocol.collections import encode_leb128, split_key
from changefeed.protocol.collections_manifest import Manifest
from changefeed.protocol.errors import KeyNotFoundError
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.spark import MirrorWriter, read_mirror
from changefeed.spark.collection_registry import DROPPED_FILE, Registry
from changefeed.spark.merge_source import DELETED
from changefeed.spark.mirror_status import collection_statuses
from changefeed.spark.options import OptionError, SourceOptions
from changefeed.spark.refetch import refetch_source
from changefeed.vbmap import vbucket_for_key
from support.clients import BUCKET, PASSWORD, USER, dcp_config
from support.nodes import node_factory

from .helpers import Doc, assert_changelog_once, diff, table_state

pytestmark = pytest.mark.timeout(300)
VBUCKETS = 8
FAST_NODE = ["--no-durable"]
EXPIRY = 2_000_000_000  # absolute, far ahead: kept, never expires during the test


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node for the module (a node and a Spark session per test would cost ~10 s more)."""
    with node_factory(tmp_path_factory.mktemp("collections")) as factory:
        yield factory(vbuckets=VBUCKETS, args=FAST_NODE)


# -- writing and the truth ------------------------------------------------------------------


async def kv(node: NodeProcess) -> Connection:
    features = [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.COLLECTIONS]
    return await connect(
        HOST, node.port, agent="spark-collections-test", user=USER, password=PASSWORD,
        bucket=BUCKET, features=features,
    )  # fmt: skip


def edit(node: NodeProcess, change: Callable[[Manifest], Manifest]) -> Manifest:
    async def run() -> Manifest:
        conn = await kv(node)
        try:
            return await edit_manifest(conn, change)
        finally:
            await conn.close()

    return asyncio.run(run())


def write(
    node: NodeProcess, path: str, rng: random.Random, count: int, *, keys: int, tag: str
) -> None:
    """``count`` random upserts (flags and expiry) and deletes in collection ``path``."""

    async def run() -> None:
        conn = await kv(node)
        try:
            manifest = await get_manifest(conn)
            found = manifest.resolve(path)[1]
            assert found is not None, path
            prefix = encode_leb128(found.uid)
            for i in range(count):
                key = f"{tag}{rng.randrange(keys)}".encode()
                vb = vbucket_for_key(key, VBUCKETS)
                if rng.random() < 0.1:
                    with contextlib.suppress(KeyNotFoundError):  # not there: nothing to do
                        await call(conn, Opcode.DELETE, vbucket=vb, key=prefix + key)
                    continue
                value = json.dumps({"n": i, "tag": tag, "path": path}).encode()
                flags = rng.choice([0, 7, 0x8000_0001])
                expiry = rng.choice([0, EXPIRY])
                extras = struct.pack(">II", flags, expiry)
                await call(conn, Opcode.SET, vbucket=vb, extras=extras, key=prefix + key,
                           value=value)  # fmt: skip
        finally:
            await conn.close()

    asyncio.run(run())


def _int32(u32: int) -> int:
    return u32 - 2**32 if u32 >= 2**31 else u32


def truth(node: NodeProcess, path: str) -> dict[str, Doc]:
    """Every live document of collection ``path`` with all its metadata, from a DCP read of
    that collection alone."""
    config = dcp_config(node, collections=(path,))
    docs = asyncio.run(read_current_state(config, range(VBUCKETS)))
    out = {}
    for raw, doc in docs.items():
        if doc.deleted:
            continue
        _, key = split_key(raw)
        out[key.decode()] = Doc(doc.vbucket, doc.seqno, doc.value, doc.cas, _int32(doc.flags),
                                _int32(doc.expiry), doc.rev_seqno)  # fmt: skip
    return out


# -- the source -----------------------------------------------------------------------------


def test_options_refuse_bad_collection_names() -> None:
    for bad, words in [
        ({"collections": "orders"}, "not scope.collection"),
        ({"collections": "a.b.c"}, "not scope.collection"),
        ({"collections": "shop._x"}, "must not start with _"),
        ({"scope": "sh op"}, "scope name 'sh op'"),
        ({"collections": "a.b", "scope": "a"}, "not both"),
        ({"collections": "a.b", "transport": "shm"}, "tcp only"),
    ]:
        with pytest.raises(OptionError, match=words):
            SourceOptions.parse(bad)
    parsed = SourceOptions.parse({"collections": " shop.orders , .x,shop.orders"})
    assert parsed.collections == ("shop.orders", "_default.x")
    assert parsed.wants("shop", "orders") and not parsed.wants("shop", "carts")
    every = SourceOptions.parse({"collections": "*"})
    assert every.collections_aware and every.collection_filter == ()
    assert not SourceOptions.parse({}).collections_aware


def test_batch_read_names_rows_and_keeps_to_its_collections(
    spark: Any, node: NodeProcess, rng: random.Random
) -> None:
    edit(node, lambda m: m.with_scope("shop").with_collection("shop", "orders")
         .with_scope("crm").with_collection("crm", "people"))  # fmt: skip
    write(node, "shop.orders", rng, 300, keys=120, tag="k")
    write(node, "crm.people", rng, 300, keys=120, tag="k")  # the same keys, another collection
    write(node, "_default._default", rng, 100, keys=50, tag="k")
    want = {("shop", "orders"): truth(node, "shop.orders"),
            ("crm", "people"): truth(node, "crm.people")}  # fmt: skip

    rows = (
        spark.read.format("changefeed")
        .options(**node.source_options(collections="shop.orders,crm.people", format="binary"))
        .load()
    )
    assert rows.columns[-3:] == ["scope", "collection", "collection_id"]
    table = rows.toArrow()
    got: dict[tuple[str, str], pa.Table] = {}
    for scope, collection in want:
        mine = pc.and_(pc.equal(table.column("scope"), scope),
                       pc.equal(table.column("collection"), collection))  # fmt: skip
        got[(scope, collection)] = table.filter(mine)
    assert sum(t.num_rows for t in got.values()) == table.num_rows, "rows of another collection"
    for name, docs in want.items():
        state = table_state(got[name])
        assert state == docs, f"{name}: {diff(state, docs)}"


@pytest.mark.slow
def test_batch_read_of_a_scope_and_typed(spark: Any, node: NodeProcess, rng: random.Random) -> None:
    """``scope`` reads its collections only; typed documents keep the names last."""
    edit(node, lambda m: m.with_scope("hr").with_collection("hr", "staff")
         .with_scope("fin").with_collection("fin", "ledger"))  # fmt: skip
    write(node, "hr.staff", rng, 200, keys=80, tag="k")
    write(node, "fin.ledger", rng, 200, keys=80, tag="k")
    want = {("hr", "staff"): truth(node, "hr.staff"),
            ("fin", "ledger"): truth(node, "fin.ledger")}  # fmt: skip
    scoped = (
        spark.read.format("changefeed")
        .options(**node.source_options(scope="hr", format="binary"))
        .load()
        .toArrow()
    )
    assert set(scoped.column("collection").to_pylist()) == {"staff"}
    assert table_state(scoped) == want[("hr", "staff")]

    typed = (  # documents as typed columns: the names come after the fields
        spark.read.format("changefeed")
        .options(**node.source_options(collections="fin.ledger", schema="n bigint, tag string"))
        .load()
    )
    assert typed.columns[-3:] == ["scope", "collection", "collection_id"]
    values = {r["key"]: r["n"] for r in typed.select("key", "n").collect()}
    assert values == {k: json.loads(d.value)["n"] for k, d in want[("fin", "ledger")].items()}


# -- the mirror -----------------------------------------------------------------------------


def run_mirror(
    spark: Any, node: NodeProcess, root: Path, collections: str, writer: str = "distributed"
) -> list[int]:
    """One availableNow run of readStream -> foreachBatch(MirrorWriter) per collection; the
    ids of the micro-batches it ran. ``collections`` ``scope:<name>``: option ``scope``."""
    chosen = (
        {"scope": collections.removeprefix("scope:")}
        if collections.startswith("scope:")
        else {"collections": collections}
    )
    options = node.source_options(
        **chosen, format="binary", maxOffsetsPerTrigger="5000",
        failOnDataLoss="false", mirrorGroups="2", mirrorTasks="2", mirrorWriter=writer,
    )  # fmt: skip
    writer = MirrorWriter(root / "tables", options)
    query = (
        spark.readStream.format("changefeed")
        .options(**options)
        .load()
        .writeStream.foreachBatch(writer)
        .option("checkpointLocation", str(root / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(240), "the availableNow query did not finish"
    finally:
        query.stop()
        writer.close()
    assert query.exception() is None, query.exception()
    return [int(p["batchId"]) for p in query.recentProgress]


def assert_tables_match(tables: Path, path: str, want: dict[str, Doc]) -> None:
    """The collection's mirror equals ``want`` on every column; its changelog has each change
    once, and its live rows end where the mirror is."""
    root = tables / path
    state = table_state(read_mirror(root))
    assert state == want, f"{path}: {diff(state, want)}"
    logged = assert_changelog_once(root)
    assert {"scope", "collection", "collection_id"}.isdisjoint(logged.column_names)


@pytest.mark.parametrize("writer", ["distributed", pytest.param("local", marks=pytest.mark.slow)])
def test_mirror_per_collection_created_dropped_and_replayed(
    spark: Any, node: NodeProcess, rng: random.Random, tmp_path: Path, writer: str
) -> None:
    ops, web = f"ops{writer[0]}", f"web{writer[0]}"  # each run its own collections
    edit(node, lambda m: m.with_scope(ops).with_collection(ops, "events")
         .with_scope(web).with_collection(web, "sessions"))  # fmt: skip
    write(node, f"{ops}.events", rng, 400, keys=150, tag="e")
    write(node, f"{web}.sessions", rng, 400, keys=150, tag="e")  # same keys: other tables
    chosen = f"{ops}.events,{web}.sessions,{ops}.late"  # ops.late: created while the job runs
    run_mirror(spark, node, tmp_path, chosen, writer)
    tables = tmp_path / "tables"
    assert_tables_match(tables, f"{ops}/events", truth(node, f"{ops}.events"))
    assert_tables_match(tables, f"{web}/sessions", truth(node, f"{web}.sessions"))
    assert not (tables / ops / "late").exists()
    assert not (tables / "mirror").exists(), "a collection-aware job keeps no bucket table"

    # Between runs: ops.late created (empty), more writes, web.sessions written then dropped:
    # the writes the job had not read before the drop went with the collection, as on the
    # node; what the job had mirrored stays.
    sessions = truth(node, f"{web}.sessions")
    edit(node, lambda m: m.with_collection(ops, "late"))
    write(node, f"{web}.sessions", rng, 100, keys=150, tag="e")
    edit(node, lambda m: m.without_collection(web, "sessions"))
    write(node, f"{ops}.events", rng, 200, keys=150, tag="e")
    run_mirror(spark, node, tmp_path, chosen, writer)
    assert_tables_match(tables, f"{ops}/events", truth(node, f"{ops}.events"))
    assert_tables_match(tables, f"{web}/sessions", sessions)  # kept, with its last rows
    late = DeltaTable(str(tables / ops / "late" / "mirror"))
    assert late.to_pyarrow_table().num_rows == 0  # its tables exist before its first document
    registry = {e.name: e for e in Registry.load(str(tables)).entries}
    assert sorted(registry) == [f"{ops}.events", f"{ops}.late", f"{web}.sessions"]
    assert registry[f"{web}.sessions"].dropped is not None
    assert registry[f"{ops}.events"].dropped is None and registry[f"{ops}.late"].dropped is None
    assert json.loads((tables / web / "sessions" / DROPPED_FILE).read_text())["collection"] \
        == f"{web}.sessions"  # fmt: skip

    # A replay of the last micro-batch (Spark runs a batch again when its commit is missing
    # from the checkpoint) changes nothing; the same run then brings the new collection's
    # first documents.
    write(node, f"{ops}.late", rng, 150, keys=60, tag="l")
    done = (tmp_path / "checkpoint" / "commits").glob("[0-9]*")
    commits = sorted(done, key=lambda p: int(p.name))
    commits[-1].unlink()
    (commits[-1].parent / f".{commits[-1].name}.crc").unlink(missing_ok=True)
    assert int(commits[-1].name) in run_mirror(spark, node, tmp_path, chosen, writer)  # replayed
    for path, name in [(f"{ops}/events", f"{ops}.events"), (f"{ops}/late", f"{ops}.late")]:
        assert_tables_match(tables, path, truth(node, name))
    assert_tables_match(tables, f"{web}/sessions", sessions)

    statuses = {s.collection: s for s in collection_statuses(tables)}
    assert sorted(statuses) == [f"{ops}.events", f"{ops}.late", f"{web}.sessions"]
    assert statuses[f"{web}.sessions"].dropped and not statuses[f"{ops}.events"].dropped
    assert statuses[f"{ops}.late"].status.rows == len(truth(node, f"{ops}.late"))


@pytest.mark.slow
def test_mirror_of_a_collection_dropped_and_created_again_keeps_them_apart(
    spark: Any, node: NodeProcess, rng: random.Random, tmp_path: Path
) -> None:
    """``dr.c`` written, mirrored, written again, dropped and created again (a new id), the
    new one written with the same keys; the next batch has rows of both under one name. A
    mirror of the scope (its stream still sends a dropped collection's changes made before
    the drop) routes each by id: the old tables end at the old collection's last state, the
    new ``dr/c~<id>`` equal the new collection."""
    first = edit(node, lambda m: m.with_scope("dr").with_collection("dr", "c"))
    write(node, "dr.c", rng, 300, keys=100, tag="k")
    run_mirror(spark, node, tmp_path, "scope:dr")
    tables = tmp_path / "tables"
    assert_tables_match(tables, "dr/c", truth(node, "dr.c"))

    write(node, "dr.c", rng, 300, keys=100, tag="k")  # rows the mirror reads after the drop
    old_last = truth(node, "dr.c")
    edit(node, lambda m: m.without_collection("dr", "c"))
    second = edit(node, lambda m: m.with_collection("dr", "c"))
    write(node, "dr.c", rng, 200, keys=100, tag="k")
    old, new = first.resolve("dr.c")[1], second.resolve("dr.c")[1]
    assert old is not None and new is not None and old.uid != new.uid
    run_mirror(spark, node, tmp_path, "scope:dr")
    assert_tables_match(tables, "dr/c", old_last)  # with its last rows, none of the new one
    assert_tables_match(tables, f"dr/c~{new.uid:x}", truth(node, "dr.c"))
    entries = [(e.path, e.cid, e.dropped is not None) for e in Registry.load(str(tables)).entries]
    assert entries == [("dr/c", old.uid, True), (f"dr/c~{new.uid:x}", new.uid, False)]


def test_reread_of_a_dropped_collection_does_not_read_its_successor(
    node: NodeProcess, rng: random.Random
) -> None:
    """The re-read of a table's keys (after a rollback) asks for its collection id: the table
    of ``s.c`` dropped and created again reads nothing of the new ``s.c`` (the old one has
    nothing left on the node: every key comes back a tombstone), and the new one's reads its
    own documents. No Spark: ``refetch_source`` is what the writers call."""
    first = edit(node, lambda m: m.with_scope("rr").with_collection("rr", "c"))
    write(node, "rr.c", rng, 150, keys=40, tag="k")
    edit(node, lambda m: m.without_collection("rr", "c"))
    second = edit(node, lambda m: m.with_collection("rr", "c"))
    write(node, "rr.c", rng, 150, keys=40, tag="k")  # the same keys in the new collection
    old, new = first.resolve("rr.c")[1], second.resolve("rr.c")[1]
    assert old is not None and new is not None and old.uid != new.uid
    want = truth(node, "rr.c")
    assert want, "the new collection has documents"
    keys = {f"k{i}": vbucket_for_key(f"k{i}".encode(), VBUCKETS) for i in range(40)}

    def reread(cid: int) -> dict[str, bytes | None]:
        """key -> the document read again (None: a tombstone)."""
        options = node.source_options(collections="rr.c", collectionId=str(cid))
        rows = refetch_source(keys, CHANGE_ROW_SCHEMA, options).to_pylist()
        assert sorted(r["key"] for r in rows) == sorted(keys)
        return {r["key"]: None if r[DELETED] else r["value"] for r in rows}

    assert reread(new.uid) == {k: want[k].value if k in want else None for k in keys}
    assert set(reread(old.uid).values()) == {None}, "read the new collection's documents"
    with pytest.raises(ValueError, match="collectionId: 'x' is not a collection id"):
        refetch_source(
            keys, CHANGE_ROW_SCHEMA, node.source_options(collections="rr.c", collectionId="x")
        )


# -- the command ----------------------------------------------------------------------------


def test_mirror_command_refuses_unknown_collections_before_spark(
    node: NodeProcess, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from changefeed.cli.main import cli

    edit(node, lambda m: m.with_scope("cli").with_collection("cli", "orders"))
    tables = tmp_path / "tables"
    runner = CliRunner()
    for given, words in [
        ("cli.nope", "bucket 'default' has no cli.nope (it has: _default._default, "),
        ("nosuch.*", "has no nosuch.*"),
        ("cli", "not scope.collection"),
        ("cli.*,cli.orders", "give one 'scope.*'"),
    ]:
        result = runner.invoke(
            cli, ["mirror", "--cluster", node.address, "--tables", str(tables), "--collections",
                  given, "--format", "binary"],
        )  # fmt: skip
        assert result.exit_code == 2, (given, result.output)
        assert words in result.output, (given, result.output)
        assert "Traceback" not in result.output
    assert not tables.exists(), "a refused start leaves no directory"


@pytest.mark.slow
@pytest.mark.timeout(900)  # two Spark jobs from scratch, on a loaded machine
def test_mirror_command_killed_mid_run_does_not_duplicate(
    node: NodeProcess, rng: random.Random, tmp_path: Path
) -> None:
    """``changefeed mirror --collections`` SIGKILLed (its whole process group: the driver's
    Python, the JVM, the workers) after a random number of table commits, then run again:
    each change once in each changelog, each mirror equal to its collection."""
    import os
    import signal
    import subprocess
    import sys
    import time

    edit(node, lambda m: m.with_scope("kill").with_collection("kill", "a")
         .with_scope("kill2").with_collection("kill2", "b"))  # fmt: skip
    write(node, "kill.a", rng, 1500, keys=400, tag="x")
    write(node, "kill2.b", rng, 1500, keys=400, tag="x")
    tables = tmp_path / "tables"
    command = [
        sys.executable, "-m", "changefeed", "mirror", "--cluster", node.address, "--tables",
        str(tables), "--collections", "kill.a,kill2.b", "--format", "binary", "--once",
        "--max-offsets-per-trigger", "500", "--master", "local[2]",
    ]  # fmt: skip

    def commits() -> int:
        return sum(
            len(list((tables / path / table / "_delta_log").glob("*.json")))
            for path in ("kill/a", "kill2/b") for table in ("mirror", "changelog")
        )  # fmt: skip

    wanted = rng.randrange(1, 6)
    victim = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while commits() < wanted and victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
    assert victim.returncode == -signal.SIGKILL, "the job ended before it was killed"
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-2000:]
    for path, name in [("kill/a", "kill.a"), ("kill2/b", "kill2.b")]:
        assert_tables_match(tables, path, truth(node, name))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rollback_in_two_collections_rereads_each_collections_keys(
    spark: Any, nodes: Any, rng: random.Random, tmp_path: Path
) -> None:
    """A node restored from an old copy of its data (a diverged history) under a mirror of
    two collections holding the same keys: both changelogs get the rollback rows, and each
    mirror, whose voided keys are read again from its own collection, equals its collection."""
    restored = nodes(vbuckets=VBUCKETS, args=FAST_NODE)
    old_copy = tmp_path / "old-copy"
    edit(restored, lambda m: m.with_scope("rb").with_collection("rb", "a")
         .with_collection("rb", "b"))  # fmt: skip
    for path in ("rb.a", "rb.b"):
        write(restored, path, rng, 600, keys=200, tag="k")
    restored.stop()
    restored.copy_data(old_copy)
    restored.start()
    for path in ("rb.a", "rb.b"):  # W1: updates, deletes and keys only this history has
        write(restored, path, rng, 500, keys=200, tag="k")
        write(restored, path, rng, 200, keys=100, tag="lost")
    run_mirror(spark, restored, tmp_path, "rb.a,rb.b")
    tables = tmp_path / "tables"
    for path, name in [("rb/a", "rb.a"), ("rb/b", "rb.b")]:
        assert_tables_match(tables, path, truth(restored, name))

    restored.stop()
    restored.restore_data(old_copy)
    restored.start()  # a restored directory starts a new history branch
    for path in ("rb.a", "rb.b"):  # W2: another history, some W1-only keys again
        write(restored, path, rng, 900, keys=260, tag="k")
        write(restored, path, rng, 60, keys=100, tag="lost")
    run_mirror(spark, restored, tmp_path, "rb.a,rb.b")
    for path, name in [("rb/a", "rb.a"), ("rb/b", "rb.b")]:
        log = DeltaTable(str(tables / path / "changelog")).to_pyarrow_table()
        assert pc.sum(pc.equal(log.column("op"), "rollback")).as_py(), f"{path}: no rollback"
        state = table_state(read_mirror(tables / path))
        want = truth(restored, name)
        assert state == want, f"{path}: {diff(state, want)}"
