"""``changefeed mirror``: the streaming Delta mirror as a long-running job, and its status.

``changefeed mirror --cluster H:P[,H:P...] --tables DIR`` runs ``readStream.format(
"changefeed") -> foreachBatch(MirrorWriter)`` (``spark/mirror.py``: a changelog and a
current-state mirror, exactly once) until SIGTERM or SIGINT, which stop it between
micro-batches; run it again with the same ``--tables`` (and ``--checkpoint``) and it resumes
where it stopped. ``--cluster`` is one node, or seed nodes of a cluster: each vbucket is read
from its active node, and a failover moves the streams without restarting the query.
``--once`` mirrors what is there now and exits (availableNow). Documents become typed columns
(``--schema`` DDL, else inferred from a sample; the columns the mirror table already has keep
their types, so a restart never drops or retypes a column), or stay bytes with ``--format
binary``.

A progress line (stderr; one JSON object per micro-batch on stdout with ``--json``) shows
micro-batches, rows and rows/s, and the lag: the active nodes' high seqnos minus the seqnos the
mirror has committed (items) and the age of the oldest change not mirrored yet (``spark/lag.py``).

``changefeed mirror status --tables DIR`` reads the mirror table's Delta app transaction (the
last micro-batch it committed), that batch's end offsets from the checkpoint, and the actives'
high seqnos: the same lag, per vbucket, without Spark.

Spark: ``--master`` (default: spark-submit's or ``spark-defaults.conf``'s, else local[2]),
``--conf KEY=VALUE`` over the user's ``SPARK_CONF_DIR`` settings over changefeed's defaults
(``spark/session.py``), ``--partitions`` read tasks per micro-batch (default: Spark's default
parallelism). ``cli/submit/__main__.py`` runs this command as a spark-submit application.

Mistakes are one line, found before Spark starts where they can be (credentials and bucket by
one connection to a seed, ``--tables``/``--checkpoint`` not directories, ``--conf``), else
before any directory is made (``--schema``, parsed by Spark alone so that the error points at
the user's text); a start refused later removes the directories it made.

Exit status: 0 stopped or done; 1 the query or the node failed (one line naming it); 2 usage.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Final

import click

from changefeed.cli.mirror_collections import (
    collection_fields,
    collection_options,
    collections_flag,
    show_collections,
)
from changefeed.cli.mirror_flags import GROUPS_MAX, key_values
from changefeed.cli.mirror_maintenance import maintenance_flags, maintenance_options

STOP_WAIT_S: Final = 300.0  # for the running micro-batch to end after SIGTERM
PROGRESS_INTERVAL_S: Final = 1.0
LAG_INTERVAL_S: Final = 2.0
LAG_WAIT_S: Final = 2.0  # the progress line's planning wait for an active node
LAGGING_SHOWN_MAX: Final = 10


def _node_options(cluster: str, bucket: str, user: str, password: str) -> dict[str, str]:
    """The source options reaching ``cluster``: one node, or seed nodes ``h1:p1,h2:p2`` of a
    cluster (any one that answers gives the map; each vbucket is read from its active)."""
    from changefeed.spark.options import OptionError, SourceOptions

    options = {"cluster": cluster.strip(), "bucket": bucket, "user": user, "password": password}
    try:
        SourceOptions.parse(options)
    except OptionError as error:
        raise click.BadParameter(str(error), param_hint="--cluster") from None
    return options


def _common(f: Any) -> Any:
    for option in reversed(
        [
            click.option("--cluster", default="127.0.0.1:11210", show_default=True,
                         help="host:port of the node, or seed nodes of a cluster: "
                              "h1:p1,h2:p2,..."),
            click.option("--bucket", default="default", show_default=True),
            click.option("--user", default="Administrator", show_default=True,
                         envvar="CHANGEFEED_USER"),
            click.option("--password", default="password", envvar="CHANGEFEED_PASSWORD",
                         show_default=False, help="Or CHANGEFEED_PASSWORD."),
            click.option("--tables", type=click.Path(path_type=Path),
                         help="Directory of the Delta tables (changelog/, mirror/)."),
            click.option("--checkpoint", type=click.Path(path_type=Path),
                         help="Spark checkpoint directory [default: TABLES/_checkpoint]."),
            click.option("--json", "as_json", is_flag=True, help="JSON on stdout."),
        ]
    ):  # fmt: skip
        f = option(f)
    return f


@click.group(invoke_without_command=True)
@_common
@click.option("--schema", default="", help="Document fields as DDL (or StructType JSON).")
@click.option(
    "--infer-schema/--no-infer-schema",
    default=True,
    show_default=True,
    help="Without --schema: infer the fields from a sample of each vbucket.",
)
@click.option(
    "--format",
    "doc_format",
    type=click.Choice(["json", "binary"]),
    default="json",
    show_default=True,
    help="binary: documents stay bytes (column value).",
)
@click.option(
    "--mode",
    type=click.Choice(["PERMISSIVE", "DROPMALFORMED", "FAILFAST"]),
    default="PERMISSIVE",
    show_default=True,
    help="For malformed documents.",
)
@click.option("--merge-schema", is_flag=True, help="Add new document fields to the tables.")
@click.option(
    "--trigger",
    default="0 seconds",
    show_default=True,
    help="Micro-batch interval (Spark processingTime); 0: a micro-batch as soon as changes "
    "are there (the source waits for them while idle).",
)
@click.option(
    "--max-offsets-per-trigger",
    type=click.IntRange(min=0),
    default=500_000,
    show_default=True,
    help="Seqnos per micro-batch at most (0: no bound).",
)
@click.option(
    "--master",
    default=None,
    help="Spark master: local[N], spark://host:port, yarn, k8s://... [default: spark.master "
    "of spark-submit or spark-defaults.conf, else local[2]].",
)
@click.option(
    "--conf",
    "spark_conf",
    multiple=True,
    metavar="KEY=VALUE",
    help="A Spark setting (repeatable), over SPARK_CONF_DIR's spark-defaults.conf and "
    "changefeed's defaults.",
)
@click.option(
    "--partitions",
    type=click.IntRange(min=1),
    default=None,
    help="Read tasks per micro-batch (vbuckets are grouped) [default: Spark's default "
    "parallelism: the executors' cores, N for local[N]].",
)
@click.option(
    "--writer",
    type=click.Choice(["distributed", "local"]),
    default=None,
    help="Who writes the files: distributed (Spark's tasks) or local (the driver) [default: "
    "distributed for new tables, else the tables' own].",
)
@click.option(
    "--mirror-tasks",
    type=click.IntRange(min=1),
    default=None,
    help="Write tasks per micro-batch of the distributed writer [default: Spark's default "
    "parallelism, at most --mirror-groups].",
)
@click.option(
    "--mirror-groups",
    type=click.IntRange(min=1, max=GROUPS_MAX),
    default=None,
    help="Vbucket groups (the tables' partitions), when the tables are created [default: twice "
    "Spark's default parallelism, 4 to 64, on a local master; twice the configured executor "
    "cores, 16 to 64, on a cluster].",
)
@click.option(
    "--driver-batch-max",
    type=click.IntRange(min=0),
    default=None,
    help="The distributed writer writes a micro-batch planned at most N changes from the "
    "driver, without a shuffle (lower latency); 0: never [default: 50,000].",
)
@click.option(
    "--storage-option",
    "storage_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="A deltalake storage option for s3:// tables (repeatable), e.g. AWS_ENDPOINT_URL=...",
)
@click.option("--once", is_flag=True, help="Mirror what is there now, then exit.")
@click.option(
    "--fail-on-data-loss/--no-fail-on-data-loss",
    default=False,
    show_default=True,
    help="Fail when a vbucket must restart from 0 (else the mirror rebuilds it).",
)
@collections_flag
@maintenance_flags
@click.pass_context
def mirror(ctx: click.Context, cluster: str, bucket: str, user: str, password: str,
           tables: Path | None, checkpoint: Path | None, as_json: bool, schema: str,
           infer_schema: bool, doc_format: str, mode: str, merge_schema: bool, trigger: str,
           max_offsets_per_trigger: int, master: str | None, spark_conf: tuple[str, ...],
           partitions: int | None, writer: str | None, mirror_tasks: int | None,
           mirror_groups: int | None, driver_batch_max: int | None,
           storage_pairs: tuple[str, ...], once: bool,
           fail_on_data_loss: bool, collection_list: str | None,
           purge_every: str | None = None, compact_every: str | None = None) -> None:  # fmt: skip
    """Mirror a bucket into Delta tables with Spark, exactly once (status: see below)."""
    if ctx.invoked_subcommand is not None:
        return
    if tables is None:
        raise click.UsageError("--tables is required")
    from changefeed.cli.mirror_flags import is_url, mended, writer_flags

    flags = writer_flags(writer, mirror_tasks, mirror_groups, storage_pairs, mended(str(tables)),
                         driver_batch_max)  # fmt: skip
    if is_url(str(tables)) and checkpoint is None:
        raise click.BadParameter(
            f"{mended(str(tables))} is an object store: give --checkpoint, a local or shared "
            "directory",
            param_hint="--checkpoint",
        )
    # Everything a user can get wrong is checked before Spark starts and before any directory
    # is made, so a refused start costs seconds and leaves nothing behind.
    settings = spark_settings(spark_conf)
    checkpoint = checkpoint or tables / "_checkpoint"
    check_directory(tables, "--tables")
    check_directory(checkpoint, "--checkpoint")
    options = _node_options(cluster, bucket, user, password)
    options |= {
        "format": doc_format,
        "mode": mode,
        "failOnDataLoss": str(fail_on_data_loss).lower(),
        "mergeSchema": str(merge_schema).lower(),
    }
    if max_offsets_per_trigger:
        options["maxOffsetsPerTrigger"] = str(max_offsets_per_trigger)
    if partitions is not None:
        options["partitions"] = str(partitions)
    options |= flags.source_options()
    options |= maintenance_options(purge_every, compact_every, writer, mended(str(tables)))
    check_cluster(options)
    options |= collection_options(collection_list, options, tables)  # after: reachable
    job = MirrorJob(options, tables, checkpoint, as_json, flags.storage_options or None)
    if doc_format == "json":
        ddl = job.document_schema(schema, infer_schema)
        if ddl:  # else nothing to infer from yet (an empty bucket): the source infers at start
            options["schema"] = ddl
    sys.exit(job.run(master, settings, trigger, once, given_schema=schema))


def spark_settings(pairs: tuple[str, ...]) -> dict[str, str]:
    """``--conf KEY=VALUE`` pairs as a dict (a bad one is a usage error naming it)."""
    return key_values(pairs, "--conf")


def check_directory(path: Path, flag: str) -> None:
    """``path`` is a directory or can be made one: it, and its nearest existing ancestor, are
    directories (a file there would fail only once Spark has started)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is under {existing}, a file"
        raise click.BadParameter(f"{path} {what}, not a directory", param_hint=flag)


