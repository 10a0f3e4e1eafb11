"""Mutation manager benchmark: queue throughput with readers, memory per item, disk catch-up.

Rows:

* items/s queued while 0, 1, 2 and 8 cursors read: items are queued in rounds of 100 and every
  cursor drains after each round (so checkpoints close and collapse as in a live node); the
  time covers queueing and all reading. Keys are unique (no dedup), values 100 bytes.
* bytes of memory per queued item with a 10-byte key and a 100-byte value, measured with
  tracemalloc (items built as the network delivers them: distinct value objects, 64-bit CAS),
  next to the manager's own accounting (key + value + ITEM_OVERHEAD_BYTES).
* a dropped reader's catch-up: a StreamReader reads a few items and stalls while N items with
  unique keys are queued and flushed to LMDB (durable=False) under a checkpoint quota of
  min(64 MiB, N x 64 B);
  memory recovery drops it. Timed: from its next call until it reads from memory again (disk
  backfill of nearly all N items, then re-registration). Twice: item by item (``next``: each
  record decoded into an ``Item`` through the capped backfill queue) and in runs as a stream
  reads (``read_runs``: runs of stored bodies, not decoded).

Usage::

    .venv/bin/python bench/bench_checkpoint.py            # 1,000,000 items
    .venv/bin/python bench/bench_checkpoint.py --quick    # 50,000 items, for a smoke run

Each throughput row runs ``--repeat`` times and the best is reported, with the cyclic GC off
while timing. Every run checks what it read, so a fast wrong path cannot win.
"""

from __future__ import annotations

import argparse
import gc
import platform
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

from changefeed import limits
from changefeed.checkpoint import (
    CAUGHT_UP,
    ITEM_OVERHEAD_BYTES,
    CheckpointManager,
    Flusher,
    Item,
    MemoryBudget,
    SnapshotStart,
    StreamReader,
)
from changefeed.storage import Op, Store

VALUE_BYTES = 100
ROUND_ITEMS = 100
FLUSH_EVERY = 1000  # items queued between flushes in the catch-up row
BIG_QUOTA_BYTES = 1 << 40  # throughput rows measure queueing, not recovery
CATCH_UP_QUOTA_BYTES_MAX = 64 * 1024 * 1024
RUN_BYTES = limits.STREAM_QUANTUM_BYTES  # the byte budget of one stream's turn


def make_items(count: int, first: int = 1) -> list[Item]:
    """Items with unique 10-byte keys, distinct 100-byte values and 64-bit CAS values."""
    return [
        Item(seqno, b"key%07d" % seqno, Op.MUTATION, b"%0100d" % seqno, cas=(1 << 62) + seqno)
        for seqno in range(first, first + count)
    ]


def queue_with_readers(items: list[Item], readers: int) -> float:
    """Seconds to queue `items` in rounds while `readers` cursors drain after each round."""
    manager = CheckpointManager(0, persistence=False, budget=MemoryBudget(BIG_QUOTA_BYTES))
    cursors = [manager.register_cursor(f"reader{n}", 0).cursor for n in range(readers)]
    read = [0] * readers
    queue = manager.queue
    gc.disable()
    started = time.perf_counter()
    for start in range(0, len(items), ROUND_ITEMS):
        for item in items[start : start + ROUND_ITEMS]:
            queue(item)
        for index, cursor in enumerate(cursors):
            for event in manager.iter_events(cursor):
                if type(event) is Item:
                    read[index] += 1
    elapsed = time.perf_counter() - started
    gc.enable()
    assert read == [len(items)] * readers, read
    manager.close()
    return elapsed


def bytes_per_item(count: int) -> tuple[float, float]:
    """(measured, accounted) bytes per queued item."""
    manager = CheckpointManager(0, persistence=False, budget=MemoryBudget(BIG_QUOTA_BYTES))
    manager.register_cursor("keeper", 0)  # keeps every item in memory
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        items = make_items(count)
        for item in items:
            manager.queue(item)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    own_list_bytes = 8 * len(items)  # the bench's list of the items, not the manager's
    measured = (after - before - own_list_bytes) / count
    accounted = manager.memory_bytes / count
    manager.close()
    return measured, accounted


