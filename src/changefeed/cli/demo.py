"""``changefeed demo``: the main job on the single-node default (no etcd, no cluster).

1. start one node as a child process (`changefeed serve`, as in production) in a temporary
   data directory;
2. load a realistic workload over the KV protocol — inserts, updates, deletes, and documents
   that expire — with a progress bar;
3. run the Spark streaming mirror (local Spark, availableNow, several micro-batches), stop the
   query mid-way and restart it from its checkpoint (exactly once across the restart);
4. read every key back through the KV API (expired documents become expirations on access, as
   kv_engine's lazy expiry does) and let the query pick those up;
5. verify the mirror table equals the store on every column, and print a report (or the
   differences). The store is read over DCP (``consumer/current_state.py``: each key's newest
   version, tombstones included) because GET answers no seqno, expiry or rev_seqno: a live key
   must be in the mirror with the same vbucket, seqno, value, CAS, flags, expiry and rev_seqno,
   and a deleted one must be absent. The KV read-back of step 4 must agree with it too (same
   live keys, values, CAS and flags).

``--cluster`` runs the same workload and pipeline on three nodes and etcd and kills the node
leading the most vbuckets mid-way: ``demo_cluster.py``, which reuses the workload, the checks
and the report pieces here; ``demo_command.py`` is the command that chooses.
"""

from __future__ import annotations

import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from changefeed.cli.node_process import NodeProcess
from changefeed.cli.ordered_writes import OrderedWrites
from changefeed.consumer import ClientConfig, GetResult, KvClient
from changefeed.consumer.current_state import Document, read_current_state
from changefeed.protocol.errors import KeyNotFoundError

EXPIRY_S = 3  # documents loaded with this TTL expire during the demo
# The columns compared per live key, besides the key itself; deletion state is presence.
CHECKED_COLUMNS = ("vbucket", "seqno", "value", "cas", "flags", "expiry", "rev_seqno")
DIFF_EXAMPLES_MAX = 12  # differences printed per kind
VALUE_SHOWN_BYTES_MAX = 40
U32_MASK = 0xFFFF_FFFF


@dataclass
class DemoCluster:
    """The nodes of the demo: one node process today."""

    data_dir: Path
    vbuckets: int
    nodes: list[NodeProcess] = field(default_factory=list)

    def start(self) -> str:
        node = NodeProcess(self.data_dir / "node0", vbuckets=self.vbuckets, args=["--no-durable"])
        self.nodes.append(node)  # before start: stop() reaps it even if start fails part-way
        node.start()
        return node.address

    def stop(self) -> None:
        """SIGTERM each node (SIGKILL if it hangs); an unclean exit raises."""
        for node in self.nodes:
            if node.process is not None:
                node.stop()


@dataclass
class LoadReport:
    ops: int = 0
    seconds: float = 0.0
    expiring: list[bytes] = field(default_factory=list)
    keys: set[bytes] = field(default_factory=set)


async def load_workload(
    port: int, items: int, seed: int, console: Console, report: LoadReport
) -> None:
    """Inserts (60%), updates (25%), deletes (10%) and expiring documents (5%), pipelined with
    each key's writes in order (`OrderedWrites`)."""
    rng = random.Random(seed)
    live: list[bytes] = []
    kv = await KvClient.connect("127.0.0.1", port)
    writes = OrderedWrites(kv)
    started = time.perf_counter()
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("loading", total=items)
            for i in range(items):
                await _one_op(writes, rng, live, report, i)
                if i % 500 == 0:
                    progress.update(task, completed=i - writes.pending)
            await writes.drain()
    finally:
        await writes.aclose()
        await kv.close()
    report.ops = items
    report.seconds = time.perf_counter() - started


class Writes(Protocol):
    """What the workload writes through: pipelined (`OrderedWrites`) or one at a time (the
    cluster demo, which follows each write through a failover)."""

    async def set(self, key: bytes, value: bytes, *, expiry: int = 0) -> None: ...

    async def delete(self, key: bytes) -> None: ...


