"""Helpers of the Spark tests: a seeded workload with its model, the truth as a key -> document
map (all metadata), and checks of the Delta mirror and changelog.

Nodes come from the shared ``nodes`` fixture (``tests/support``: ``NodeProcess`` on 127.0.0.1,
stopped by pid when the test ends), writes go through ``support.clients.upsert_retrying`` and
the truth through ``support.consumer.server_state``, as in the integration tests. ``write``
applies a workload through ``KvClient`` and keeps a model (key -> value, None once deleted);
``write_meta`` writes documents with flags and expiry, so metadata checks have something to
compare.
``store_state`` is the truth as the mirror table holds it: each live key's ``Doc`` (every
column: vbucket, seqno, value, cas, flags, expiry, rev_seqno); ``assert_mirror_matches``
compares a mirror table with it on every column, key by key, and its values with the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import KvClient
from changefeed.protocol.errors import KeyNotFoundError, TemporaryFailureError
from changefeed.spark import read_mirror
from changefeed.spark.mirror import MIRROR_COLUMNS
from support.clients import HOST, TMPFAIL_RETRIES_MAX, upsert_retrying
from support.consumer import Change, server_state

WRITE_CHUNK = 2000
TRUTH_TIMEOUT_S = 120.0

Model = dict[str, bytes | None]
Op = tuple[str, bytes | None]  # (key, value); None deletes
MetaOp = tuple[str, bytes, int, int]  # (key, value, flags, expiry): an upsert with metadata


# -- workload ----------------------------------------------------------------------------------


def workload(
    rng: random.Random,
    count: int,
    *,
    keys: int,
    prefix: str = "k",
    tag: str = "v",
    delete_ratio: float = 0.05,
) -> list[Op]:
    """``count`` random upserts and deletes over ``keys`` keys; values name the op's index."""
    assert count >= 0, count
    assert keys > 0, keys
    ops: list[Op] = []
    for i in range(count):
        key = f"{prefix}-{rng.randrange(keys):07d}"
        if rng.random() < delete_ratio:
            ops.append((key, None))
        else:
            ops.append((key, f"{tag}-{i}-{rng.randrange(10**6)}".encode()))
    return ops


async def write_async(port: int, ops: list[Op], model: Model | None = None) -> None:
    """Apply ``ops`` in order (runs of upserts pipelined) and update ``model``."""
    async with await KvClient.connect(HOST, port) as kv:
        run: list[tuple[bytes, bytes]] = []
        for key, value in ops:
            if value is not None:
                run.append((key.encode(), value))
                if len(run) >= WRITE_CHUNK:
                    await upsert_retrying(kv, run, chunk=WRITE_CHUNK)
                    run = []
                continue
            await upsert_retrying(kv, run, chunk=WRITE_CHUNK)
            run = []
            with contextlib.suppress(KeyNotFoundError):  # deleting an absent key is fine
                await kv.remove(key.encode())
        await upsert_retrying(kv, run, chunk=WRITE_CHUNK)
    if model is not None:
        model.update(ops)


def write(port: int, ops: list[Op], model: Model | None = None) -> None:
    asyncio.run(write_async(port, ops, model))


async def write_meta_async(port: int, docs: list[MetaOp], model: Model | None = None) -> None:
    """Upsert each ``(key, value, flags, expiry)`` in order, one at a time (``upsert_many``
    sends no flags or expiry), retrying on TMPFAIL; update ``model``."""
    async with await KvClient.connect(HOST, port) as kv:
        for key, value, flags, expiry in docs:
            for attempt in range(TMPFAIL_RETRIES_MAX):
                try:
                    await kv.upsert(key.encode(), value, flags=flags, expiry=expiry)
                    break
                except TemporaryFailureError:
                    await asyncio.sleep(min(0.05, 0.001 * (attempt + 1)))
            else:
                raise TimeoutError("writes kept failing with TMPFAIL")
    if model is not None:
        model.update((key, value) for key, value, _, _ in docs)


def write_meta(port: int, docs: list[MetaOp], model: Model | None = None) -> None:
    asyncio.run(write_meta_async(port, docs, model))


def live(model: Model) -> dict[str, bytes]:
    return {k: v for k, v in model.items() if v is not None}


# -- truth ---------------------------------------------------------------------------------------