def check_cluster(options: dict[str, str]) -> None:
    """One connection to a seed with the credentials (HELLO, auth, bucket): a wrong password, a
    missing bucket or no reachable seed is one line before Spark starts."""
    import asyncio

    from changefeed.protocol.errors import StatusError
    from changefeed.spark.cluster import dial_seed
    from changefeed.spark.options import SourceOptions

    parsed = SourceOptions.parse(options)

    async def dial() -> None:
        conn, _ = await dial_seed(parsed, "changefeed-mirror")
        await conn.close()

    try:
        asyncio.run(dial())
    except StatusError as error:
        raise click.ClickException(
            f"the cluster at {parsed.cluster_text} refused user {parsed.user!r} on bucket "
            f"{parsed.bucket!r}: {error}"
        ) from None
    except (OSError, TimeoutError) as error:
        raise click.ClickException(f"cannot reach the cluster: {error}") from None


class MirrorJob:
    """One run of the mirror query, with its progress line and its clean stop."""

    def __init__(self, options: dict[str, str], tables: Path, checkpoint: Path,
                 as_json: bool, storage_options: dict[str, str] | None = None) -> None:  # fmt: skip
        self.options = options
        self.storage_options = storage_options
        self.tables = tables
        self.checkpoint = checkpoint
        self.as_json = as_json
        self.stop_requested = 0  # the signal number
        self.interactive = sys.stderr.isatty()

    def document_schema(self, schema: str, infer: bool) -> str:
        """The DDL of the documents' fields: ``schema``, or inferred and merged with the
        mirror table's (whose columns keep their types)."""
        from changefeed.spark.documents import ddl_of_fields, merge_fields
        from changefeed.spark.inference import infer_document_fields, user_fields_ddl
        from changefeed.spark.options import OptionError, SourceOptions

        try:
            if schema:
                return user_fields_ddl(schema)
            if not infer:
                raise click.UsageError("--format json needs --schema or --infer-schema")
            started = time.perf_counter()
            inferred = _run(lambda: infer_document_fields(SourceOptions.parse(self.options)),
                            self.options["cluster"])  # fmt: skip
            fields = merge_fields(_table_fields(self.tables, self.storage_options), inferred)
        except (OptionError, ValueError) as error:
            raise click.ClickException(str(error)) from None
        ddl = ddl_of_fields(fields)
        _say(f"schema ({time.perf_counter() - started:.1f} s to infer): {ddl or '(no fields)'}")
        return ddl

    def run(self, master: str | None, settings: dict[str, str], trigger: str, once: bool,
            given_schema: str = "") -> int:  # fmt: skip
        from changefeed.spark import MirrorWriter
        from changefeed.spark.session import SessionError, spark_session

        try:
            spark = spark_session("changefeed-mirror", master, settings)
        except SessionError as error:
            raise click.ClickException(str(error)) from None
        if given_schema and not given_schema.startswith("{"):
            check_schema(given_schema)
        if "partitions" not in self.options:  # the read follows the cluster's cores
            self.options["partitions"] = str(spark.sparkContext.defaultParallelism)
        made = [p for p in (self.tables, self.checkpoint) if not p.exists()]
        try:
            self.checkpoint.mkdir(parents=True, exist_ok=True)
            writer = MirrorWriter(self.tables, self.options, storage_options=self.storage_options)
            query = self._start(spark, writer, trigger, once)
        except Exception as error:
            _remove_new(made)
            _say(f"Error: the mirror query did not start: {error_line(str(error))}")
            return 1
        return self._finish(spark, query, once, made)

    def _start(self, spark: Any, writer: Any, trigger: str, once: bool) -> Any:
        stream = (
            spark.readStream.format("changefeed").options(**self.options).load()
            .writeStream.foreachBatch(writer)
            .option("checkpointLocation", str(self.checkpoint))
        )  # fmt: skip
        stream = (
            stream.trigger(availableNow=True) if once else stream.trigger(processingTime=trigger)
        )
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        return stream.start()

    def _finish(self, spark: Any, query: Any, once: bool, made: list[Path]) -> int:
        """Watch ``query`` to its end; say how it ended."""
        _say(f"mirroring {self.options['cluster']} into {self.tables} (checkpoint "
             f"{self.checkpoint}) on {spark.sparkContext.master}, "
             f"{self.options['partitions']} read tasks per micro-batch; "
             f"{'once' if once else 'SIGTERM or Ctrl-C stops it'}")  # fmt: skip
        try:
            self._watch(query)
        finally:
            if query.isActive:
                query.stop()
        if self.interactive:
            print(file=sys.stderr)
        error = query.exception()
        if error is not None:
            if _last_batch(query) is None:  # nothing committed: a refused start
                _remove_new(made)
            _say(f"Error: the mirror query failed: {error_line(str(error))}")
            return 1
        batches = [p for p in query.recentProgress if p["numInputRows"]]
        how = f"stopped (signal {self.stop_requested})" if self.stop_requested else "done"
        _say(
            f"{how} after batch {_last_batch(query)}; resume with the same --tables"
            f" ({len(batches)} micro-batches with rows in this run)"
        )
        spark.stop()
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = signum

    def _watch(self, query: Any) -> None:
        """Print progress until the query ends; on a signal, stop it between micro-batches."""
        from changefeed.spark.options import SourceOptions

        options = SourceOptions.parse(self.options)
        started = time.monotonic()
        last = ""  # timestamp of the last progress event handled (ISO 8601: sorts as text)
        rows = 0
        lag: Any = None
        lag_at = 0.0
        while True:  # bounded by the query's life
            active = query.isActive
            if active and self.stop_requested:
                deadline = time.monotonic() + STOP_WAIT_S
                while query.status["isTriggerActive"] and time.monotonic() < deadline:
                    time.sleep(0.02)  # let the running micro-batch commit
                query.stop()
                active = False
            progress = query.recentProgress  # the newest 100 events
            new = [p for p in progress if p["timestamp"] > last and p["numInputRows"]]
            last = max([last, *(p["timestamp"] for p in progress)])
            if new or time.monotonic() - lag_at > LAG_INTERVAL_S or not active:
                lag = _lag_after(options, progress)
                lag_at = time.monotonic()
            for event in new:
                rows += int(event["numInputRows"])
                self._print_batch(event, rows, lag)
            self._print_line(progress, rows, time.monotonic() - started, lag)
            if not active:
                return
            time.sleep(PROGRESS_INTERVAL_S if not new else 0.1)

    def _print_batch(self, event: Any, rows: int, lag: Any) -> None:
        if self.as_json:
            record = {
                "batch": event["batchId"], "rows": event["numInputRows"], "total_rows": rows,
                "seconds": event["durationMs"].get("triggerExecution", 0) / 1000,
                "lag": lag.to_json() if lag is not None else None,
            }  # fmt: skip
            print(json.dumps(record), flush=True)
        elif not self.interactive:
            _say(_line(event["batchId"], rows, None, lag))

    def _print_line(self, progress: list[Any], rows: int, elapsed: float, lag: Any) -> None:
        if not self.interactive or self.as_json:
            return
        batch = progress[-1]["batchId"] if progress else None
        print("\r" + _line(batch, rows, rows / elapsed if elapsed else 0.0, lag) + "\x1b[K",
              end="", file=sys.stderr, flush=True)  # fmt: skip


