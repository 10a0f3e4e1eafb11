"""Data files of a Delta table written outside a Delta commit, and the file actions that commit
them: what a distributed writer's tasks do (delta-rs's ``create_write_transaction`` then commits
the actions in one transaction, in the driver).

Files go through delta-rs's own object store (``deltalake.fs.DeltaStorageHandler``), so a local
path and ``s3://…`` (with the same ``storage_options`` as ``DeltaTable``) are written alike. A file
is named by the batch, the table's partition and a random part: a task run twice (Spark retries,
a replayed batch) writes new files, and only the files a commit names are in the table; the others
are orphans that a Delta vacuum removes.

Actions travel from the tasks to the driver as rows of ``ACTION_SCHEMA`` (a few per task): a
file added or removed, or a vbucket's position (the last change of it in the batch).
Not here: what goes in the files (``mirror_tasks.py``), the commit (``dist_mirror.py``).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

GROUP_COLUMN: Final = "_vb_group"  # the partition column: the vbucket's group (vbucket % groups)
KIND_ADD: Final = "add"
KIND_REMOVE: Final = "remove"
KIND_POSITION: Final = "position"
ACTION_SCHEMA: Final = pa.schema(
    [
        ("table_name", pa.string()),  # "mirror" or "changelog"; null for a position
        ("kind", pa.string()),  # KIND_*
        ("path", pa.string()),  # relative to the table root
        ("size", pa.int64()),
        ("grp", pa.int32()),
        ("num_records", pa.int64()),
        ("stats", pa.string()),  # Delta file statistics (JSON)
        ("vbucket", pa.int32()),  # a position: the vbucket's last change in the batch
        ("seqno", pa.int64()),
        ("cas", pa.int64()),
    ]
)
ACTION_DDL: Final = (
    "table_name string, kind string, path string, size long, grp int, num_records long, "
    "stats string, vbucket int, seqno long, cas long"
)
# Columns with min/max statistics: what readers prune on (a key range, a vbucket, a batch).
_STATS_COLUMNS: Final = ("key", "vbucket", "seqno", "cas", "batch_id", "_commit_version")


def table_uri(tables: str | Path, name: str) -> str:
    """The URI of table ``name`` under ``tables`` (a local directory or an object-store URL;
    a ``Path`` made of a URL, which lost a slash, ``s3:/b/t``, is read as the URL)."""
    text = str(tables)
    if isinstance(tables, Path):
        text = re.sub(r"^([a-z][a-z0-9+.-]*):/(?=[^/])", r"\1://", text)
    if "://" in text:
        return text.rstrip("/") + "/" + name
    return str(Path(text).absolute() / name)


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def table_fs(uri: str, storage_options: dict[str, str] | None) -> pafs.FileSystem:
    """A pyarrow filesystem rooted at ``uri`` (paths relative to it). S3 takes deltalake's
    storage options (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``,
    ``AWS_ENDPOINT_URL``, ``AWS_SESSION_TOKEN``; else the environment's), so the files and the
    commits reach the same store.

    Raises:
        ValueError: an object store other than S3 (the commit side would take it, the files not).
    """
    if not is_remote(uri):
        local = uri.removeprefix("file://")
        Path(local).mkdir(parents=True, exist_ok=True)
        return pafs.SubTreeFileSystem(local, pafs.LocalFileSystem())
    scheme, _, rest = uri.partition("://")
    if scheme not in ("s3", "s3a"):
        raise ValueError(f"tables {uri}: only local paths and s3:// are supported, not {scheme}://")
    given = {k.upper(): v for k, v in (storage_options or {}).items()}

    def option(name: str) -> str | None:
        return given.get(name) or os.environ.get(name)

    endpoint = option("AWS_ENDPOINT_URL") or option("AWS_ENDPOINT")
    kwargs: dict[str, Any] = {
        "access_key": option("AWS_ACCESS_KEY_ID"), "secret_key": option("AWS_SECRET_ACCESS_KEY"),
        "session_token": option("AWS_SESSION_TOKEN"),
        "region": option("AWS_REGION") or option("AWS_DEFAULT_REGION") or "us-east-1",
    }  # fmt: skip
    if endpoint:
        kwargs["scheme"], _, kwargs["endpoint_override"] = endpoint.partition("://")
    s3 = pafs.S3FileSystem(**{k: v for k, v in kwargs.items() if v is not None})
    return pafs.SubTreeFileSystem(rest.rstrip("/"), s3)


def write_data_file(
    fs: pafs.FileSystem, table_name: str, rows: pa.Table, group: int, batch_id: int
) -> dict[str, Any]:
    """Write ``rows`` (without the partition column) as one Parquet file of partition ``group``;
    returns its ``add`` action row."""
    assert GROUP_COLUMN not in rows.column_names, rows.column_names
    path = f"{GROUP_COLUMN}={group}/part-{batch_id:08d}-{uuid.uuid4().hex}.parquet"
    fs.create_dir(f"{GROUP_COLUMN}={group}", recursive=True)  # local paths; a no-op on S3
    with fs.open_output_stream(path) as out:
        pq.write_table(rows, out, compression="snappy")
    size = fs.get_file_info(path).size
    assert size is not None and size > 0, path
    return {
        "table_name": table_name, "kind": KIND_ADD, "path": path, "size": size, "grp": group,
        "num_records": rows.num_rows, "stats": file_stats(rows),
    }  # fmt: skip


def remove_row(table_name: str, path: str, size: int, group: int) -> dict[str, Any]:
    return {"table_name": table_name, "kind": KIND_REMOVE, "path": path, "size": size, "grp": group}


def file_stats(rows: pa.Table) -> str:
    """Delta's per-file statistics: the row count, and min/max/null count of the columns
    readers prune on."""
    low: dict[str, Any] = {}
    high: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name in _STATS_COLUMNS:
        if name not in rows.column_names:
            continue
        column = rows.column(name)
        nulls[name] = column.null_count
        if rows.num_rows > column.null_count:
            bounds = pc.min_max(column)
            low[name], high[name] = bounds["min"].as_py(), bounds["max"].as_py()
    stats = {"numRecords": rows.num_rows, "minValues": low, "maxValues": high, "nullCount": nulls}
    return json.dumps(stats)


def actions_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=ACTION_SCHEMA)


def now_ms() -> int:
    return int(time.time() * 1000)
