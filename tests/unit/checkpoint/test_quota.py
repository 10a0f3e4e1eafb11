"""(e) Memory stays within the quota with one stalled droppable reader while many items are
queued (100k by default, 1M with -m slow); the reader is dropped, catches up from disk, returns
to memory, and ends with the latest state of every key."""

from __future__ import annotations

from pathlib import Path

import pytest

from changefeed.checkpoint import (
    CAUGHT_UP,
    CheckpointManager,
    Flusher,
    Item,
    MemoryBudget,
    StreamReader,
)
from changefeed.storage import Op

from .helpers import VB, ReaderCheck, open_store

QUOTA_BYTES = 8 * 1024 * 1024
FLUSH_EVERY = 1000


def run_stalled_reader(tmp_path: Path, count: int) -> None:
    store = open_store(tmp_path)
    budget = MemoryBudget(QUOTA_BYTES)
    manager = CheckpointManager(VB, budget=budget, checkpoint_max_bytes=QUOTA_BYTES // 16)
    flusher = Flusher(manager, store)
    reader = StreamReader(manager, store, name="stalled", start_seqno=0)
    check = ReaderCheck(0, {})
    latest: dict[bytes, tuple[Op, bytes]] = {}
    used_max = 0
    for seqno in range(1, count + 1):
        key = b"key%07d" % (seqno % (count // 2))  # every key written twice: dedup has work
        value = b"%0100d" % seqno
        manager.queue(Item(seqno, key, Op.MUTATION, value, cas=(1 << 48) + seqno))
        latest[key] = (Op.MUTATION, value)
        used_max = max(used_max, budget.used_bytes)
        if seqno == 10:
            for _ in range(5):  # the reader reads a little, then stalls
                event = reader.next()
                assert event is not CAUGHT_UP
                check.see(event)
        if seqno % FLUSH_EVERY == 0:
            flusher.flush()
    manager._check_invariants()
    assert used_max <= budget.quota_bytes, (used_max, budget.quota_bytes)
    assert budget.recoveries > 0
    assert manager.stats["cursors_dropped"] == 1
    assert budget.used_bytes <= budget.upper_mark_bytes
    assert manager.persistence_cursor is not None
    for event in reader:  # catch up: disk, then memory
        check.see(event)
    assert reader.from_memory
    assert reader.stats["drops"] == 1
    assert check.position == count
    assert check.view == latest
    flusher.flush()
    assert store.item_count(VB) == len(latest)
    reader.close()
    store.close()


def test_memory_stays_within_quota_with_a_stalled_reader_100k(tmp_path: Path) -> None:
    run_stalled_reader(tmp_path, 100_000)


@pytest.mark.slow
def test_memory_stays_within_quota_with_a_stalled_reader_1m(tmp_path: Path) -> None:
    run_stalled_reader(tmp_path, 1_000_000)