def dropped_reader_catch_up(
    count: int, directory: Path, *, in_runs: bool
) -> tuple[float, int, dict[str, int]]:
    """(seconds, items read from disk, reader stats) for a dropped reader's catch-up, reading
    item by item (`next`) or in runs (`read_runs`)."""
    store = Store(directory, map_size_bytes=4 * 1024**3, durable=False)
    with store.write_batch() as batch:
        batch.set_vbucket_meta(0, state="active")
    # A quota well below what `count` items take, so that the stalled reader is dropped.
    quota_bytes = min(CATCH_UP_QUOTA_BYTES_MAX, max(4 * 1024 * 1024, count * 64))
    manager = CheckpointManager(0, budget=MemoryBudget(quota_bytes))
    flusher = Flusher(manager, store)
    reader = StreamReader(manager, store, name="slow", start_seqno=0)
    for start in range(1, count + 1, FLUSH_EVERY):
        for item in make_items(min(FLUSH_EVERY, count + 1 - start), start):
            manager.queue(item)
        if start == 1:
            assert reader.next() is not CAUGHT_UP  # reads its first marker, then stalls
        if start + FLUSH_EVERY <= count:  # the last round stays in memory only
            flusher.flush()
    assert manager.stats["cursors_dropped"] == 1, manager.stats
    assert not reader.from_memory
    gc.disable()
    started = time.perf_counter()
    seen = 0
    while not reader.from_memory:  # bounded by the items stored
        if in_runs:
            runs = reader.read_runs(limits.STREAM_RUN_EVENTS_MAX, RUN_BYTES)
            assert runs  # the last round is in memory: reached before the end
            seen += sum(len(run) for run in runs if not isinstance(run, SnapshotStart))
            continue
        event = reader.next()
        assert event is not CAUGHT_UP  # the last round is in memory: reached before the end
        seen += type(event) is Item
    elapsed = time.perf_counter() - started
    gc.enable()
    stats = dict(reader.stats)
    remaining = sum(1 for event in reader if type(event) is Item)
    assert seen + remaining == count, (seen, remaining, count)
    reader.close()
    manager.close()
    store.close()
    return elapsed, stats["backfill_items"], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50,000 items")
    parser.add_argument("--items", type=int, default=None, help="items per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per throughput row")
    args = parser.parse_args()
    count = args.items or (50_000 if args.quick else 1_000_000)
    print(f"# bench_checkpoint: {count:,} items, {VALUE_BYTES}-byte values, unique keys")
    print(f"# {platform.python_implementation()} {platform.python_version()}, {platform.machine()}")
    print()
    print(f"{'row':<52} {'value':>14}")
    print("-" * 67)
    items = make_items(count)
    for readers in (0, 1, 2, 8):
        best = min(queue_with_readers(items, readers) for _ in range(args.repeat))
        label = f"queue, {readers} cursor{'s' if readers != 1 else ''} reading (items/s)"
        print(f"{label:<52} {count / best:>14,.0f}")
    del items
    gc.collect()
    measured, accounted = bytes_per_item(min(count, 200_000))
    print(f"{'memory per 100-byte item, tracemalloc (bytes)':<52} {measured:>14,.0f}")
    print(f"{'memory per 100-byte item, accounted (bytes)':<52} {accounted:>14,.0f}")
    print(f"{'  of which ITEM_OVERHEAD_BYTES':<52} {ITEM_OVERHEAD_BYTES:>14,}")
    for in_runs in (False, True):
        directory = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
        try:
            elapsed, from_disk, stats = dropped_reader_catch_up(count, directory, in_runs=in_runs)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        how = "in runs" if in_runs else "item by item"
        print(f"{f'dropped reader, {how}: backfill + return (s)':<52} {elapsed:>14.2f}")
        print(f"{'  items read from disk':<52} {from_disk:>14,}")
        print(f"{'  disk items/s':<52} {from_disk / elapsed:>14,.0f}")
        counts = f"{stats['backfills']}, {stats['registrations']}"
        print(f"{'  backfills, registrations':<52} {counts:>14}")


if __name__ == "__main__":
    main()
