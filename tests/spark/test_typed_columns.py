"""Documents as typed columns through Spark (one local[2] session for the module), schema
evolution of the Delta tables, and the lag the source reports.

- ``spark.read`` and ``readStream`` give the documents' fields as typed columns (nested objects,
  arrays, nulls, a field holding integers and doubles read as double) with the metadata
  columns, equal to the store on every column; the inferred schema is the same on two runs;
- PERMISSIVE keeps a malformed document's text, DROPMALFORMED drops it, FAILFAST fails;
- a field new in the query's schema is refused by the mirror without ``mergeSchema`` (the error
  names it) and added with it;
- the lag in each progress event (``sources[0].latestOffset``, what a ``StreamingQueryListener``
  sees) is above 0 while a writer runs, and 0 after the batch that caught up once it stops.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA
from changefeed.spark import MirrorWriter, read_mirror
from changefeed.spark.documents import METADATA_COLUMNS, DocumentReader
from changefeed.spark.mirror import SchemaEvolutionError
from support.nodes import NodeFactory

from .helpers import (
    Model,
    assert_typed_mirror_matches,
    expected_document,
    store_state,
    write,
)

FAST_NODE = ["--no-durable"]
MALFORMED = [b"not json", b'{"id": 7, "price":', b"[1, 2]"]


def document(i: int, rng: random.Random) -> bytes:
    """A nested document; ``price`` is an integer or a double, some fields null or absent."""
    doc: dict[str, Any] = {
        "id": i,
        "price": rng.choice([i, i + 0.25]),
        "name": rng.choice([f"n{i}", None]),
        "tags": [f"t{j}" for j in range(rng.randrange(3))],
        "address": rng.choice([None, {"city": f"c{i % 7}", "geo": [i, i / 3]}]),
    }
    if rng.random() < 0.3:
        del doc["name"]
    return json.dumps(doc).encode()


def load(port: int, rng: random.Random, count: int) -> Model:
    model: Model = {}
    ops: list[tuple[str, bytes | None]] = [(f"d{i:05d}", document(i, rng)) for i in range(count)]
    ops += [(f"bad{i}", raw) for i, raw in enumerate(MALFORMED)]
    ops += [(f"d{i:05d}", None) for i in range(0, count, 10)]  # deletions
    write(port, ops, model)
    return model


def test_documents_as_typed_columns(
    spark: Any, nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=FAST_NODE)
    load(node.port, rng, 600)
    options = node.source_options()

    first = spark.read.format("changefeed").options(**options).load()
    assert first.schema == spark.read.format("changefeed").options(**options).load().schema
    types = {f.name: f.dataType.simpleString() for f in first.schema.fields}
    assert types["price"] == "double", types  # integers and doubles: double
    assert types["address"] == "struct<city:string,geo:array<double>>", types
    assert types["tags"] == "array<string>", types
    assert [f.name for f in first.schema.fields][: len(METADATA_COLUMNS)] == list(METADATA_COLUMNS)
    assert "value" not in types and types["_corrupt_record"] == "string"

    rows = first.toArrow()
    fields = pa.schema([rows.schema.field(n) for n in ("address", "id", "name", "price", "tags")])
    truth = store_state(node)
    got = {r["key"]: r for r in rows.to_pylist()}
    assert got.keys() == truth.keys()
    for key, doc in truth.items():
        typed = expected_document(doc.value, fields)
        row = got[key]
        assert (row["seqno"], row["cas"], row["rev_seqno"]) == (doc.seqno, doc.cas, doc.rev_seqno)
        if typed is None:
            assert row["_corrupt_record"] == doc.value.decode(), key
            assert all(row[name] is None for name in fields.names), key
        else:
            assert {name: row[name] for name in fields.names} == typed, key
            assert row["_corrupt_record"] is None

    dropped = spark.read.format("changefeed").options(mode="DROPMALFORMED", **options).load()
    assert dropped.count() == len(truth) - len(MALFORMED)
    assert "_corrupt_record" not in dropped.columns
    failing = spark.read.format("changefeed").options(mode="FAILFAST", **options).load()
    with pytest.raises(Exception, match="malformed JSON document"):
        failing.count()

    query = (
        spark.readStream.format("changefeed")
        .options(maxOffsetsPerTrigger="300", **options)
        .load()
        .writeStream.foreachBatch(MirrorWriter(tmp_path / "tables", options))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(180), "the availableNow query did not finish"
    finally:
        query.stop()
    assert query.exception() is None, query.exception()
    assert len([p for p in query.recentProgress if p["numInputRows"]]) >= 2
    assert_typed_mirror_matches(tmp_path / "tables", node)


def change_rows(rows: list[tuple[int, str, bytes | None]]) -> pa.Table:
    """Change rows of vbucket 0: (seqno, key, document or None for a deletion)."""
    return pa.Table.from_pylist(
        [
            {"vbucket": 0, "seqno": seqno, "key": key, "value": value or b"",
             "op": "mutation" if value is not None else "deletion", "cas": seqno, "expiry": 0,
             "flags": 0, "rev_seqno": 1, "snap_start": seqno, "snap_end": seqno}
            for seqno, key, value in rows
        ],
        schema=CHANGE_ROW_SCHEMA,
    )  # fmt: skip


def typed(changes: pa.Table, *fields: pa.Field) -> pa.Table:
    """``changes`` as the source gives them with documents of ``fields``."""
    metadata = [CHANGE_ROW_SCHEMA.field(name) for name in METADATA_COLUMNS]
    output = pa.schema([*metadata, *fields, pa.field("_corrupt_record", pa.string())])
    return pa.Table.from_batches([DocumentReader(output).convert(changes)])


def test_a_new_field_needs_merge_schema(tmp_path: Path) -> None:
    a, b = pa.field("a", pa.int64()), pa.field("b", pa.string())
    first = change_rows([(1, "k1", b'{"a":1,"b":"x"}'), (2, "k2", b'{"a":2}')])
    MirrorWriter(tmp_path, {}).write(typed(first, a), 0)
    later = change_rows([(3, "k1", b'{"a":3,"b":"y"}'), (4, "k3", b'{"b":"z"}'), (5, "k2", None)])

    with pytest.raises(SchemaEvolutionError, match=r"'b'.*mergeSchema"):
        MirrorWriter(tmp_path, {}).write(typed(later, a, b), 1)
    assert read_mirror(tmp_path).column_names == [
        "key",
        "vbucket",
        "seqno",
        "cas",
        "flags",
        "expiry",
        "rev_seqno",
        "a",
        "_corrupt_record",
    ]

    MirrorWriter(tmp_path, {"mergeSchema": "true"}).write(typed(later, a, b), 1)
    got = {r["key"]: (r["a"], r["b"]) for r in read_mirror(tmp_path).to_pylist()}
    assert got == {"k1": (3, "y"), "k3": (None, "z")}  # k2 deleted; b null where unknown
    changelog = read_mirror(tmp_path).schema  # the changelog took the column too
    assert "b" in changelog.names

    dropped_again = change_rows([(6, "k4", b'{"a":6,"b":"w"}')])
    MirrorWriter(tmp_path, {}).write(typed(dropped_again, a), 2)  # b left out: written as null
    got = {r["key"]: (r["a"], r["b"]) for r in read_mirror(tmp_path).to_pylist()}
    assert got == {"k1": (3, "y"), "k3": (None, "z"), "k4": (6, None)}


class LagListener:
    """Collects the lag of every progress event (as a StreamingQueryListener sees it)."""

    def __init__(self) -> None:
        from pyspark.sql.streaming import StreamingQueryListener

        lags: list[tuple[float, dict[str, Any]]] = []
        self.lags = lags

        class Listener(StreamingQueryListener):  # type: ignore[misc]
            def onQueryStarted(self, event: Any) -> None:
                pass

            def onQueryProgress(self, event: Any) -> None:
                reported = json.loads(event.progress.sources[0].latestOffset)
                lags.append((time.time(), reported["lag"]))

            def onQueryIdle(self, event: Any) -> None:
                pass

            def onQueryTerminated(self, event: Any) -> None:
                pass

        self.listener = Listener()


def test_lag_is_above_zero_while_writing_and_reaches_zero(
    spark: Any, nodes: NodeFactory, tmp_path: Path
) -> None:
    node = nodes(args=FAST_NODE)
    write(node.port, [(f"k{i}", b'{"n":1}') for i in range(100)])
    collected = LagListener()
    spark.streams.addListener(collected.listener)
    query = (
        spark.readStream.format("changefeed")
        .options(**node.source_options(schema="n bigint"))
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="500 milliseconds")
        .start()
    )
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():  # bounded by the test's stop
            write(node.port, [(f"w{i}-{j}", b'{"n":2}') for j in range(50)])
            i += 1
            time.sleep(0.05)

    thread = threading.Thread(target=writer, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while not any(lag and lag["items"] > 0 for _, lag in collected.lags):
            assert time.monotonic() < deadline, f"no lag seen while writing: {collected.lags}"
            assert query.exception() is None, query.exception()
            time.sleep(0.2)
        behind = [lag for _, lag in collected.lags if lag and lag["items"] > 0]
        assert behind[-1]["ageS"] > 0 and behind[-1]["vbuckets"], behind[-1]
        stop.set()
        thread.join(30)
        stopped = time.time()
        # Spark reports no progress while idle: the batch that caught up says 0 after it.
        deadline = time.monotonic() + 60
        while not any(at > stopped and lag and lag["afterBatch"]["items"] == 0
                      for at, lag in collected.lags):  # fmt: skip
            assert time.monotonic() < deadline, f"lag did not reach 0: {collected.lags[-3:]}"
            assert query.exception() is None, query.exception()
            time.sleep(0.2)
        time.sleep(2)  # idle triggers since: no new progress event, or one with no lag
        assert collected.lags[-1][1]["afterBatch"]["items"] == 0, collected.lags[-1]
    finally:
        stop.set()
        query.stop()
        spark.streams.removeListener(collected.listener)
