"""The distributed mirror writer (``dist_mirror.py``) on ``local[2]``, with hand-built batches.

Batches of a random stream go through ``MirrorWriter(...)(df, batch_id)`` as Spark DataFrames,
each run twice (a replay must change nothing), and the tables are compared with a model: the
mirror's rows, the changelog's ``_change_type``/``_commit_version``, each vbucket's committed
position and the watermark. A crash between the two commits is finished by the replay; a second
job on the same tables is refused in one line; and the same round trip runs on S3 (a
``moto_server`` on loopback). Rollbacks with a real node: ``test_pipeline.py``.

The writer's two paths: a small batch written from the driver must leave exactly the tables
the write tasks leave (the same stream through both into two table pairs: mirrors equal on
every column, changelogs on every column but ``_commit_timestamp``, the same versions, app
transactions, files per group and watermark), and the path is picked per batch by the seqnos
it was planned at (a real stream with ``mirrorDriverBatchMax`` between its batch sizes: the
planned count equals the span Spark's progress shows, both paths taken, mirror == store).
The driver path reads a small batch from the nodes itself (``driver_read.py``; compared with
Spark's read batch by batch in ``test_driver_read.py``, slow): typed documents, a malformed one
and a field named like the writer's stream-position column, which both paths keep as a field
(before, the driver path failed on it and the tasks' path replaced it); Spark's progress
counts the rows; a DataFrame derived from the batch is not read in the driver.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from changefeed.spark import ARROW_SCHEMA, MirrorWriter, read_mirror
from changefeed.spark.batch_plan import SourceBatch, source_batch
from changefeed.spark.batch_size import planned_changes
from changefeed.spark.delta_files import GROUP_COLUMN
from changefeed.spark.dist_mirror import (
    CLUSTER_GROUPS_MIN,
    DEFAULT_GROUPS_MAX,
    DEFAULT_GROUPS_MIN,
    DistributedMirrorWriter,
    MirrorOwnerError,
    SchemaMismatchError,
    default_groups,
    new_table_groups,
)
from changefeed.spark.driver_read import rows_in_driver
from changefeed.spark.mirror import APP_ID
from changefeed.spark.mirror_status import changes, mirror_status
from changefeed.spark.mirror_tasks import COMMIT_TIMESTAMP, POSITION
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import OptionError
from changefeed.spark.table_lease import MirrorBusyError
from changefeed.spark.watermark import hlc_ns
from changefeed.vbmap import vbucket_for_key
from support.nodes import NodeFactory

from .helpers import (
    Model,
    assert_changelog_once,
    assert_mirror_matches,
    assert_typed_mirror_matches,
    run_available_now,
    workload,
    write,
)
from .test_pipeline import FAST_NODE, seqno_span

VBUCKETS = 16
OPTIONS = {"cluster": "127.0.0.1:1", "mirrorGroups": "4", "mirrorTasks": "2"}  # no rollbacks


class Stream:
    """A random change stream and its model: each key's live value, each vbucket's last
    (seqno, cas), and the change type each row must get."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.seqno = dict.fromkeys(range(VBUCKETS), 0)
        self.clock = 1_700_000_000_000_000_000
        self.live: dict[str, bytes] = {}
        self.last: dict[int, tuple[int, int]] = {}

    def batch(self, count: int) -> tuple[pa.Table, list[str]]:
        rows, types = [], []
        for _ in range(count):
            key = f"k{self.rng.randrange(40)}"
            vb = vbucket_for_key(key.encode(), VBUCKETS)
            self.seqno[vb] += 1
            self.clock += self.rng.randrange(1, 1000) << 16
            deleting = key in self.live and self.rng.random() < 0.25
            value = b"" if deleting else f"{key}-{self.seqno[vb]}".encode()
            rows.append({
                "vbucket": vb, "seqno": self.seqno[vb], "key": key, "value": value,
                "op": "deletion" if deleting else "mutation", "cas": self.clock, "expiry": 0,
                "flags": 0, "rev_seqno": 1, "snap_start": self.seqno[vb],
                "snap_end": self.seqno[vb],
            })  # fmt: skip
            types.append(
                "delete" if deleting else "update_postimage" if key in self.live else "insert"
            )
            if deleting:
                del self.live[key]
            else:
                self.live[key] = value
            self.last[vb] = (self.seqno[vb], self.clock)
        return pa.Table.from_pylist(rows, schema=ARROW_SCHEMA), types