async def _one_op(
    writes: Writes, rng: random.Random, live: list[bytes], report: LoadReport, i: int
) -> None:
    roll = rng.random()
    if live and roll < 0.10:
        key = live.pop(rng.randrange(len(live)))
        await writes.delete(key)
        return
    if live and roll < 0.35:
        key = rng.choice(live)
    else:
        key = b"order::%08d" % i
        live.append(key)
        report.keys.add(key)
    value = b'{"order":%d,"amount":%d,"status":"%s"}' % (
        i, rng.randrange(10_000), rng.choice([b"new", b"paid", b"shipped"])
    )  # fmt: skip
    if roll > 0.95:
        await writes.set(key, value, expiry=EXPIRY_S)
        report.expiring.append(key)
        live.remove(key)  # left alone until it expires (a delete could find it gone)
    else:
        await writes.set(key, value)


async def read_back(port: int, keys: set[bytes]) -> dict[bytes, GetResult]:
    """GET every key; expired documents are found missing (and expire on access)."""
    kv = await KvClient.connect("127.0.0.1", port)
    found: dict[bytes, GetResult] = {}
    try:
        for key in sorted(keys):
            try:
                found[key] = await kv.get(key)
            except KeyNotFoundError:
                continue
    finally:
        await kv.close()
    return found


async def read_store(port: int, vbuckets: int) -> dict[bytes, Document]:
    """The store's truth: every key's newest version in every vbucket, with its metadata."""
    return await read_current_state(ClientConfig(port=port), range(vbuckets))


