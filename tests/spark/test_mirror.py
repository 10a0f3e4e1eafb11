"""``MirrorWriter.write`` on hand-built Arrow micro-batches (no Spark).

Exactly once: a replayed batch id changes nothing, and a crash between the changelog commit and
the mirror commit is finished by the replay. Rollbacks: a ``rollback`` row re-reads, from a real
node, every key the lost history touched — held in the mirror above the rollback seqno, changed
before the rollback row in the same batch, or deleted in an earlier batch (only the changelog
remembers those) — and rows after the rollback row win over the re-read.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from changefeed.cli.node_process import NodeProcess
from changefeed.spark import ARROW_SCHEMA, MirrorWriter, read_mirror
from changefeed.spark import mirror as mirror_module
from changefeed.spark.key_index import KeyIndex
from changefeed.spark.mirror import APP_ID, MIRROR_COLUMNS, MirrorLayoutError, repartition_mirror
from changefeed.spark.node_state import fetch_latest_sync
from changefeed.spark.offsets import Offsets, VbOffset
from changefeed.spark.options import SourceOptions
from changefeed.spark.reading import VbRange, read_ranges_sync
from changefeed.vbmap import vbucket_for_key
from support.nodes import NodeFactory

from .helpers import (
    MetaOp,
    Model,
    assert_mirror_matches,
    changelog,
    store_state,
    table_state,
    table_values,
    values_of,
    write,
    write_meta,
)

VBUCKETS = 16
NO_NODE = {"cluster": "127.0.0.1:1"}  # batches without rollback rows never connect


def vb(key: str) -> int:
    return vbucket_for_key(key.encode(), VBUCKETS)


def change(seqno: int, key: str, value: bytes | None, *, op: str | None = None) -> dict[str, Any]:
    """One change row; ``value`` None is a deletion."""
    return {
        "vbucket": vb(key),
        "seqno": seqno,
        "key": key,
        "value": b"" if value is None else value,
        "op": op or ("deletion" if value is None else "mutation"),
        "cas": 1000 + seqno,
        "expiry": 0,
        "flags": 0,
        "rev_seqno": 1,
        "snap_start": seqno,
        "snap_end": seqno,
    }


def rollback(vbucket: int, seqno: int) -> dict[str, Any]:
    return {
        **change(seqno, "", b""),
        "vbucket": vbucket,
        "op": "rollback",
        "cas": 0,
        "rev_seqno": 0,
    }


def batch(*rows: dict[str, Any]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=ARROW_SCHEMA)


def mirror(path: Path) -> dict[str, bytes]:
    """Values only: hand-built rows carry metadata no node ever had."""
    return table_values(read_mirror(path))


def mirror_seqnos(path: Path) -> dict[str, int]:
    table = read_mirror(path)
    return dict(
        zip(table.column("key").to_pylist(), table.column("seqno").to_pylist(), strict=True)
    )


def versions(path: Path) -> tuple[int | None, int | None]:
    return tuple(  # type: ignore[return-value]
        DeltaTable(str(path / name)).transaction_version(APP_ID) for name in ("changelog", "mirror")
    )


def test_upserts_and_deletes_across_batches(tmp_path: Path) -> None:
    writer = MirrorWriter(tmp_path, NO_NODE)
    writer.write(batch(change(1, "a", b"a1"), change(2, "b", b"b1"), change(3, "a", b"a2")), 0)
    assert mirror(tmp_path) == {"a": b"a2", "b": b"b1"}
    writer.write(batch(change(4, "b", None), change(5, "c", b"c1"), change(6, "a", b"a3")), 1)
    assert mirror(tmp_path) == {"a": b"a3", "c": b"c1"}
    writer.write(batch(change(7, "c", b"c2", op="expiration"), change(8, "d", b"d1")), 2)
    assert mirror(tmp_path) == {"a": b"a3", "d": b"d1"}
    assert changelog(tmp_path).num_rows == 8
    assert versions(tmp_path) == (2, 2)
    seqnos = mirror_seqnos(tmp_path)
    assert seqnos == {"a": 6, "d": 8}


def test_a_replayed_batch_changes_nothing(tmp_path: Path) -> None:
    writer = MirrorWriter(tmp_path, NO_NODE)
    first = batch(change(1, "a", b"a1"), change(2, "b", b"b1"))
    writer.write(first, 0)
    writer.write(batch(change(3, "a", b"a2")), 1)
    writer.write(first, 0)  # a replay of an older batch: skipped by both tables
    writer.write(batch(change(3, "a", b"other")), 1)  # a replay with other rows: skipped too
    assert mirror(tmp_path) == {"a": b"a2", "b": b"b1"}
    assert changelog(tmp_path).num_rows == 3


def test_a_crash_between_the_commits_is_finished_by_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = MirrorWriter(tmp_path, NO_NODE)
    writer.write(batch(change(1, "a", b"a1")), 0)

    def crash(*args: object) -> None:
        raise KeyboardInterrupt("killed after the changelog commit")

    with monkeypatch.context() as patch:
        patch.setattr(writer, "_apply_mirror", crash)
        with pytest.raises(KeyboardInterrupt):
            writer.write(batch(change(2, "a", b"a2"), change(3, "b", b"b1")), 1)
    assert versions(tmp_path) == (1, 0)
    assert mirror(tmp_path) == {"a": b"a1"}

    writer.write(batch(change(2, "a", b"a2"), change(3, "b", b"b1")), 1)  # Spark's replay
    assert versions(tmp_path) == (1, 1)
    assert mirror(tmp_path) == {"a": b"a2", "b": b"b1"}
    assert changelog(tmp_path).num_rows == 3


def test_an_empty_batch_is_recorded(tmp_path: Path) -> None:
    writer = MirrorWriter(tmp_path, NO_NODE)
    writer.write(batch(change(1, "a", b"a1")), 0)
    writer.write(batch(), 1)
    assert versions(tmp_path) == (1, 1)
    writer.write(batch(change(1, "zz", b"replayed")), 1)
    assert mirror(tmp_path) == {"a": b"a1"}


def test_an_empty_first_batch(tmp_path: Path) -> None:
    writer = MirrorWriter(tmp_path, NO_NODE)
    writer.write(batch(), 0)
    writer.write(batch(change(1, "a", b"a1"), change(2, "a", None)), 1)
    assert mirror(tmp_path) == {}
    writer.write(batch(change(3, "a", b"a3")), 2)
    assert mirror(tmp_path) == {"a": b"a3"}


def keys_in(vbucket: int, count: int, prefix: str) -> list[str]:
    """``count`` keys that hash to ``vbucket``."""
    out = []
    i = 0
    while len(out) < count:  # about VBUCKETS tries per key
        key = f"{prefix}-{i}"
        if vb(key) == vbucket:
            out.append(key)
        i += 1
    return out


def test_rollback_rows_re_read_what_the_lost_history_touched(
    tmp_path: Path, nodes: NodeFactory
) -> None:
    """The mirror followed a history of vbucket 3 up to seqno 40 that the node lost after seqno
    20; the node now holds another history. Keys of other vbuckets stay as they were."""
    node = nodes(vbuckets=VBUCKETS, args=["--no-durable"])
    path = tmp_path / "tables"
    writer = MirrorWriter(path, node.source_options())
    common, lost_only, deleted, overwritten, late, same = keys_in(3, 6, "r")
    (other_key,) = keys_in(5, 1, "o")
    # The node's current state (the surviving history, plus its own new writes).
    write(
        node.port,
        [
            (common, b"common-v1"),
            (deleted, b"deleted-v1"),
            (overwritten, b"overwritten-v1"),
            (same, b"same-v1"),
            (overwritten, b"overwritten-v2-new-branch"),
            (late, b"late-on-node"),
        ],
    )
    # What the mirror saw: seqnos <= 20 are shared history, > 20 the lost branch.
    writer.write(
        batch(
            change(10, common, b"common-v1"),
            change(11, deleted, b"deleted-v1"),
            change(12, overwritten, b"overwritten-v1"),
            change(13, same, b"same-v1"),
            change(14, other_key, b"other-v1"),
        ),
        0,
    )
    writer.write(
        batch(
            change(21, lost_only, b"lost-only"),
            change(22, deleted, None),  # deleted in the lost history: in no mirror row now
            change(23, overwritten, b"overwritten-lost"),
        ),
        1,
    )
    assert mirror(path) == {
        common: b"common-v1",
        lost_only: b"lost-only",
        overwritten: b"overwritten-lost",
        same: b"same-v1",
        other_key: b"other-v1",
    }
    writer.write(
        batch(
            change(30, late, b"late-lost"),  # before the rollback row, above its seqno: void
            rollback(3, 20),
            change(21, late, b"late-from-stream"),  # after the rollback row: wins over re-read
            change(15, other_key, b"other-v2"),
        ),
        2,
    )
    got = mirror(path)
    want = {
        common: b"common-v1",
        deleted: b"deleted-v1",
        overwritten: b"overwritten-v2-new-branch",
        same: b"same-v1",
        late: b"late-from-stream",
        other_key: b"other-v2",
    }
    assert got == want
    seqnos = mirror_seqnos(path)
    assert seqnos[late] == 21
    assert seqnos[common] == 10, "a key below the rollback seqno is not re-read"
    logged = changelog(path)
    assert pc.sum(pc.equal(logged.column("op"), "rollback")).as_py() == 1
    truth = store_state(node)
    assert {k: v for k, v in values_of(truth).items() if vb(k) == 3 and k != late} == {
        k: v for k, v in got.items() if vb(k) == 3 and k != late
    }
    docs = table_state(read_mirror(path))
    for key in (deleted, overwritten):  # re-read: the node's document, every column
        assert docs[key] == truth[key], (key, docs[key], truth[key])


def test_rollback_to_zero_rebuilds_the_vbucket(tmp_path: Path, nodes: NodeFactory) -> None:
    node = nodes(vbuckets=VBUCKETS, args=["--no-durable"])
    path = tmp_path / "tables"
    writer = MirrorWriter(path, node.source_options())
    keys = keys_in(7, 40, "z")
    write(node.port, [(k, b"node-" + k.encode()) for k in keys[:25]])
    writer.write(batch(*(change(i + 1, k, b"mirror-" + k.encode()) for i, k in enumerate(keys))), 0)
    writer.write(batch(*(change(41 + i, k, None) for i, k in enumerate(keys[:10]))), 1)
    writer.write(batch(rollback(7, 0)), 2)
    assert mirror(path) == {k: b"node-" + k.encode() for k in keys[:25]}


# -- the pipeline without Spark: real change rows, real rollbacks --------------------------------


def mirror_to_latest(
    node: NodeProcess, writer: MirrorWriter, start: Offsets, batch_id: int
) -> Offsets:
    """One micro-batch as the source plans and reads it: every vbucket from ``start`` to the
    node's latest offsets, into ``writer``; returns the end offsets."""
    options = SourceOptions.parse(writer.options)
    latest, _ = fetch_latest_sync(options)
    ranges = [
        VbRange(vb, start.get(vb, VbOffset()), o.seqno, o.vb_uuid)
        for vb, o in sorted(latest.items())
    ]
    batches = list(read_ranges_sync(options, ranges))
    writer.write(pa.Table.from_batches(batches, ARROW_SCHEMA), batch_id)
    return latest