def mirror_values(tables: str, storage_options: dict[str, str] | None = None) -> dict[str, bytes]:
    table = read_mirror(tables, storage_options)
    assert GROUP_COLUMN not in table.column_names
    keys, values = table.column("key").to_pylist(), table.column("value").to_pylist()
    assert len(set(keys)) == len(keys), "a key twice in the mirror"
    return dict(zip(keys, values, strict=True))


def run_stream(spark: Any, tables: str, rng: random.Random, batches: int,
               storage_options: dict[str, str] | None = None) -> Stream:  # fmt: skip
    stream = Stream(rng)
    writer = MirrorWriter(tables, OPTIONS, storage_options=storage_options)
    for batch_id in range(batches):
        rows, types = stream.batch(rng.randrange(0, 60))
        df = spark.createDataFrame(rows)
        writer(df, batch_id)
        writer(df, batch_id)  # a replay: skipped
        assert mirror_values(tables, storage_options) == stream.live
        logged = changes(tables, batch_id, batch_id, storage_options)
        assert sorted(zip(logged.column("seqno").to_pylist(), logged.column("key").to_pylist(),
                          logged.column("_change_type").to_pylist(), strict=True)) == sorted(
            zip(rows.column("seqno").to_pylist(), rows.column("key").to_pylist(), types,
                strict=True)
        ), batch_id  # fmt: skip
        assert set(logged.column("batch_id").to_pylist()) <= {batch_id}
    writer.close()
    return stream


def test_batches_replays_change_types_and_watermark(
    spark: Any, tmp_path: Path, rng: random.Random
) -> None:
    tables = str(tmp_path / "tables")
    stream = run_stream(spark, tables, rng, batches=2)
    status = mirror_status(tables)
    assert status.writer == "distributed"
    assert status.batch == 1
    assert status.rows == len(stream.live)
    assert status.positions == stream.last
    assert status.resolved_hlc_ns == min(hlc_ns(cas) for _, cas in stream.last.values())
    mirror = DeltaTable(tables + "/mirror")
    assert mirror.metadata().partition_columns == [GROUP_COLUMN]
    assert status.changelog_version is not None
    versions = changes(tables).column("_commit_version").to_pylist()
    assert versions == sorted(versions) and set(versions) <= set(
        range(status.changelog_version + 1)
    )


def die_at_the_mirror_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's driver dies after the changelog's commit, before the mirror's (until
    ``monkeypatch.undo()``)."""
    commit = DistributedMirrorWriter._commit

    def crash_at_the_mirror(self: DistributedMirrorWriter, table: Any, uri: str, name: str,
                            *args: Any) -> None:  # fmt: skip
        if name == "mirror":
            raise RuntimeError("driver died")
        commit(self, table, uri, name, *args)

    monkeypatch.setattr(DistributedMirrorWriter, "_commit", crash_at_the_mirror)


@pytest.mark.slow  # the default suite has it with real kills: test_driver_kill.py
def test_a_crash_between_the_commits_is_finished_by_the_replay(
    spark: Any, tmp_path: Path, rng: random.Random, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables = str(tmp_path / "tables")
    stream = Stream(rng)
    rows, _ = stream.batch(30)
    die_at_the_mirror_commit(monkeypatch)
    with pytest.raises(RuntimeError, match="driver died"):
        MirrorWriter(tables, OPTIONS)(spark.createDataFrame(rows), 0)
    monkeypatch.undo()
    assert DeltaTable(tables + "/changelog").transaction_version(APP_ID) == 0
    MirrorWriter(tables, OPTIONS)(spark.createDataFrame(rows), 0)
    assert mirror_values(tables) == stream.live
    assert len(changes(tables)) == rows.num_rows  # logged once
    MirrorWriter(tables, OPTIONS)(spark.createDataFrame(stream.batch(3)[0]), 1)
    with pytest.raises(MirrorOwnerError, match="hold micro-batch 1 of another query"):
        MirrorWriter(tables, OPTIONS)(spark.createDataFrame(rows), 0)  # another checkpoint


def hold_lease(root: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Another job: a process holding the tables' lease until it is killed."""
    code = (
        "import sys, time\n"
        "from changefeed.spark.table_lease import TablesLease\n"
        "TablesLease(sys.argv[1], None).hold()\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, root], stdout=subprocess.PIPE,
                            env={**os.environ, **(env or {})})  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"held\n", "the lease holder did not start"
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_second_job_on_the_same_tables_is_refused(
    spark: Any, tmp_path: Path, rng: random.Random
) -> None:
    tables = str(tmp_path / "tables")
    rows, _ = Stream(rng).batch(10)
    other = hold_lease(tables)
    try:
        with pytest.raises(MirrorBusyError) as refused:
            MirrorWriter(tables, OPTIONS)(spark.createDataFrame(rows), 0)
        message = str(refused.value)
        assert "\n" not in message and f"{socket.gethostname()}:{other.pid}" in message, message
        assert not os.path.exists(tables + "/mirror")
    finally:
        stop(other)
    writer = MirrorWriter(tables, OPTIONS)  # the holder is gone: taken over at once
    writer(spark.createDataFrame(rows), 0)
    writer.close()
    assert mirror_status(tables).batch == 0