@dataclass
class MirrorCheck:
    """The mirror table against the store, on every column. Keys are bytes, as on the wire."""

    live: int = 0  # keys live in the store
    deleted: int = 0  # tombstones in the store
    missing: list[bytes] = field(default_factory=list)  # live in the store, not in the mirror
    undeleted: list[bytes] = field(default_factory=list)  # deleted in the store, in the mirror
    unknown: list[bytes] = field(default_factory=list)  # in the mirror, not in the store at all
    # key -> (column, mirror's value, store's value) for each column that differs
    differ: dict[bytes, list[tuple[str, object, object]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.undeleted or self.unknown or self.differ)

    def summary(self) -> str:
        return (
            f"{len(self.missing)} missing, {len(self.undeleted)} deleted in the store but in "
            f"the mirror, {len(self.unknown)} unknown to the store, {len(self.differ)} differ"
        )


def check_mirror(mirror_table: Any, store: dict[bytes, Document]) -> MirrorCheck:
    """Compare the mirror (an Arrow table of ``read_mirror``) with ``store`` on every column.

    The mirror's flags and expiry are the wire's u32 narrowed to int32 (change_rows.py); they
    are widened back here, so differences print as the node has them. A mirror of typed
    documents (``format=json``) has the document's fields instead of ``value``: each is
    compared with the field of the stored JSON document (null where it has none).
    """
    keys = [k.encode("utf-8", "surrogateescape") for k in mirror_table.column("key").to_pylist()]
    names = _checked_columns(mirror_table.column_names)
    columns = [mirror_table.column(name).to_pylist() for name in names]
    if len(set(keys)) != len(keys):
        raise click.ClickException("the mirror holds a key twice")
    mirror = {key: _widened(row, names) for key, *row in zip(keys, *columns, strict=True)}
    check = MirrorCheck()
    for key, doc in sorted(store.items()):
        if doc.deleted:
            check.deleted += 1
            if key in mirror:
                check.undeleted.append(key)
            continue
        check.live += 1
        held = mirror.get(key)
        if held is None:
            check.missing.append(key)
            continue
        want = _stored(doc, names)
        differ = [
            (name, got, wanted)
            for name, got, wanted in zip(names, held, want, strict=True)
            if got != wanted
        ]
        if differ:
            check.differ[key] = differ
    check.unknown = sorted(mirror.keys() - store.keys())
    assert check.live + check.deleted == len(store), (check.live, check.deleted, len(store))
    return check


def _checked_columns(mirror_columns: list[str]) -> tuple[str, ...]:
    """CHECKED_COLUMNS, with a typed mirror's document fields in place of ``value``."""
    if "value" in mirror_columns:
        return CHECKED_COLUMNS
    fields = [n for n in mirror_columns if n not in ("key", *CHECKED_COLUMNS)]
    return (*(c for c in CHECKED_COLUMNS if c != "value"), *fields)


def _stored(doc: Document, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The store's values of ``names`` for a live document (typed fields from its JSON)."""
    meta = {"vbucket": doc.vbucket, "seqno": doc.seqno, "value": doc.value, "cas": doc.cas,
            "flags": doc.flags, "expiry": doc.expiry, "rev_seqno": doc.rev_seqno}  # fmt: skip
    if "value" not in names:
        try:
            fields = json.loads(doc.value)
        except ValueError:
            fields = {"_corrupt_record": doc.value.decode("utf-8", "replace")}
        meta |= {n: fields.get(n) for n in names if n not in meta}
    return tuple(meta[name] for name in names)


def _widened(row: list[Any], names: tuple[str, ...]) -> tuple[Any, ...]:
    values = dict(zip(names, row, strict=True))
    values["flags"] &= U32_MASK
    values["expiry"] &= U32_MASK
    return tuple(values[name] for name in names)


def check_read_back(read: dict[bytes, GetResult], store: dict[bytes, Document]) -> list[str]:
    """Where the KV read-back (GET) disagrees with the DCP truth: live keys, value, CAS, flags."""
    live = {key: doc for key, doc in store.items() if not doc.deleted}
    problems = [f"{_shown(k)}: GET found it, the store has none" for k in read.keys() - live.keys()]
    problems += [
        f"{_shown(k)}: GET found nothing, the store has it" for k in live.keys() - read.keys()
    ]
    for key in sorted(read.keys() & live.keys()):
        got, doc = read[key], live[key]
        if (got.value, got.cas, got.flags) != (doc.value, doc.cas, doc.flags):
            problems.append(
                f"{_shown(key)}: GET value {_shown(got.value)} cas {got.cas} flags {got.flags}, "
                f"store value {_shown(doc.value)} cas {doc.cas} flags {doc.flags}"
            )
    return sorted(problems)


def print_differences(console: Console, check: MirrorCheck) -> None:
    """A readable account of every kind of difference, a few examples each."""
    console.print(f"[bold red]mirror != store[/]: {check.summary()}")
    for title, keys in (
        ("live in the store, missing from the mirror", check.missing),
        ("deleted in the store, still in the mirror", check.undeleted),
        ("in the mirror, unknown to the store", check.unknown),
    ):
        if keys:
            shown = ", ".join(_shown(k) for k in keys[:DIFF_EXAMPLES_MAX])
            console.print(escape(f"  {title} ({len(keys)}): {shown}"))
    if not check.differ:
        return
    table = Table(title=f"columns that differ ({len(check.differ)} keys; first shown)")
    for heading in ("key", "column", "mirror", "store"):
        table.add_column(heading)
    for key in sorted(check.differ)[:DIFF_EXAMPLES_MAX]:
        for name, got, want in check.differ[key]:
            table.add_row(escape(_shown(key)), name, escape(_shown(got)), escape(_shown(want)))
    console.print(table)


def _shown(value: object) -> str:
    if isinstance(value, bytes):
        text = value[:VALUE_SHOWN_BYTES_MAX].decode("utf-8", "backslashreplace")
        return text + ("…" if len(value) > VALUE_SHOWN_BYTES_MAX else "")
    return str(value)


def run_mirror(spark: Any, options: dict[str, str], tables: Path, checkpoint: Path,
               *, stop_after_batches: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Run the streaming mirror (availableNow); optionally stop it after some batches."""
    from changefeed.spark import MirrorWriter

    df = spark.readStream.format("changefeed").options(**options).load()
    query = (
        df.writeStream.foreachBatch(MirrorWriter(tables, options))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    if stop_after_batches is None:
        query.awaitTermination()
    else:
        while query.isActive and len(query.recentProgress) < stop_after_batches:
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
            time.sleep(0.01)  # stop between micro-batches: a quieter stop, same guarantees
        query.stop()
    return [dict(p) for p in query.recentProgress]


def run_single_node_demo(
    items: int, vbuckets: int, batch_rows: int, data_dir: Path | None, seed: int
) -> None:
    """The demo on one node (the `changefeed demo` command is cli/demo_command.py)."""
    console = Console()
    root = data_dir or Path(tempfile.mkdtemp(prefix="changefeed-demo-"))
    if data_dir is not None and data_dir.exists() and any(data_dir.iterdir()):
        raise click.ClickException(f"{data_dir} is not empty; the demo needs a fresh directory")
    cluster = DemoCluster(root, vbuckets)
    try:
        _demo(console, cluster, root, items, batch_rows, seed)
    finally:
        cluster.stop()  # the data and tables stay for you to query


def _demo(console: Console, cluster: DemoCluster, root: Path, items: int, batch_rows: int,
          seed: int) -> None:  # fmt: skip
    address = cluster.start()
    port = int(address.rsplit(":", 1)[1])
    console.print(f"[bold]node[/] serving on {address}, data in {root}")
    load = LoadReport()
    asyncio.run(load_workload(port, items, seed, console, load))
    console.print(f"[bold]loaded[/] {load.ops:,} ops in {load.seconds:.1f} s")

    from changefeed.spark.session import local_session

    spark = local_session("changefeed-demo")
    options = {"cluster": address, "maxOffsetsPerTrigger": str(batch_rows),
               "failOnDataLoss": "false"}  # fmt: skip
    tables, checkpoint = root / "tables", root / "checkpoint"
    started = time.perf_counter()
    progress = run_mirror(spark, options, tables, checkpoint, stop_after_batches=2)
    console.print(f"[bold]query[/] stopped after {len(progress)} micro-batches; restarting")
    progress += run_mirror(spark, options, tables, checkpoint)
    time.sleep(max(0.0, EXPIRY_S + 0.5 - (time.perf_counter() - started)))
    read = asyncio.run(read_back(port, load.keys))  # expired documents expire on access
    progress += run_mirror(spark, options, tables, checkpoint)
    elapsed = time.perf_counter() - started
    store = asyncio.run(read_store(port, cluster.vbuckets))  # nothing writes any more
    _verify_and_report(console, read, store, tables, progress, elapsed, load)


def _verify_and_report(console: Console, read: dict[bytes, GetResult],
                       store: dict[bytes, Document], tables: Path,
                       progress: list[dict[str, Any]], elapsed: float,
                       load: LoadReport) -> None:  # fmt: skip
    from changefeed.spark import read_mirror

    problems = check_read_back(read, store)
    if problems:
        for line in problems[:DIFF_EXAMPLES_MAX]:
            console.print(escape(f"  {line}"))
        raise click.ClickException(f"KV read-back != store (DCP): {len(problems)} keys differ")
    mirror_table = read_mirror(tables)
    mirror_columns = mirror_table.column_names
    check = check_mirror(mirror_table, store)
    if not check.ok:
        print_differences(console, check)
        raise click.ClickException(f"mirror != store: {check.summary()}")
    rows = sum(int(p.get("numInputRows", 0)) for p in progress)
    durations = [
        p["durationMs"].get("triggerExecution", 0) / 1000 for p in progress if p.get("numInputRows")
    ]
    table = Table(title="changefeed demo — node → DCP → Spark → Delta mirror")
    table.add_column("what")
    table.add_column("result", justify="right")
    table.add_row("KV ops loaded", f"{load.ops:,} ({load.ops / load.seconds:,.0f} ops/s)")
    table.add_row("change rows mirrored", f"{rows:,} in {len(progress)} micro-batches")
    table.add_row("pipeline rate", f"{rows / elapsed:,.0f} rows/s (incl. Spark start-up)")
    if durations:
        table.add_row("micro-batch latency p50", f"{statistics.median(durations):.2f} s")
    table.add_row("expired documents", f"{len(load.expiring):,}")
    table.add_row(
        "verified",
        f"mirror == store on all columns (key, {', '.join(_checked_columns(mirror_columns))}, "
        "deletion): "
        f"{check.live:,} live keys, {check.deleted:,} deleted, 0 differences",
    )
    table.add_row("tables", f"{tables}/changelog, {tables}/mirror (Delta)")
    console.print(table)
    console.print("query them with DuckDB (one line):")
    # Not wrapped at the terminal's width and without markup: it must run as printed.
    console.print("  " + duckdb_command(tables), soft_wrap=True, markup=False, highlight=False)


def duckdb_command(tables: Path) -> str:
    """A shell command that queries the mirror with DuckDB, with this interpreter (which has
    duckdb and deltalake: ``python`` on the PATH may not)."""
    code = (
        f"import duckdb, deltalake; m = deltalake.DeltaTable({json.dumps(str(tables / 'mirror'))})"
        '.to_pyarrow_dataset(); print(duckdb.sql("select count(*), max(seqno) from m"))'
    )
    return shlex.join([sys.executable, "-c", code])