def docs(prefix: str, indexes: range | list[int], tag: str, *, seed: int) -> list[MetaOp]:
    """Documents with flags (some with the top bit: int32 narrowing) and expiries (some none)."""
    return [
        (
            f"{prefix}-{i:05d}",
            f"{tag}-{i}".encode(),
            (seed * 7919 + i) | (2**31 if i % 3 == 0 else 0),
            0 if i % 4 == 0 else 3600 * (1 + (seed + i) % 5),
        )
        for i in indexes
    ]


def test_after_a_rollback_the_mirror_holds_the_stores_metadata(
    tmp_path: Path, nodes: NodeFactory
) -> None:
    """W0; clean stop; copy OLD; W1 (updates with other flags/expiry, deletes, new keys) mirrored;
    restore OLD; W2 (a diverged history touching only some keys). The mirror re-reads every key
    W1 touched: afterwards each row equals the store's document on every column — seqno, cas,
    flags, expiry and rev_seqno, not only the value — and deleted keys are gone."""
    node = nodes(vbuckets=4, args=["--no-durable"])
    path = tmp_path / "tables"
    writer = MirrorWriter(path, node.source_options(failOnDataLoss="false"))
    model: Model = {}
    write_meta(node.port, docs("k", range(600), "W0", seed=0), model)
    write_meta(node.port, docs("k", range(0, 600, 2), "W0b", seed=1), model)  # rev_seqno 2
    node.stop()
    old_copy = node.copy_data(tmp_path / "old-copy")
    model_old = dict(model)

    node.start()
    write_meta(node.port, docs("k", range(0, 600, 3), "W1", seed=2), model)
    write(node.port, [(f"k-{i:05d}", None) for i in range(1, 600, 10)], model)
    write_meta(node.port, docs("lost", range(200), "W1", seed=3), model)
    offsets = mirror_to_latest(node, writer, {}, 0)
    assert_mirror_matches(path, node, model)

    node.stop()
    node.restore_data(old_copy)
    model = model_old
    node.start()
    write_meta(node.port, docs("k", range(0, 600, 7), "W2", seed=4), model)
    write_meta(node.port, docs("lost", range(0, 200, 5), "W2", seed=5), model)
    mirror_to_latest(node, writer, offsets, 1)

    log = changelog(path)
    rollbacks = log.filter(pc.equal(log.column("op"), "rollback"))
    assert rollbacks.num_rows > 0, "the second batch read a diverged history without a rollback"
    assert_mirror_matches(path, node, model)