# -- S3 ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A moto S3 server on loopback with a bucket ``mirror``; its storage options."""
    port = free_port()
    log = (tmp_path / "moto.log").open("wb")
    server = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:  # bounded by the deadline
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "moto.log").read_text()
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)
        options = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true", "AWS_S3_ALLOW_UNSAFE_RENAME": "true",
        }  # fmt: skip
        import pyarrow.fs as pafs

        bucket_maker = pafs.S3FileSystem(
            access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
            endpoint_override=f"127.0.0.1:{port}", allow_bucket_creation=True,
        )  # fmt: skip
        bucket_maker.create_dir("mirror")
        yield options
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def test_tables_on_s3(spark: Any, s3: dict[str, str], rng: random.Random) -> None:
    tables = "s3://mirror/prod/tables"
    stream = run_stream(spark, tables, rng, batches=2, storage_options=s3)
    status = mirror_status(tables, s3)
    assert (status.batch, status.rows, status.positions) == (1, len(stream.live), stream.last)
    other = hold_lease(tables, s3)  # the lease holder reads the options from its environment
    try:
        rows, _ = stream.batch(5)
        with pytest.raises(MirrorBusyError, match="written by another mirror job"):
            MirrorWriter(tables, OPTIONS, storage_options=s3)(spark.createDataFrame(rows), 2)
    finally:
        stop(other)


def test_a_new_column_is_refused_or_merged_and_commit_versions_stay_true(
    spark: Any, tmp_path: Path, rng: random.Random
) -> None:
    """mergeSchema adds the column in a commit of its own before the batch's: the
    ``_commit_version`` the tasks wrote must still be the data commit's (it was one short)."""
    tables = str(tmp_path / "tables")
    stream = Stream(rng)
    MirrorWriter(tables, OPTIONS)(spark.createDataFrame(stream.batch(8)[0]), 0)
    rows, _ = stream.batch(8)
    colored = rows.append_column("color", pa.array([f"c{i}" for i in range(rows.num_rows)]))
    with pytest.raises(SchemaMismatchError, match="'color'"):
        MirrorWriter(tables, OPTIONS)(spark.createDataFrame(colored), 1)
    MirrorWriter(tables, OPTIONS, merge_schema=True)(spark.createDataFrame(colored), 1)
    assert mirror_values(tables) == stream.live
    changelog = DeltaTable(tables + "/changelog")
    committed = {
        commit["version"]
        for commit in changelog.history()
        if commit.get("operation") in ("WRITE", "CREATE TABLE")
    }
    logged = changes(tables)
    assert set(logged.column("_commit_version").to_pylist()) == committed
    assert (
        logged.filter(pc.equal(logged.column("batch_id"), 1)).column("_commit_version").to_pylist()
        == [changelog.version()] * rows.num_rows
    )


def sorted_rows(table: pa.Table, keys: list[str]) -> list[dict[str, Any]]:
    return table.sort_by([(k, "ascending") for k in keys]).to_pylist()


def layout(table: DeltaTable) -> list[tuple[str, int]]:
    """Each file's group and row count (names carry a random part)."""
    files = pa.table(table.get_add_actions(flatten=True))
    return sorted(zip(files.column("partition._vb_group").to_pylist(),
                      files.column("num_records").to_pylist(), strict=True))  # fmt: skip


