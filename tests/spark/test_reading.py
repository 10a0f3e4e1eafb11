"""Executor-side reading (``reading.read_ranges_sync``) against a real node, without Spark.

- a range ends exactly at its end seqno, also when a disk snapshot runs far past it;
- a range whose node history fell behind its start offset (a restored node on a new branch:
  end < start) gets its rollback row and then the new history, instead of ERANGE;
- a rollback to 0 is a DataLossError under failOnDataLoss=true, and a rollback row otherwise;
- the streaming planner's kept connections (``LatestPoller``) answer as a fresh
  ``fetch_latest`` does, across a node restart, and its long poll says whether anything is new;
- a long poll on a node that stopped answering ends with its window (not the connection's
  30 s request deadline) and drops the kept connection.
"""

from __future__ import annotations

import os
import signal
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from changefeed import limits
from changefeed.cli.node_process import NodeProcess
from changefeed.spark.node_state import LatestPoller, fetch_latest_sync
from changefeed.spark.offsets import VbOffset
from changefeed.spark.options import SourceOptions
from changefeed.spark.reading import DataLossError, VbRange, read_chunks_sync, read_ranges_sync
from changefeed.spark.schema import ARROW_SCHEMA
from changefeed.vbmap import vbucket_for_key
from support.nodes import NodeFactory

from .helpers import write

REQUEST_DEADLINE_S = 30.0  # the connection's request deadline a silent node's poll once waited

FAST_NODE = ["--no-durable"]


def read(node: NodeProcess, ranges: list[VbRange], **options: str) -> pa.Table:
    parsed = SourceOptions.parse(node.source_options(**options))
    return pa.Table.from_batches(list(read_ranges_sync(parsed, ranges)), ARROW_SCHEMA)


def unique_keys(node: NodeProcess, count: int, tag: str) -> None:
    write(node.port, [(f"{tag}-{i:06d}", f"{tag}-{i}".encode()) for i in range(count)])