# -- layout: vbucket partitions, appends of new keys, merges of the rest, compaction -------------


def operations(path: Path) -> list[tuple[str, str]]:
    """(operation, merge predicate) of the mirror's commits, oldest first."""
    history = DeltaTable(str(path / "mirror")).history()
    return [
        (h["operation"], h.get("operationParameters", {}).get("mergePredicate", ""))
        for h in reversed(history)
    ]


def test_new_keys_are_appended_and_a_merge_scans_only_their_vbuckets(tmp_path: Path) -> None:
    writer = MirrorWriter(tmp_path, NO_NODE)
    first = [change(i + 1, f"a{i}", b"v1") for i in range(40)]
    writer.write(batch(*first), 0)
    writer.write(batch(*(change(100 + i, f"b{i}", b"v1") for i in range(40))), 1)
    writer.write(
        batch(change(200, "b3", b"v2"), change(201, "a7", None), change(202, "c", b"v")), 2
    )
    table = DeltaTable(str(tmp_path / "mirror"))
    assert table.metadata().partition_columns == ["vbucket"]
    ops = operations(tmp_path)
    assert [op for op, _ in ops] == ["WRITE", "WRITE", "MERGE"], ops
    pruning, _, join = ops[2][1].partition(" AND t.vbucket = s.vbucket")
    assert join == " AND t.key = s.key", ops[2]
    named = {int(n) for n in re.findall(r"\d+", pruning)}
    assert named == {vb("b3"), vb("a7")}, (ops[2], "only the vbuckets of keys the mirror held")
    want = {f"a{i}": b"v1" for i in range(40) if i != 7} | {f"b{i}": b"v1" for i in range(40)}
    assert mirror(tmp_path) == want | {"b3": b"v2", "c": b"v"}