def test_the_driver_path_writes_the_tables_the_tasks_write(
    spark: Any, tmp_path: Path, rng: random.Random
) -> None:
    roots = {path: str(tmp_path / path) for path in ("tasks", "driver")}
    writers = {
        path: DistributedMirrorWriter(root, OPTIONS, APP_ID, merge_schema=False)
        for path, root in roots.items()
    }
    stream = Stream(rng)
    try:
        for batch_id in range(5):
            rows, _ = stream.batch(0 if batch_id == 2 else rng.randrange(1, 60))
            # A document field named like the writer's stream-position column stays a field.
            field = pa.array([rng.randrange(-99, 99) for _ in range(rows.num_rows)], pa.int64())
            df = spark.createDataFrame(rows.append_column(POSITION, field))
            for path, writer in writers.items():
                writer.write_batch(df, batch_id, in_driver=path == "driver")
                assert writer.last_in_driver == (path == "driver")
            writers["driver"].write_batch(df, batch_id, in_driver=True)  # a replay: skipped
    finally:
        for writer in writers.values():
            writer.close()

    tables = {
        path: {name: DeltaTable(f"{root}/{name}") for name in ("mirror", "changelog")}
        for path, root in roots.items()
    }
    tasks, driver = tables["tasks"], tables["driver"]
    mirror_keys = ["key"]
    assert sorted_rows(driver["mirror"].to_pyarrow_table(), mirror_keys) == sorted_rows(
        tasks["mirror"].to_pyarrow_table(), mirror_keys
    )
    mirrored = driver["mirror"].to_pyarrow_table()
    assert set(stream.live) == set(mirrored.column("key").to_pylist())
    assert mirrored.column(POSITION).null_count == 0, "the document field was replaced"
    log_keys = ["batch_id", "vbucket", "seqno"]
    logged = {
        path: t["changelog"].to_pyarrow_table().drop_columns([COMMIT_TIMESTAMP])
        for path, t in tables.items()
    }
    assert logged["driver"].schema == logged["tasks"].schema
    assert sorted_rows(logged["driver"], log_keys) == sorted_rows(logged["tasks"], log_keys)
    for name in ("mirror", "changelog"):
        assert driver[name].version() == tasks[name].version(), name
        assert driver[name].transaction_version(APP_ID) == 4, name
        assert driver[name].schema().to_arrow() == tasks[name].schema().to_arrow(), name
        assert layout(driver[name]) == layout(tasks[name]), name
    status = {path: mirror_status(root) for path, root in roots.items()}
    assert status["driver"].positions == status["tasks"].positions == stream.last
    assert status["driver"].resolved_hlc_ns == status["tasks"].resolved_hlc_ns


def test_the_path_follows_the_planned_batch_size(
    spark: Any, nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=FAST_NODE)
    model: Model = {}
    write(node.port, workload(rng, 3500, keys=2000, delete_ratio=0.1), model)
    options = node.source_options(
        format="binary", maxOffsetsPerTrigger="1500", mirrorDriverBatchMax="1000"
    )
    writer = MirrorWriter(tmp_path / "tables", options)
    seen: list[tuple[int, int | None, bool]] = []

    def sink(batch_df: Any, batch_id: int) -> None:
        planned = planned_changes(batch_df, batch_id)
        writer(batch_df, batch_id)
        seen.append((batch_id, planned, writer.last_in_driver))

    query = run_available_now(spark, options, sink, tmp_path / "checkpoint", closing=[writer])
    progress = [json.loads(p.json) if hasattr(p, "json") else p for p in query.recentProgress]
    spans = {p["batchId"]: seqno_span(p) for p in progress if p["numInputRows"]}
    print(f"batches (id, planned, from the driver): {seen}; spans {spans}")
    assert {b: planned for b, planned, _ in seen if b in spans} == spans
    assert all(in_driver == (planned is not None and planned <= 1000)
               for _, planned, in_driver in seen), seen  # fmt: skip
    assert {in_driver for _, _, in_driver in seen} == {True, False}, seen
    assert_mirror_matches(tmp_path / "tables", node, model)
    assert_changelog_once(tmp_path / "tables")


TYPED_SCHEMA = f"n bigint, name string, {POSITION} bigint"