def _line(batch: int | None, rows: int, rate: float | None, lag: Any) -> str:
    shown = "-" if batch is None else str(batch)
    text = f"batch {shown} | {rows:,} rows"
    if rate is not None:
        text += f" ({rate:,.0f}/s)"
    if lag is not None:
        text += f" | lag {lag.items:,} items, {lag.age_s:.1f} s"
    return text


def _lag_after(options: Any, progress: list[Any]) -> Any:
    """The lag behind the end of the last micro-batch (None before the first one, or when the
    node does not answer: the progress line goes on)."""
    from changefeed.spark.lag import measure_lag_sync
    from changefeed.spark.node_state import fetch_latest_sync
    from changefeed.spark.offsets import offsets_from_json

    ended = [p for p in progress if p["sources"] and p["sources"][0].get("endOffset")]
    if not ended:
        return None
    # Shortly: during a failover the line waits for no new active (the query itself does).
    options = dataclasses.replace(options, node_timeout_s=min(options.node_timeout_s, LAG_WAIT_S))
    try:
        committed = offsets_from_json(json.loads(ended[-1]["sources"][0]["endOffset"]))
        latest, _ = fetch_latest_sync(options)
    except (OSError, ValueError, TimeoutError):
        return None
    return measure_lag_sync(options, committed, latest)