def test_many_changes_of_a_key_in_one_batch_leave_its_newest(tmp_path: Path) -> None:
    writer = MirrorWriter(tmp_path, NO_NODE)
    writer.write(batch(change(1, "a", b"a1"), change(2, "gone", b"g1")), 0)
    writer.write(
        batch(
            change(3, "a", b"a2"), change(4, "gone", None), change(5, "a", b"a3"),
            change(6, "new", b"n1"), change(7, "new", None), change(8, "new", b"n2"),
            change(9, "brief", b"b1"), change(10, "brief", None, op="expiration"),
        ),
        1,
    )  # fmt: skip
    assert mirror(tmp_path) == {"a": b"a3", "new": b"n2"}
    assert mirror_seqnos(tmp_path) == {"a": 5, "new": 8}


def test_keys_another_writer_added_are_merged_not_added_twice(tmp_path: Path) -> None:
    writer = MirrorWriter(tmp_path, NO_NODE)
    writer.write(batch(change(1, "a", b"a1")), 0)
    other = MirrorWriter(tmp_path, NO_NODE, app_id="someone-else")
    other.write(batch(change(1, "x", b"x-other"), change(2, "y", b"y-other")), 0)
    writer.write(batch(change(2, "x", b"x-ours"), change(3, "z", b"z1")), 1)  # the index is stale
    assert mirror(tmp_path) == {"a": b"a1", "x": b"x-ours", "y": b"y-other", "z": b"z1"}


