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
from datetime import UTC, datetime, timedelta
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
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_LOCAL: Final = pafs.LocalFileSystem()
_STRING_STAT_CHARS: Final = 32  # string bounds are cut to this prefix, as Delta writers do


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
        return pafs.SubTreeFileSystem(local, _LOCAL)
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
    try:
        out = fs.open_output_stream(path)
    except FileNotFoundError:  # a local table's new partition (S3 has no directories)
        fs.create_dir(f"{GROUP_COLUMN}={group}", recursive=True)
        out = fs.open_output_stream(path)
    with out:
        pq.write_table(rows, out, compression="snappy")
        size = out.tell()
    assert size > 0, path
    return {
        "table_name": table_name, "kind": KIND_ADD, "path": path, "size": size, "grp": group,
        "num_records": rows.num_rows, "stats": file_stats(rows),
    }  # fmt: skip


def remove_row(table_name: str, path: str, size: int, group: int) -> dict[str, Any]:
    return {"table_name": table_name, "kind": KIND_REMOVE, "path": path, "size": size, "grp": group}


def file_stats(rows: pa.Table) -> str:
    """Delta's per-file statistics: the row count, and min/max/null count of every column of
    a type with statistics (numbers, strings, booleans, dates and times), as delta-rs writes
    them. All of them: delta-rs turns a column missing from the statistics into a file
    guarantee ``col >= null``, which prunes the file from any filter on that column."""
    low: dict[str, Any] = {}
    high: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for field in rows.schema:
        if not _has_stats(field.type):
            continue
        column = rows.column(field.name)
        nulls[field.name] = column.null_count
        if rows.num_rows == column.null_count:
            continue
        bounds = pc.min_max(column)
        low[field.name] = _stat_value(bounds["min"], high=False)
        high[field.name] = _stat_value(bounds["max"], high=True)
    stats = {"numRecords": rows.num_rows, "minValues": low, "maxValues": high, "nullCount": nulls}
    return json.dumps(stats)


def _has_stats(arrow_type: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
        or pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
        or pa.types.is_boolean(arrow_type) or pa.types.is_date(arrow_type)
        or pa.types.is_timestamp(arrow_type)
    )  # fmt: skip


def _stat_value(scalar: pa.Scalar, *, high: bool) -> Any:
    """A bound as Delta writes it: timestamps in ISO 8601 UTC; long strings cut to a prefix
    (a max then gets the highest code point appended, so it still bounds the values)."""
    value = scalar.as_py()
    if pa.types.is_timestamp(scalar.type):  # Delta keeps milliseconds: round outwards
        micros = scalar.cast(pa.timestamp("us", tz=scalar.type.tz)).cast(pa.int64()).as_py()
        millis = -(-micros // 1000) if high else micros // 1000
        stamp = _EPOCH + timedelta(milliseconds=millis)
        return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{millis % 1000:03d}Z"
    if pa.types.is_date(scalar.type):
        return value.isoformat()
    if isinstance(value, float) and value != value:  # NaN: no bound
        return None
    if isinstance(value, str) and len(value) > _STRING_STAT_CHARS:
        return value[:_STRING_STAT_CHARS] + ("\U0010ffff" if high else "")
    return value


def actions_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=ACTION_SCHEMA)


def now_ms() -> int:
    return int(time.time() * 1000)