def test_the_driver_reads_typed_documents_and_keeps_a_field_named_like_the_position(
    spark: Any, nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=FAST_NODE)
    docs: list[tuple[str, bytes | None]] = [
        (f"d-{i:04d}", json.dumps({"n": i, "name": f"doc {i}", POSITION: -i}).encode())
        for i in range(900)
    ]
    docs += [("d-bad", b"{not json"), ("d-0003", None)]
    docs += [(f"d-{rng.randrange(900):04d}", json.dumps({"n": -1, POSITION: 7}).encode())
             for _ in range(200)]  # fmt: skip
    write(node.port, docs)
    opts = node.source_options(schema=TYPED_SCHEMA, maxOffsetsPerTrigger="500")
    writer = MirrorWriter(tmp_path / "tables", opts)
    second = MirrorWriter(tmp_path / "second", opts)  # the same batch, other tables
    read_in_driver: list[bool] = []
    derived: list[list[bool]] = []
    spark.sparkContext.setCheckpointDir(str(tmp_path / "rdd-checkpoints"))

    def sink(batch_df: Any, batch_id: int) -> None:
        # Derived frames, checkpointed ones too (a new LogicalRDD over the batch's attributes:
        # accepted before). Lazily, so that no Spark job counts the batch's rows here.
        kept = batch_df.filter("op = 'mutation'")
        frames = [kept, kept.localCheckpoint(eager=False), batch_df.checkpoint(eager=False)]
        derived.append([source_batch(frame, batch_id) is None for frame in frames])
        writer(batch_df, batch_id)
        read_in_driver.append(writer.last_read_in_driver)
        second(batch_df, batch_id)
        read_in_driver.append(second.last_read_in_driver)

    query = run_available_now(spark, opts, sink, tmp_path / "checkpoint", closing=[writer, second])
    assert read_in_driver and all(read_in_driver), read_in_driver
    assert derived and all(all(d) for d in derived), derived
    progress = [json.loads(p.json) if hasattr(p, "json") else p for p in query.recentProgress]
    counted = sum(p["numInputRows"] for p in progress)  # once, though two writers read them
    logged = DeltaTable(str(tmp_path / "tables" / "changelog")).to_pyarrow_table()
    assert counted == logged.num_rows > 0, (counted, logged.num_rows)
    mirror = assert_typed_mirror_matches(tmp_path / "tables", node)
    assert mirror.column(POSITION).null_count < mirror.num_rows  # the documents' own values
    # No mirrorGroups: the tables were created with the default for local[2]'s cores.
    described = json.loads(DeltaTable(str(tmp_path / "tables" / "mirror")).metadata().description)
    cores = spark.sparkContext.defaultParallelism
    assert described["changefeed"]["vbucketGroups"] == default_groups(cores) == max(4, 2 * cores)


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 31, 32, 33, 1000])
def test_default_groups_follow_the_cores_within_bounds(cores: int) -> None:
    groups = default_groups(cores)
    assert DEFAULT_GROUPS_MIN <= groups <= DEFAULT_GROUPS_MAX
    assert groups >= min(cores, DEFAULT_GROUPS_MAX)  # a write task per core while groups allow
    assert groups <= default_groups(cores + 1)


def test_a_frame_filtered_then_checkpointed_is_written_as_given(
    spark: Any, nodes: NodeFactory, tmp_path: Path
) -> None:
    """The writer given ``batch_df.filter(...).localCheckpoint()``: before, the driver read the
    whole batch from the nodes (the frame kept the scan's attributes) and the changelog got the
    deletions the frame did not hold."""
    node = nodes(args=FAST_NODE)
    ops: list[tuple[str, bytes | None]] = [(f"k-{i:03d}", f"v{i}".encode()) for i in range(200)]
    ops += [(f"k-{i:03d}", None) for i in range(0, 200, 2)]
    write(node.port, ops)
    opts = node.source_options(format="binary")
    writer = MirrorWriter(tmp_path / "tables", opts)
    given: list[int] = []

    def sink(batch_df: Any, batch_id: int) -> None:
        kept = batch_df.filter("op = 'mutation'").localCheckpoint()
        given.append(kept.count())
        writer(kept, batch_id)
        assert writer.last_in_driver and not writer.last_read_in_driver

    run_available_now(spark, opts, sink, tmp_path / "checkpoint", closing=[writer])
    logged = DeltaTable(str(tmp_path / "tables" / "changelog")).to_pyarrow_table()
    assert set(logged.column("op").to_pylist()) == {"mutation"}
    assert logged.num_rows == sum(given) > 0