def unpartitioned_mirror(path: Path, rows: list[dict[str, Any]], batch_id: int) -> None:
    """Tables as an older writer left them: changelog and an unpartitioned mirror."""
    changes = batch(*rows)
    logged = changes.append_column("batch_id", pa.array([batch_id] * len(rows), pa.int64()))
    txn = CommitProperties(app_transactions=[Transaction(APP_ID, batch_id)])
    write_deltalake(str(path / "changelog"), logged, commit_properties=txn)
    documents = changes.select(list(MIRROR_COLUMNS))
    write_deltalake(str(path / "mirror"), documents, commit_properties=txn)


def test_an_unpartitioned_mirror_stays_correct_and_can_be_partitioned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    unpartitioned_mirror(tmp_path, [change(i + 1, f"k{i}", b"old") for i in range(30)], 0)
    writer = MirrorWriter(tmp_path, NO_NODE)
    with caplog.at_level(logging.WARNING, logger="changefeed.mirror"):
        writer.write(
            batch(change(40, "k1", b"new"), change(41, "k2", None), change(42, "n", b"n")), 1
        )
        writer.write(batch(change(43, "m", b"m")), 2)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert str(tmp_path / "mirror") in warned[0]
    assert "repartition_mirror" in warned[0]
    want = {f"k{i}": b"old" for i in range(30) if i != 2} | {"k1": b"new", "n": b"n", "m": b"m"}
    assert mirror(tmp_path) == want
    assert DeltaTable(str(tmp_path / "mirror")).metadata().partition_columns == []

    assert repartition_mirror(tmp_path) is True
    assert repartition_mirror(tmp_path) is False
    assert DeltaTable(str(tmp_path / "mirror")).metadata().partition_columns == ["vbucket"]
    assert mirror(tmp_path) == want
    assert versions(tmp_path) == (2, 2)
    writer.write(batch(change(43, "m", b"replayed")), 2)  # a replay: still skipped
    writer.write(batch(change(44, "k3", b"again"), change(45, "p", b"p")), 3)
    assert mirror(tmp_path) == want | {"k3": b"again", "p": b"p"}


def test_a_mirror_partitioned_otherwise_is_refused(tmp_path: Path) -> None:
    documents = batch(change(1, "a", b"a")).select(list(MIRROR_COLUMNS))
    write_deltalake(str(tmp_path / "mirror"), documents, partition_by=["flags"])
    writer = MirrorWriter(tmp_path, NO_NODE)
    with pytest.raises(MirrorLayoutError, match=str(tmp_path / "mirror")):
        writer.write(batch(change(2, "b", b"b")), 0)
    with pytest.raises(MirrorLayoutError):
        repartition_mirror(tmp_path)


def test_small_files_are_compacted_and_the_index_survives_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: random.Random
) -> None:
    monkeypatch.setattr(mirror_module, "PARTITION_SMALL_FILES_MAX", 3)
    monkeypatch.setattr(mirror_module, "COMPACTIONS_PER_BATCH_MAX", 4)
    builds = []
    real_of_table = KeyIndex.of_table
    monkeypatch.setattr(
        KeyIndex, "of_table", classmethod(lambda cls, t: builds.append(1) or real_of_table(t))
    )
    writer = MirrorWriter(tmp_path, NO_NODE)
    model: dict[str, bytes] = {}
    seqno = 0
    for batch_id in range(30):
        rows = []
        for _ in range(20):
            seqno += 1
            key = f"k{rng.randrange(200)}" if batch_id % 3 == 0 else f"n{seqno}"
            value = None if rng.random() < 0.1 else f"{key}@{seqno}".encode()
            rows.append(change(seqno, key, value))
            if value is None:
                model.pop(key, None)
            else:
                model[key] = value
        writer.write(batch(*rows), batch_id)
    assert mirror(tmp_path) == model
    table = DeltaTable(str(tmp_path / "mirror"))
    files = pa.table(table.get_add_actions(flatten=True))
    per_partition = files.group_by(["partition.vbucket"]).aggregate([("path", "count")])
    assert max(per_partition.column("path_count").to_pylist()) <= 3 + VBUCKETS // 4 + 2
    assert "OPTIMIZE" in {op for op, _ in operations(tmp_path)}
    assert builds == [], "a compaction made the writer re-read the table's keys"
    assert versions(tmp_path) == (29, 29)