class Doc(NamedTuple):
    """A live document as the mirror table holds it: every column but the key."""

    vbucket: int
    seqno: int
    value: bytes
    cas: int
    flags: int  # u32 on the wire, as int32 (the change-row schema's narrowing)
    expiry: int  # u32 on the wire, as int32
    rev_seqno: int


DOC_COLUMNS = Doc._fields
assert set(DOC_COLUMNS) == set(MIRROR_COLUMNS) - {"key"}, (DOC_COLUMNS, MIRROR_COLUMNS)


def _int32(u32: int) -> int:
    assert 0 <= u32 < 2**32, u32
    return u32 - 2**32 if u32 >= 2**31 else u32


def doc_of(change: Change) -> Doc:
    """The mirror row a live change of the truth stream must have become."""
    assert not change.deleted, change
    return Doc(
        change.vbucket, change.seqno, change.value, change.cas, _int32(change.flags),
        _int32(change.expiry), change.rev_seqno,
    )  # fmt: skip


async def store_state_async(
    node: NodeProcess, *, timeout_s: float = TRUTH_TIMEOUT_S
) -> dict[str, Doc]:
    """Every live key and its document with all metadata: ``server_state`` (a fresh DCP stream
    of every vbucket from the beginning to its high seqno), keys decoded as the mirror table
    holds them. Deleted keys are left out (the mirror holds no tombstones)."""
    state = await server_state(node, timeout_s=timeout_s)
    return {
        key.decode("utf-8", "surrogateescape"): doc_of(change)
        for key, change in state.latest().items()
        if not change.deleted
    }


def store_state(node: NodeProcess) -> dict[str, Doc]:
    return asyncio.run(store_state_async(node))


def table_state(table: pa.Table) -> dict[str, Doc]:
    """key -> Doc of a mirror table (or of any table with the mirror's columns: change rows)."""
    keys = table.column("key").to_pylist()
    assert len(set(keys)) == len(keys), "the table holds a key twice"
    columns = [table.column(name).to_pylist() for name in DOC_COLUMNS]
    return {key: Doc(*row) for key, *row in zip(keys, *columns, strict=True)}


def table_values(table: pa.Table) -> dict[str, bytes]:
    """key -> value only (hand-built rows, whose metadata no node ever had)."""
    return {key: doc.value for key, doc in table_state(table).items()}


def values_of(docs: dict[str, Doc]) -> dict[str, bytes]:
    return {key: doc.value for key, doc in docs.items()}


def diff(got: Mapping[str, object], want: Mapping[str, object]) -> str:
    """Empty when equal; else counts and examples of missing, extra and differing keys. For
    ``Doc`` values each example names the columns that differ (got vs want)."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    if not (missing or extra or differ):
        return ""
    examples = [f"{k!r}: {_columns_differing(got[k], want[k])}" for k in differ[:3]]
    return (
        f"{len(missing)} missing (e.g. {missing[:5]}), {len(extra)} extra (e.g. {extra[:5]}), "
        f"{len(differ)} differ (e.g. {'; '.join(examples)})"
    )


def _columns_differing(got: object, want: object) -> str:
    if not (isinstance(got, Doc) and isinstance(want, Doc)):
        return f"got {got!r}, want {want!r}"
    return ", ".join(
        f"{name} got {a!r} want {b!r}"
        for name, a, b in zip(DOC_COLUMNS, got, want, strict=True)
        if a != b
    )


def assert_mirror_matches(
    path: Path, node: NodeProcess, model: Model | None = None
) -> dict[str, Doc]:
    """The mirror table equals the store on every column (vbucket, seqno, value, cas, flags,
    expiry, rev_seqno), key by key, and holds exactly the store's live keys (deletion state);
    its values equal the writer's model. Returns the mirror."""
    mirror = table_state(read_mirror(path))
    truth = store_state(node)
    problem = diff(mirror, truth)
    assert not problem, f"mirror differs from the store: {problem}"
    if model is not None:
        problem = diff(values_of(truth), live(model))
        assert not problem, f"store differs from the writer's model: {problem}"
    return mirror


# -- typed documents (format=json) ---------------------------------------------------------------


