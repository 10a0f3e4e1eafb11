"""``StreamReader``: memory when it can, disk when it must (seed figure 6), the
dropped -> backfill -> re-register dance, async waiting, and closing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.checkpoint import (
    CAUGHT_UP,
    CheckpointManager,
    Event,
    Flusher,
    Item,
    MemoryBudget,
    SnapshotStart,
    StreamReader,
    item_size_bytes,
)
from changefeed.checkpoint.backfill import StoredRun
from changefeed.checkpoint.reader import Run
from changefeed.storage import Op, Store
from changefeed.storage.record import decode_record, stored_seqno

from .helpers import DISK, MEMORY_CHECKPOINT, Model, ReaderCheck, item, markers, open_store

ONE = item_size_bytes(item(1, "k0000", b"x" * 100))


class Node:
    """A vbucket's write path in miniature: model + manager + flusher + store."""

    def __init__(self, store: Store, *, quota_items: int = 10_000) -> None:
        self.store = store
        self.model = Model()
        self.manager = CheckpointManager(
            0,
            budget=MemoryBudget(quota_items * ONE),
            checkpoint_max_bytes=max(ONE, quota_items * ONE // 10),
        )
        self.flusher = Flusher(self.manager, store, batch_bytes_max=50 * ONE)

    def write(self, count: int, *, keys: int = 50, flush_every: int = 0) -> None:
        for _ in range(count):
            seqno = self.model.high_seqno + 1
            op = Op.DELETION if seqno % 7 == 0 else Op.MUTATION
            one = item(seqno, f"k{seqno % keys:04d}", b"%0100d" % seqno, op=op)
            self.manager.queue(one)
            self.model.append(one)
            if flush_every and seqno % flush_every == 0:
                self.flusher.flush()

    def check(self, reader: StreamReader, start_seqno: int = 0) -> ReaderCheck:
        return ReaderCheck(start_seqno, self.model.state_at(start_seqno))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = open_store(tmp_path)
    yield opened
    opened.close()


def drain(reader: StreamReader, check: ReaderCheck) -> list[tuple[int, int, int]]:
    seen = []
    for event in reader:
        check.see(event)
        seen.append(event)
    return markers(seen)


def test_a_reader_whose_range_is_in_memory_never_touches_disk(store: Store) -> None:
    node = Node(store)
    reader = StreamReader(node.manager, store, name="s", start_seqno=0)
    node.write(30)
    check = node.check(reader)
    found = drain(reader, check)
    assert all(flags == MEMORY_CHECKPOINT for _, _, flags in found)
    assert check.view == node.model.latest()
    assert reader.stats["backfills"] == 0
    assert reader.from_memory


def test_figure_6_backfill_from_disk_then_switch_to_memory(store: Store) -> None:
    node = Node(store)
    node.write(200, flush_every=20)  # flushed and freed: memory keeps only the recent part
    node.write(15)  # not yet flushed: only in memory
    assert node.manager.first_memory_seqno > 1
    reader = StreamReader(node.manager, store, name="s", start_seqno=0)
    assert not reader.from_memory
    check = node.check(reader)
    found = drain(reader, check)
    stored_high = 200
    assert found[0] == (1, stored_high, DISK)
    assert all(flags & MEMORY_CHECKPOINT for _, _, flags in found[1:])
    assert found[1][0] == stored_high + 1
    assert check.view == node.model.latest()
    assert reader.from_memory
    assert reader.stats["backfills"] == 1
    assert reader.last_seqno == 215


def test_a_dropped_reader_backfills_and_returns_to_memory(store: Store) -> None:
    node = Node(store, quota_items=100)
    reader = StreamReader(node.manager, store, name="s", start_seqno=0)
    check = node.check(reader)
    node.write(10)
    for _ in range(5):
        event = reader.next()
        assert event is not CAUGHT_UP
        check.see(event)
    node.write(1000, keys=5000, flush_every=10)  # the reader stalls; recovery drops it
    assert node.manager.stats["cursors_dropped"] >= 1
    found = drain(reader, check)
    assert any(flags == DISK for _, _, flags in found)
    assert check.view == node.model.latest()
    assert reader.from_memory
    assert reader.stats["drops"] == 1


def test_the_dance_repeats_until_the_reader_reads_from_memory(store: Store) -> None:
    """Memory moves on while a backfill runs: the pinned cursor is dropped, the backfill ends
    below what memory holds, and a second backfill follows before memory takes over."""
    node = Node(store, quota_items=100)
    node.write(500, flush_every=10)
    reader = StreamReader(node.manager, store, name="s", start_seqno=0, backfill_bytes_max=5 * ONE)
    check = node.check(reader)
    for _ in range(20):  # part of the first backfill
        event = reader.next()
        assert event is not CAUGHT_UP
        check.see(event)
    node.write(1000, keys=5000, flush_every=10)  # unique keys: dedup cannot save memory
    found = drain(reader, check)
    assert reader.stats["backfills"] >= 2
    assert [flags for _, _, flags in found].count(DISK) >= 1
    assert check.view == node.model.latest()
    assert reader.from_memory


def test_wait_wakes_on_a_queued_item_and_times_out_otherwise(store: Store) -> None:
    node = Node(store)
    reader = StreamReader(node.manager, store, name="s", start_seqno=0)

    async def scenario() -> tuple[bool, bool, bool]:
        idle = await reader.wait(0.01)
        waiting = asyncio.ensure_future(reader.wait(5.0))
        await asyncio.sleep(0)
        node.write(1)
        woken = await waiting
        return idle, woken, reader.has_next

    assert asyncio.run(scenario()) == (False, True, True)
    assert reader.next() is not CAUGHT_UP


def test_close_unregisters_and_frees_what_only_it_held(store: Store) -> None:
    node = Node(store)
    node.write(100, flush_every=10)
    node.write(5)
    reader = StreamReader(node.manager, store, name="s", start_seqno=0)
    assert reader.next() is not CAUGHT_UP  # backfill under way
    reader.close()
    reader.close()
    assert node.manager.cursor("s") is None
    assert not reader.has_next
    node.manager._check_invariants()


def test_start_at_high_seqno_reads_only_new_items(store: Store) -> None:
    node = Node(store)
    node.write(40, flush_every=10)
    reader = StreamReader(node.manager, store, name="s", start_seqno=40)
    assert reader.next() is CAUGHT_UP
    node.write(3)
    check = node.check(reader, 40)
    found = drain(reader, check)
    assert found == [(41, 41, MEMORY_CHECKPOINT), (42, 43, MEMORY_CHECKPOINT)]
    assert check.view == node.model.latest()


@pytest.mark.parametrize("run", [1, 2, 7, 64])
def test_read_hands_out_runs_equal_to_next_one_by_one(store: Store, run: int) -> None:
    """A run from `read` is exactly what `next` would have returned, across memory recovery
    and the disk backfill that follows it."""
    node = Node(store, quota_items=60)
    single = StreamReader(node.manager, store, name="single", start_seqno=0)
    runs = StreamReader(node.manager, store, name="runs", start_seqno=0)
    node.write(400, flush_every=25)  # the quota drops both cursors: both go through disk
    one_by_one = list(single)
    by_runs = []
    while batch := runs.read(run):  # bounded: each round reads >= 1 event or stops
        assert len(batch) <= run
        by_runs.extend(batch)
    assert by_runs == one_by_one
    assert runs.next() is CAUGHT_UP
    assert runs.stats["backfills"] >= 1
    single.close()
    runs.close()


def flatten(runs: list[Run]) -> list[Event]:
    """Runs as the events `next` hands out: stored records decoded into items."""
    events: list[Event] = []
    for run in runs:
        if isinstance(run, StoredRun):
            events += [Item.from_record(decode_record(0, stored_seqno(d), d)) for d in run.records]
        elif isinstance(run, list):
            events += run
        else:
            events.append(run)
    return events


@pytest.mark.parametrize(("run", "bytes_max"), [(1, 1 << 20), (7, 1 << 20), (64, 1), (64, 600)])
def test_read_runs_hand_out_what_next_does(store: Store, run: int, bytes_max: int) -> None:
    """Runs from `read_runs` are what `next` would have returned one by one, across memory
    recovery and the disk backfill that follows it; each run lies inside one snapshot."""
    node = Node(store, quota_items=60)
    single = StreamReader(node.manager, store, name="single", start_seqno=0)
    runs_reader = StreamReader(node.manager, store, name="runs", start_seqno=0)
    node.write(400, flush_every=25)  # the quota drops both cursors: both go through disk
    one_by_one = list(single)
    runs: list[Run] = []
    snapshot = None
    while batch := runs_reader.read_runs(run, bytes_max):  # bounded: >= 1 event or stops
        assert sum(1 if isinstance(r, SnapshotStart) else len(r) for r in batch) <= run
        for one in batch:
            if isinstance(one, SnapshotStart):
                snapshot = one
                continue
            assert snapshot is not None
            first = one.first_seqno if isinstance(one, StoredRun) else one[0].seqno
            last = one.last_seqno if isinstance(one, StoredRun) else one[-1].seqno
            assert snapshot.snap_start <= first <= last <= snapshot.snap_end, (snapshot, one)
            assert isinstance(one, StoredRun) == snapshot.from_disk
        runs += batch
    assert flatten(runs) == one_by_one
    assert runs_reader.next() is CAUGHT_UP
    assert runs_reader.stats["backfills"] >= 1
    assert runs_reader.last_seqno == single.last_seqno == node.model.high_seqno
    single.close()
    runs_reader.close()
