"""``changefeed mirror compact``: merge the tables' small Parquet files, partition by partition.

A latency-oriented mirror job leaves a changelog file per vbucket group and batch; this merges
each group's small files (``spark/compaction.py``) in one Delta commit per table, rows and batch
ids unchanged. No Spark: this process rewrites the files. Refused while a mirror job holds the
tables (one line naming it); a running job compacts by itself (``--compact-every``).
"""

from __future__ import annotations

import json

import click

from changefeed.cli.mirror_tables_arg import checked_tables


@click.command()
@click.option("--tables", required=True, help="Directory (or s3:// URL) of the Delta tables.")
@click.option("--files-min", type=click.IntRange(min=2), default=None,
              help="Compact a partition holding at least N small files [default: 8].")  # fmt: skip
@click.option("--small-mib", type=click.FloatRange(min=0, min_open=True), default=None,
              help="A file below this many MiB is small [default: 8].")  # fmt: skip
@click.option("--storage-option", "storage_pairs", multiple=True, metavar="KEY=VALUE",
              help="A deltalake storage option for s3:// tables (repeatable).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout.")
def compact(tables: str, files_min: int | None, small_mib: float | None,
            storage_pairs: tuple[str, ...], as_json: bool) -> None:  # fmt: skip
    """Merge the changelog's and the mirror's small files (rows and batch ids unchanged)."""
    from changefeed.spark.compaction import CompactionError, compact_tables
    from changefeed.spark.table_lease import MirrorBusyError

    tables, given = checked_tables(tables, storage_pairs)
    settings: dict[str, int] = {}
    if files_min is not None:
        settings["files_min"] = files_min
    if small_mib is not None:
        settings["small_bytes"] = max(1, int(small_mib * 2**20))
    try:
        report = compact_tables(tables, given or None, **settings)
    except (CompactionError, MirrorBusyError) as error:
        raise click.ClickException(str(error)) from None
    except OSError as error:
        raise click.ClickException(f"cannot compact {tables}: {error}") from None
    if as_json:
        click.echo(json.dumps(report.to_json()))
        return
    for table in report.tables:
        if table.version is None:
            click.echo(f"{table.table}: nothing to compact")
            continue
        click.echo(f"{table.table}: {table.files_removed:,} files merged into "
                   f"{table.files_added:,} ({table.rows:,} rows, {table.groups} partitions), "
                   f"table version {table.version}")  # fmt: skip