def _last_batch(query: Any) -> int | None:
    progress = query.recentProgress
    return int(progress[-1]["batchId"]) if progress else None


@mirror.command()
@_common
def status(cluster: str, bucket: str, user: str, password: str, tables: Path | None,
           checkpoint: Path | None, as_json: bool) -> None:  # fmt: skip
    """Where the mirror is: its last committed micro-batch and its lag behind the node."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    from changefeed.spark.lag import measure_lag_sync
    from changefeed.spark.mirror import APP_ID
    from changefeed.spark.node_state import fetch_latest_sync
    from changefeed.spark.options import SourceOptions

    if tables is None:
        raise click.UsageError("--tables is required")
    if show_collections(tables, as_json):  # a mirror per collection (--collections)
        return
    mirror_path = tables / "mirror"
    if not DeltaTable.is_deltatable(str(mirror_path)):
        raise click.ClickException(f"no mirror table at {mirror_path}")
    table = DeltaTable(str(mirror_path))
    batch = table.transaction_version(APP_ID)
    committed = _committed_offsets(checkpoint or tables / "_checkpoint", batch)
    node_options = _node_options(cluster, bucket, user, password)
    check_cluster(node_options)
    options = SourceOptions.parse(node_options)
    latest, _ = _run(lambda: fetch_latest_sync(options), options.cluster_text)
    lag = measure_lag_sync(options, committed, latest)
    actions = pa.table(table.get_add_actions(flatten=True))
    rows = int(pc.sum(actions.column("num_records")).as_py() or 0)
    lagging = sorted((v for v in lag.vbuckets if v.items), key=lambda v: -v.items)
    from changefeed.spark.mirror_status import mirror_status  # the resolved watermark

    resolved = mirror_status(tables)
    if as_json:
        click.echo(json.dumps({
            "tables": str(tables), "batch": batch, "table_version": table.version(),
            "rows": rows, "lag": lag.to_json(), "resolved_hlc_ns": resolved.resolved_hlc_ns,
            "resolved_at": resolved.resolved_at,
        }))  # fmt: skip
        return
    click.echo(
        f"mirror {mirror_path}: {rows:,} rows, table version {table.version()}, "
        f"last micro-batch committed {batch if batch is not None else '(none)'}"
    )
    click.echo(f"lag: {lag.items:,} items, oldest unmirrored change {lag.age_s:.1f} s old, "
               f"{len(lagging)} of {len(lag.vbuckets)} vbuckets behind")  # fmt: skip
    click.echo(resolved.line())
    for vb in lagging[:LAGGING_SHOWN_MAX]:
        age = "?" if vb.age_s is None else f"{vb.age_s:.1f} s"
        click.echo(f"  vbucket {vb.vbucket}: node {vb.high_seqno}, mirror {vb.committed_seqno}"
                   f" ({vb.items:,} items, {age})")  # fmt: skip


def _committed_offsets(checkpoint: Path, batch: int | None) -> Any:
    """The end offsets of micro-batch ``batch`` from the checkpoint's offset log (empty: none
    committed, every vbucket from 0)."""
    from changefeed.spark.offsets import offsets_from_json

    if batch is None:
        return {}
    path = checkpoint / "offsets" / str(batch)
    try:
        lines = path.read_text().splitlines()
        return offsets_from_json(json.loads(lines[2]))  # "v1", metadata, the source's offset
    except (OSError, IndexError, ValueError) as error:
        raise click.ClickException(
            f"cannot read the offsets of batch {batch} at {path} ({error}); give the query's "
            "--checkpoint"
        ) from None


def _table_fields(tables: Path, storage_options: dict[str, str] | None = None) -> Any:
    """The document fields of an existing mirror table (empty without one); ``tables`` may be
    an object store's URL (given as a Path: ``table_uri`` mends it)."""
    from deltalake import DeltaTable
    from pyarrow import schema as arrow_schema
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.types import StructType

    from changefeed.spark.delta_files import table_uri
    from changefeed.spark.documents import CORRUPT_COLUMN
    from changefeed.spark.merge_source import MIRROR_COLUMNS

    uri = table_uri(tables, "mirror")
    if not DeltaTable.is_deltatable(uri, storage_options):  # none, or one per collection
        return collection_fields(tables, storage_options, _table_fields, StructType([]))
    have = arrow_schema(DeltaTable(uri, storage_options=storage_options).schema().to_arrow())
    fields = [f for f in have if f.name not in MIRROR_COLUMNS and f.name != CORRUPT_COLUMN]
    return from_arrow_schema(arrow_schema(fields))


