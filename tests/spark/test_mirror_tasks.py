"""``mirror_tasks.run_group`` alone (no Spark, no commit): one group's batches applied to its
files, the file list kept as the driver's commits would keep it.

Copy on write: a batch rewrites only the files holding its keys and only adds a file for new
keys; a group's small files are merged once there are more than ``SMALL_FILES_MAX``; the files
always hold each live key once, at its last change.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA
from changefeed.spark.delta_files import KIND_ADD, KIND_POSITION, KIND_REMOVE
from changefeed.spark.merge_source import MIRROR_SCHEMA
from changefeed.spark.mirror_tasks import (
    CHANGEFEED_FIELDS,
    POSITION,
    SMALL_FILES_MAX,
    FileRef,
    GroupPlan,
    run_group,
)

GROUP = 3


def plan(root: Path, batch_id: int, files: list[FileRef]) -> GroupPlan:
    changelog = pa.schema([*CHANGE_ROW_SCHEMA, pa.field("batch_id", pa.int64()),
                           *CHANGEFEED_FIELDS])  # fmt: skip
    return GroupPlan(
        mirror_uri=str(root / "mirror"), changelog_uri=str(root / "changelog"),
        storage_options=None, options={}, batch_id=batch_id, write_changelog=True,
        write_mirror=True, changelog_version=batch_id - 1 if batch_id else None,
        commit_timestamp_ms=0, mirror_schema=MIRROR_SCHEMA, changelog_schema=changelog,
        mirror_files={GROUP: files},
    )  # fmt: skip


def rows(changes: list[tuple[str, int, bytes | None]]) -> pa.Table:
    """(key, seqno, value or None for a deletion) in stream order, shuffled as a shuffle would
    hand them over: the position column restores the order."""
    table = pa.Table.from_pylist(
        [{"vbucket": 7, "seqno": seqno, "key": key, "value": value or b"",
          "op": "mutation" if value is not None else "deletion", "cas": seqno << 16, "expiry": 0,
          "flags": 0, "rev_seqno": 1, "snap_start": seqno, "snap_end": seqno}
         for key, seqno, value in changes],
        schema=CHANGE_ROW_SCHEMA,
    )  # fmt: skip
    table = table.append_column(POSITION, pa.array(np.arange(len(changes)) * 10, pa.int64()))
    table = table.append_column("_vb_group", pa.array([GROUP] * len(changes), pa.int32()))
    return table.take(pa.array(np.random.default_rng(len(changes)).permutation(len(changes))))


def test_a_groups_files_hold_each_live_key_once_and_stay_few(tmp_path: Path) -> None:
    rng = random.Random(5)
    files: dict[str, FileRef] = {}
    live: dict[str, bytes] = {}
    seqno = 0
    most_files = 0
    for batch_id in range(2 * SMALL_FILES_MAX + 4):
        changes = []
        for _ in range(rng.randrange(1, 6)):
            seqno += 1
            key = f"k{rng.randrange(300)}"
            value = None if key in live and rng.random() < 0.3 else f"{key}@{seqno}".encode()
            changes.append((key, seqno, value))
            if value is None:
                del live[key]
            else:
                live[key] = value
        actions = run_group(plan(tmp_path, batch_id, list(files.values())), GROUP, rows(changes))
        for action in actions.to_pylist():
            if action["table_name"] != "mirror":
                continue
            if action["kind"] == KIND_ADD:
                files[action["path"]] = FileRef(action["path"], action["size"])
            elif action["kind"] == KIND_REMOVE:
                assert action["path"] in files, action  # only files the group had
                del files[action["path"]]
        position = [a for a in actions.to_pylist() if a["kind"] == KIND_POSITION]
        assert [(p["vbucket"], p["seqno"]) for p in position] == [(7, seqno)]
        most_files = max(most_files, len(files))
        mirror = [pq.read_table(tmp_path / "mirror" / path) for path in files]
        held = pa.concat_tables(mirror) if mirror else MIRROR_SCHEMA.empty_table()
        keys = held.column("key").to_pylist()
        assert len(keys) == len(set(keys)), "a key in two files"
        assert dict(zip(keys, held.column("value").to_pylist(), strict=True)) == live
    assert most_files <= SMALL_FILES_MAX + 1, most_files  # compacted once there were too many


def test_the_statistics_let_a_reader_filter_on_any_column(tmp_path: Path) -> None:
    """delta-rs reads a column missing from a file's statistics as ``col >= null``, which
    pruned every file from a filter on ``op`` (the rollback history read nothing)."""
    import pyarrow.dataset as ds
    from deltalake import DeltaTable, Schema
    from deltalake.transaction import AddAction, create_table_with_add_actions

    batch = plan(tmp_path, 0, [])
    actions = run_group(batch, GROUP, rows([("a", 1, b"x"), ("b", 2, None), ("c", 3, b"y")]))
    adds = [
        AddAction(a["path"], a["size"], {"_vb_group": str(GROUP)}, 0, True, a["stats"])
        for a in actions.to_pylist()
        if a["table_name"] == "changelog" and a["kind"] == KIND_ADD
    ]
    schema = batch.changelog_schema.append(pa.field("_vb_group", pa.int32()))
    create_table_with_add_actions(str(tmp_path / "changelog"), Schema.from_arrow(schema), adds,
                                  mode="append", partition_by=["_vb_group"])  # fmt: skip
    dataset = DeltaTable(str(tmp_path / "changelog")).to_pyarrow_dataset()
    for where, count in [
        (ds.field("op") != "rollback", 3), (ds.field("op") == "deletion", 1),
        (ds.field("flags") == 0, 3), (ds.field("_change_type") == "insert", 2),
        (ds.field("_commit_timestamp").is_valid(), 3), (ds.field("key") > "a", 2),
    ]:  # fmt: skip
        assert dataset.to_table(filter=where).num_rows == count, where