def test_a_restart_between_the_first_commits_keeps_the_changelogs_groups(
    spark: Any, tmp_path: Path, rng: random.Random, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver dies after batch 0's changelog commit (created with 8 groups), and the replay's
    default is other (local[2]: 4): the mirror must be created with the changelog's groups.
    Before, it got 4, and a rollback's lookup of a vbucket's changes by group missed rows."""
    tables = str(tmp_path / "tables")
    rows, _ = Stream(rng).batch(40)
    first = DistributedMirrorWriter(tables, {**OPTIONS, "mirrorGroups": "8"}, APP_ID, False)
    die_at_the_mirror_commit(monkeypatch)
    with pytest.raises(RuntimeError, match="driver died"):
        first.write_batch(spark.createDataFrame(rows), 0, in_driver=True)
    first.close()
    monkeypatch.undo()
    defaults = {k: v for k, v in OPTIONS.items() if k != "mirrorGroups"}
    assert default_groups(spark.sparkContext.defaultParallelism) != 8
    replay = DistributedMirrorWriter(tables, defaults, APP_ID, False)
    replay.write_batch(spark.createDataFrame(rows), 0, in_driver=True)
    replay.close()
    groups = {
        name: json.loads(DeltaTable(f"{tables}/{name}").metadata().description)["changefeed"][
            "vbucketGroups"
        ]
        for name in ("changelog", "mirror")
    }
    assert groups == {"changelog": 8, "mirror": 8}
    for name in ("changelog", "mirror"):
        placed = DeltaTable(f"{tables}/{name}").to_pyarrow_table(columns=["vbucket", GROUP_COLUMN])
        assert pc.all(
            pc.equal(pc.remainder(placed.column("vbucket"), 8), placed.column(GROUP_COLUMN))
        ).as_py()


LOCAL_CORES = 3


@pytest.mark.parametrize(
    ("master", "conf", "groups"),
    [
        ("local", {}, default_groups(LOCAL_CORES)),
        ("local[3]", {}, default_groups(LOCAL_CORES)),
        ("local[*]", {}, default_groups(LOCAL_CORES)),
        # A cluster: the cores registered at the first batch say nothing of later ones.
        ("spark://h:7077", {}, CLUSTER_GROUPS_MIN),
        ("yarn", {"spark.executor.instances": "2", "spark.executor.cores": "1"}, 16),
        ("yarn", {"spark.executor.instances": "10", "spark.executor.cores": "2"}, 40),
        ("k8s://h", {"spark.executor.instances": "100", "spark.executor.cores": "4"}, 64),
        (
            "yarn",
            {
                "spark.dynamicAllocation.enabled": "true",
                "spark.executor.cores": "4",
                "spark.dynamicAllocation.maxExecutors": "5",
                "spark.executor.instances": "1",
            },
            40,
        ),
        ("yarn", {"spark.dynamicAllocation.enabled": "true", "spark.executor.cores": "4"}, 16),
        ("local-cluster[2,1,1024]", {"spark.executor.cores": "x"}, 16),
    ],
)
def test_new_tables_groups_follow_local_cores_or_the_configured_executors(
    master: str, conf: dict[str, str | None], groups: int
) -> None:
    assert new_table_groups(master, conf, LOCAL_CORES) == groups


def test_a_refused_driver_read_falls_back_to_sparks_job(spark: Any, rng: random.Random) -> None:
    """The driver's read of a batch fails on a node that refuses (as during a failover): the
    batch's rows come from Spark's job, whose task Spark retries; before, the batch failed.
    Bad options still fail it."""
    rows, _ = Stream(rng).batch(20)
    df = spark.createDataFrame(rows)
    refused = {"cluster": f"127.0.0.1:{free_port()}", "format": "binary"}
    end = {3: VbOffset(vb_uuid=1, seqno=5)}
    got, read_here = rows_in_driver(df, SourceBatch(0, refused, {}, end))
    assert not read_here
    assert got.sort_by("seqno").to_pylist() == df.toArrow().sort_by("seqno").to_pylist()
    with pytest.raises(OptionError, match="format"):
        rows_in_driver(df, SourceBatch(0, {**refused, "format": "nope"}, {}, end))