def expected_field(value: Any, arrow_type: pa.DataType) -> Any:
    """What Spark's JSON reader makes of a JSON value for a field of ``arrow_type`` (the types
    the tests use); raises TypeError where it finds the document malformed."""
    if value is None:
        return None
    if pa.types.is_string(arrow_type):
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if pa.types.is_int64(arrow_type):
        if type(value) is not int:
            raise TypeError(value)
        return value
    if pa.types.is_float64(arrow_type):
        if type(value) not in (int, float):
            raise TypeError(value)
        return float(value)
    if pa.types.is_boolean(arrow_type):
        if type(value) is not bool:
            raise TypeError(value)
        return value
    if pa.types.is_list(arrow_type):
        if not isinstance(value, list):
            raise TypeError(value)
        return [expected_field(v, arrow_type.value_type) for v in value]
    assert pa.types.is_struct(arrow_type), arrow_type
    if not isinstance(value, dict):
        raise TypeError(value)
    return {f.name: expected_field(value.get(f.name), f.type) for f in arrow_type}


def expected_document(raw: bytes, fields: pa.Schema) -> dict[str, Any] | None:
    """The typed row of a document (``json.loads`` and Spark's rules), None if malformed."""
    try:
        document = json.loads(raw)
        if not isinstance(document, dict):
            return None
        return {f.name: expected_field(document.get(f.name), f.type) for f in fields}
    except (ValueError, TypeError):
        return None


def typed_row(
    doc: Doc, fields: pa.Schema, corrupt: str | None = "_corrupt_record"
) -> dict[str, Any]:
    """The mirror row (all but the key) a live document of the store must have become with
    typed documents: its metadata, its fields, and its raw text if it is malformed."""
    row: dict[str, Any] = {name: getattr(doc, name) for name in DOC_COLUMNS if name != "value"}
    typed = expected_document(doc.value, fields)
    row |= typed if typed is not None else dict.fromkeys(fields.names)
    if corrupt is not None:
        row[corrupt] = None if typed is not None else doc.value.decode("utf-8", "replace")
    return row


def assert_typed_mirror_matches(path: Path, node: NodeProcess) -> pa.Table:
    """The mirror table of typed documents equals the store on every column: metadata
    (vbucket, seqno, cas, flags, expiry, rev_seqno), each document field, the corrupt record,
    and holds exactly the store's live keys."""
    table = read_mirror(path)
    fields = pa.schema(
        [f for f in table.schema if f.name not in MIRROR_COLUMNS and f.name != "_corrupt_record"]
    )
    corrupt = "_corrupt_record" if "_corrupt_record" in table.column_names else None
    keys = table.column("key").to_pylist()
    assert len(set(keys)) == len(keys), "the mirror holds a key twice"
    got = {r.pop("key"): r for r in table.to_pylist()}
    want = {key: typed_row(doc, fields, corrupt) for key, doc in store_state(node).items()}
    problem = diff(got, want)
    assert not problem, f"mirror differs from the store: {problem}"
    return table


def changelog(path: Path) -> pa.Table:
    return DeltaTable(str(path / "changelog")).to_pyarrow_table()


def assert_changelog_once(path: Path) -> pa.Table:
    """Each (vbucket, seqno) of a change row appears at most once in the changelog."""
    table = changelog(path)
    changes = table.filter(pc.not_equal(table.column("op"), "rollback"))
    counts = changes.group_by(["vbucket", "seqno"]).aggregate([("seqno", "count")])
    twice = counts.filter(pc.greater(counts.column("seqno_count"), 1))
    assert twice.num_rows == 0, f"changelog rows written twice: {twice.slice(0, 5).to_pylist()}"
    return table


def processes_in_group(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def run_available_now(
    spark: Any,
    options: Mapping[str, str],
    sink: Callable[[Any, int], None],
    checkpoint: Path,
    *,
    closing: Sequence[Any] = (),
) -> Any:
    """Stream ``format("changefeed")`` with ``options`` into ``foreachBatch(sink)`` until what
    was there at the start is read (``availableNow``; fails after 180 s), close ``closing``
    (writers), fail on the query's error; the query is returned for its progress."""
    query = (
        spark.readStream.format("changefeed").options(**options).load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True).start()
    )  # fmt: skip
    try:
        assert query.awaitTermination(180), "the availableNow query did not finish in 180 s"
    finally:
        query.stop()
        for closed in closing:
            closed.close()
    assert query.exception() is None, query.exception()
    return query