def _run(call: Any, address: str) -> Any:
    try:
        return call()
    except (OSError, TimeoutError) as error:
        raise click.ClickException(f"cannot reach the cluster at {address}: {error}") from None


def check_schema(ddl: str) -> None:
    """Spark parses ``--schema`` alone, so an error points at the user's text, not at the
    metadata columns the source puts before it."""
    from pyspark.errors import PySparkException
    from pyspark.sql.types import StructType

    from changefeed.spark.documents import CORRUPT_COLUMN, DocumentSchemaError
    from changefeed.spark.documents import check_document_fields as check_names

    try:
        parsed = StructType.fromDDL(ddl)
    except PySparkException as error:
        raise click.BadParameter(
            f"Spark cannot parse {ddl!r}: {error_line(str(error))}", param_hint="--schema"
        ) from None
    if not isinstance(parsed, StructType):
        raise click.BadParameter(
            f"{ddl!r} is a type, not fields (name type, ...)", param_hint="--schema"
        )
    try:  # a field named like a metadata column: refused here, not once the query starts
        check_names([n for n in parsed.fieldNames() if n != CORRUPT_COLUMN], CORRUPT_COLUMN)
    except DocumentSchemaError as error:
        raise click.BadParameter(str(error), param_hint="--schema") from None


def _remove_new(paths: list[Path]) -> None:
    """Remove the directories this run made (a refused start leaves nothing behind)."""
    import shutil

    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def error_line(text: str) -> str:
    """The line that says what failed. A Py4J error's first line only names the JVM call
    ("An error occurred while calling o84.load."): the Java exception follows it. A Python
    error raised in Spark's Python worker comes as a traceback: its exception line (the first
    unindented line after "Traceback") is appended to Spark's summary."""
    raw = text.strip().splitlines()
    kept = [i for i, line in enumerate(raw) if line.strip().removeprefix(": ")
            and not line.strip().startswith("An error occurred while")]  # fmt: skip
    if not kept:
        return text.strip()
    first = raw[kept[0]].strip().removeprefix(": ")
    if first.endswith("Traceback (most recent call last):"):
        cause = next((line for line in raw[kept[0] + 1 :] if line and not line[0].isspace()), "")
        first = first.removesuffix("Traceback (most recent call last):") + cause.strip()
    return first


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


from changefeed.cli.mirror_purge import purge  # noqa: E402  (a subcommand of ``mirror``)

mirror.add_command(purge)

from changefeed.cli.mirror_compact import compact  # noqa: E402  (a subcommand of ``mirror``)

mirror.add_command(compact)