@pytest.mark.timeout(120)
def test_a_range_ends_at_its_end_seqno_from_memory_and_from_disk(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4, args=FAST_NODE)
    unique_keys(node, 4000, "a")  # every key new: no deduplication, seqnos 1..high all present
    latest, _ = fetch_latest_sync(SourceOptions.parse(node.source_options()))
    for source in ("memory", "disk"):
        if source == "disk":
            node.stop()
            node.start()  # checkpoints are gone: every read is a disk backfill to the high seqno
        ranges = [VbRange(vb, VbOffset(o.vb_uuid, 100, 100, 100), o.seqno // 2) for vb, o in
                  latest.items()]  # fmt: skip
        table = read(node, ranges)
        for vb, o in latest.items():
            rows = table.filter(pc.equal(table.column("vbucket"), vb))
            assert rows.column("seqno").to_pylist() == list(range(101, o.seqno // 2 + 1)), source
        assert set(table.column("op").to_pylist()) == {"mutation"}


@pytest.mark.timeout(120)
def test_a_history_behind_the_start_rolls_back_instead_of_erange(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4, args=FAST_NODE)
    unique_keys(node, 800, "w0")
    node.stop()
    old = node.copy_data(node.root / "old")
    node.start()
    common, _ = fetch_latest_sync(SourceOptions.parse(node.source_options()))
    unique_keys(node, 2000, "w1")
    lost, _ = fetch_latest_sync(SourceOptions.parse(node.source_options()))
    node.stop()
    node.restore_data(old)
    node.start()
    node.kill()  # the restart after a crash opens a new branch (a new failover entry)
    node.start()
    unique_keys(node, 400, "w2")
    latest, _ = fetch_latest_sync(SourceOptions.parse(node.source_options()))
    assert all(latest[vb].seqno < lost[vb].seqno for vb in latest), (latest, lost)
    assert all(latest[vb].vb_uuid != lost[vb].vb_uuid for vb in latest)

    ranges = [VbRange(vb, lost[vb], latest[vb].seqno, latest[vb].vb_uuid) for vb in latest]
    table = read(node, ranges)
    for vb in latest:
        rows = table.filter(pc.equal(table.column("vbucket"), vb)).to_pylist()
        assert rows[0]["op"] == "rollback", rows[:2]
        assert rows[0]["seqno"] == common[vb].seqno, "rolled back to where the histories split"
        seqnos = [r["seqno"] for r in rows[1:]]
        assert seqnos == list(range(common[vb].seqno + 1, latest[vb].seqno + 1))
        assert all(r["key"].startswith("w2-") for r in rows[1:])


@pytest.mark.timeout(120)
def test_rollback_to_zero_obeys_fail_on_data_loss(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4, args=FAST_NODE)
    unique_keys(node, 400, "a")
    latest, _ = fetch_latest_sync(SourceOptions.parse(node.source_options()))
    unknown_branch = VbOffset(12345, 50, 50, 50)  # a vb_uuid the node never had
    ranges = [VbRange(vb, unknown_branch, o.seqno, o.vb_uuid) for vb, o in latest.items()]
    with pytest.raises(DataLossError, match="failOnDataLoss=false"):
        read(node, ranges)
    table = read(node, ranges, failOnDataLoss="false")
    rollbacks = table.filter(pc.equal(table.column("op"), "rollback"))
    assert sorted(rollbacks.column("vbucket").to_pylist()) == sorted(latest)
    assert set(rollbacks.column("seqno").to_pylist()) == {0}
    assert table.num_rows - rollbacks.num_rows == sum(o.seqno for o in latest.values())


@pytest.mark.timeout(120)
def test_batches_are_bounded_and_of_the_exact_schema(
    nodes: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Record batches leave ``read_ranges`` once ``ROWS_PER_BATCH_MAX`` rows are collected
    (a batch may go over by one ``Changes`` event), each of exactly the change-row schema
    Spark checks, and together they hold every change once, in seqno order per vbucket."""
    node = nodes(vbuckets=4, args=FAST_NODE)
    unique_keys(node, 6000, "b")
    latest, _ = fetch_latest_sync(SourceOptions.parse(node.source_options()))
    monkeypatch.setattr(limits, "ROWS_PER_BATCH_MAX", 1000)
    ranges = [VbRange(vb, VbOffset(), o.seqno, o.vb_uuid) for vb, o in latest.items()]
    options = SourceOptions.parse(node.source_options())
    batches = list(read_ranges_sync(options, ranges))
    sizes = [b.num_rows for b in batches]
    assert len(batches) >= 2, sizes
    assert all(isinstance(b, pa.RecordBatch) for b in batches)
    assert all(b.schema == ARROW_SCHEMA for b in batches)
    assert all(size >= 1000 for size in sizes[:-1]), sizes  # handed on once the bound is met
    assert sum(sizes) == sum(o.seqno for o in latest.values()), sizes
    table = pa.Table.from_batches(batches, ARROW_SCHEMA)
    for vb, o in latest.items():
        rows = table.filter(pc.equal(table.column("vbucket"), vb))
        assert rows.column("seqno").to_pylist() == list(range(1, o.seqno + 1))


@pytest.mark.timeout(120)
def test_chunks_name_the_vbuckets_whose_rows_are_all_taken(
    nodes: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's ``finished`` vbuckets have every row in it or in an earlier chunk (no later
    chunk holds one of theirs); the set only grows, and names every vbucket at the end. From
    disk the node backfills a few vbuckets of a connection at a time, so some finish early."""
    node = nodes(vbuckets=16, args=FAST_NODE)
    unique_keys(node, 8000, "f")
    node.stop()
    node.start()  # every read is a disk backfill
    latest, _ = fetch_latest_sync(SourceOptions.parse(node.source_options()))
    monkeypatch.setattr(limits, "ROWS_PER_BATCH_MAX", 500)
    ranges = [VbRange(vb, VbOffset(), o.seqno, o.vb_uuid) for vb, o in latest.items()]
    chunks = list(read_chunks_sync(SourceOptions.parse(node.source_options()), ranges))
    assert len(chunks) >= 4, len(chunks)
    seen: frozenset[int] = frozenset()
    for at, chunk in enumerate(chunks):
        assert chunk.finished >= seen, "finished vbuckets stay finished"
        seen = chunk.finished
        later = {vb for c in chunks[at + 1 :] for vb in c.batch.column("vbucket").to_pylist()}
        assert not later & chunk.finished, (at, sorted(later & chunk.finished))
    assert chunks[-1].finished == set(latest)
    assert any(c.finished for c in chunks[:-1]), "some vbuckets finish before the last chunk"
    rows = sum(c.batch.num_rows for c in chunks)
    assert rows == sum(o.seqno for o in latest.values())


@pytest.mark.timeout(120)
def test_a_kept_planner_answers_as_a_fresh_one_and_long_polls(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=8, args=FAST_NODE)
    unique_keys(node, 200, "a")
    options = SourceOptions.parse(node.source_options())
    poller = LatestPoller(options)
    try:
        seen, total = poller.fetch()
        assert (seen, total) == fetch_latest_sync(options)
        assert not poller.wait_for_change(seen, window_s=0.2, every_s=0.02)  # nothing written
        unique_keys(node, 1, "b")
        written = vbucket_for_key(b"b-000000", 8)
        others = {vb: o for vb, o in seen.items() if vb != written}
        assert not poller.wait_for_change(others, window_s=0.2, every_s=0.02)  # not ours
        assert poller.wait_for_change(seen, window_s=30.0, every_s=0.02)
        now, _ = poller.fetch()
        assert sum(o.seqno for o in now.values()) == sum(o.seqno for o in seen.values()) + 1
        node.stop()
        node.start()  # the kept connections are dead: the next call starts over from the seed
        unique_keys(node, 3, "c")
        assert poller.fetch() == fetch_latest_sync(options)
    finally:
        poller.close()


@pytest.mark.timeout(120)
def test_a_long_poll_on_a_silent_node_ends_with_its_window(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4, args=FAST_NODE)
    unique_keys(node, 20, "a")
    options = SourceOptions.parse(node.source_options(nodeTimeoutS="10"))
    poller = LatestPoller(options)
    try:
        seen, _ = poller.fetch()
        os.kill(node.pid, signal.SIGSTOP)  # kept connection open, nothing answers
        try:
            started = time.monotonic()
            assert poller.wait_for_change(seen, window_s=0.3, every_s=0.02)  # ask again
            # The window is 0.3 s; a poll held by the connection's request deadline took 30 s.
            # Only the call is timed (a node start under CPU load took most of a whole-test
            # 25 s timeout), against a bound far from both.
            took = time.monotonic() - started
            assert took < REQUEST_DEADLINE_S * 2 / 3, f"the poll took {took:.1f} s"
        finally:
            os.kill(node.pid, signal.SIGCONT)
        unique_keys(node, 1, "b")
        now, _ = poller.fetch()  # from the seeds again: the silent connection was dropped
        assert sum(o.seqno for o in now.values()) == sum(o.seqno for o in seen.values()) + 1
    finally:
        poller.close()
