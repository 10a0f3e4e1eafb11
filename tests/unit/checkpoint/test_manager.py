"""``CheckpointManager``: the seed's figures 1-5 as examples, then registration, removal,
collapse, lookups and lifecycle. Figure 6 (disk backfill) is in test_reader.py; memory recovery
in test_memory.py; random interleavings against a model in test_model.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import (
    CAUGHT_UP,
    DROPPED,
    CheckpointManager,
    CursorKind,
    Item,
    MemoryBudget,
    SnapshotStart,
    item_size_bytes,
)
from changefeed.checkpoint.item import CHECKPOINT_START, DUMMY
from changefeed.checkpoint.snapshot import CursorSignal
from changefeed.storage import Op

from .helpers import MEMORY, MEMORY_CHECKPOINT, VB, item, markers, queue_all, seqnos


def figure_1() -> CheckpointManager:
    """Two cursors registered before any write; keys a b c a b d queued (seqnos 1-6)."""
    manager = CheckpointManager(0)
    manager.register_cursor("replication", 0, kind=CursorKind.REPLICA)
    queue_all(manager, [item(s, k) for s, k in enumerate("abcabd", start=1)])
    return manager


def test_figure_1_dummy_and_start_items_unique_keys_and_cursors() -> None:
    manager = figure_1()
    first, second = manager.checkpoints()
    # Both cursors waited in the empty open checkpoint: item 1 entered it (figure 3), item 2
    # found cursors inside and went into a new open checkpoint, where dedup works.
    assert first.items == [DUMMY, CHECKPOINT_START, item(1, "a")]
    assert second.items[:2] == [DUMMY, CHECKPOINT_START]
    assert [(one.seqno, one.key) for one in second.live_items()] == [
        (3, b"c"),
        (4, b"a"),
        (5, b"b"),
        (6, b"d"),
    ]
    assert second.is_open
    assert not first.is_open
    assert (second.snap_start, second.snap_end) == (2, 6)  # deduplicated seqno 2 stays covered
    replication_cursor = manager.cursor("replication")
    assert replication_cursor is not None
    events = list(manager.iter_events(replication_cursor))
    assert markers(events) == [(1, 1, MEMORY_CHECKPOINT), (2, 6, MEMORY_CHECKPOINT)]
    assert seqnos(events) == [1, 3, 4, 5, 6]  # never a dummy or meta item
    assert all(isinstance(event, Item | SnapshotStart) for event in events)


def test_figure_2_cursors_move_on_and_the_passed_checkpoint_is_freed() -> None:
    manager = figure_1()
    persistence = manager.persistence_cursor
    replication = manager.cursor("replication")
    assert persistence is not None
    assert replication is not None
    assert seqnos(manager.iter_events(persistence)) == [
        1,
        3,
        4,
        5,
        6,
    ]  # now inside the open checkpoint
    assert manager.read(replication, 2) == [SnapshotStart(1, 1, MEMORY_CHECKPOINT), item(1, "a")]
    assert len(manager.checkpoints()) == 2
    assert manager.read(replication, 1) == [
        SnapshotStart(2, 6, MEMORY_CHECKPOINT)
    ]  # leaves checkpoint 1
    manager._check_invariants()
    assert [c.snap_start for c in manager.checkpoints()] == [2]  # nobody needs checkpoint 1
    # A cursor has entered the open checkpoint: the next item closes it and opens a new one.
    manager.queue(item(7, "e"))
    manager._check_invariants()
    closed, fresh = manager.checkpoints()
    assert not closed.is_open
    assert (closed.snap_start, closed.snap_end) == (2, 6)  # what the readers saw stays final
    assert fresh.items == [DUMMY, CHECKPOINT_START, item(7, "e")]
    assert persistence.checkpoint is fresh  # it had read everything, so it moved with the close
    assert seqnos(manager.iter_events(replication)) == [3, 4, 5, 6, 7]


def test_figure_2_new_open_checkpoint_has_no_start_item_until_an_item_arrives() -> None:
    manager = figure_1()
    assert manager.persistence_cursor is not None
    list(manager.iter_events(manager.persistence_cursor))
    manager.close_open_checkpoint()  # what memory recovery does first
    manager._check_invariants()
    assert manager.open_checkpoint.items == [DUMMY]
    assert manager.persistence_cursor.checkpoint is manager.open_checkpoint


def test_figure_3_a_cursor_at_the_end_waits_and_is_woken_by_the_next_item() -> None:
    manager = CheckpointManager(0)
    persistence = manager.persistence_cursor
    assert persistence is not None
    wakeups: list[int] = []
    manager.wakeup.add_callback(lambda: wakeups.append(manager.high_seqno))
    queue_all(manager, [item(1, "a"), item(2, "b")])
    assert seqnos(manager.iter_events(persistence)) == [1, 2]
    assert manager.next_event(persistence) is CAUGHT_UP
    assert not manager.has_next(persistence)
    manager.queue(item(3, "c"))
    assert wakeups == [1, 2, 3]
    assert manager.has_next(persistence)
    assert manager.read(persistence, 10) == [SnapshotStart(3, 3, MEMORY_CHECKPOINT), item(3, "c")]
    manager.queue(item(4, "a"))  # the cursor is inside: a new open checkpoint takes it
    manager._check_invariants()
    assert [(c.snap_start, c.snap_end, c.is_open) for c in manager.checkpoints()] == [(4, 4, True)]


def test_figures_4_and_5_cursorless_closed_checkpoints_between_others_are_collapsed() -> None:
    manager = CheckpointManager(0)
    replication = manager.register_cursor("replication", 0, kind=CursorKind.REPLICA).cursor
    persistence = manager.persistence_cursor
    assert persistence is not None
    queue_all(manager, [item(1, "a"), item(2, "b"), item(3, "c")])  # [1,1] (figure 3), [2,3]
    assert manager.read(replication, 1) == [
        SnapshotStart(1, 1, MEMORY_CHECKPOINT)
    ]  # then it stalls
    manager.close_open_checkpoint()
    assert seqnos(manager.read(persistence, 3)) == [1]  # marker, 1, marker: now inside [2,3]
    queue_all(manager, [item(4, "b"), item(5, "d")])
    manager.close_open_checkpoint()
    queue_all(manager, [item(6, "e")])
    ranges = [(c.snap_start, c.snap_end, c.cursor_count) for c in manager.checkpoints()]
    assert ranges == [(1, 1, 1), (2, 3, 1), (4, 5, 0), (6, 6, 0)]
    # Persistence persists everything (figure 4): on leaving [4,5], both [2,3] and [4,5] are
    # closed, cursorless and between other checkpoints, so they are collapsed (figure 5).
    assert seqnos(manager.iter_events(persistence)) == [2, 3, 4, 5, 6]
    manager._check_invariants()
    assert manager.stats["checkpoints_collapsed"] == 1
    ranges = [(c.snap_start, c.snap_end, c.cursor_count) for c in manager.checkpoints()]
    assert ranges == [(1, 1, 1), (2, 5, 0), (6, 6, 1)]
    merged = manager.checkpoints()[1]
    assert [(one.seqno, one.key) for one in merged.live_items()] == [
        (3, b"c"),
        (4, b"b"),  # b@2 was deduplicated across the two checkpoints
        (5, b"d"),
    ]
    events = list(manager.iter_events(replication))
    assert markers(events) == [(2, 5, MEMORY_CHECKPOINT), (6, 6, MEMORY_CHECKPOINT)]
    assert seqnos(events) == [1, 3, 4, 5, 6]


def test_collapse_never_touches_a_checkpoint_with_a_cursor_or_the_open_one() -> None:
    manager = CheckpointManager(0, persistence=False)
    slow = manager.register_cursor("slow", 0).cursor
    middle = manager.register_cursor("middle", 0).cursor
    queue_all(manager, [item(1, "a")])
    list(manager.iter_events(middle))
    queue_all(manager, [item(2, "a")])
    list(manager.iter_events(middle))
    queue_all(manager, [item(3, "a")])
    manager.collapse()
    manager._check_invariants()
    # [2,2] is closed and cursorless, but alone between a cursor's checkpoint and the open one.
    counts = [(c.snap_start, c.cursor_count, c.is_open) for c in manager.checkpoints()]
    assert counts == [(1, 1, False), (2, 0, False), (3, 1, True)]
    assert seqnos(manager.iter_events(slow)) == [1, 2, 3]


def test_register_mid_checkpoint_announces_only_what_follows() -> None:
    manager = CheckpointManager(0, persistence=False)
    keeper = manager.register_cursor("keeper", 0).cursor
    queue_all(manager, [item(s, f"k{s}") for s in range(1, 8)])
    registration = manager.register_cursor("late", 4)
    assert not registration.needs_backfill
    events = list(manager.iter_events(registration.cursor))
    assert markers(events) == [(5, 7, MEMORY)]  # no Checkpoint flag: not a checkpoint start
    assert seqnos(events) == [5, 6, 7]
    assert seqnos(manager.iter_events(keeper)) == [1, 2, 3, 4, 5, 6, 7]


def test_register_at_a_checkpoint_boundary_gets_the_whole_checkpoint() -> None:
    manager = CheckpointManager(0, persistence=False)
    manager.register_cursor("keeper", 0)
    queue_all(manager, [item(s, f"k{s}") for s in range(1, 5)])  # [1,1] and [2,4]
    events = list(manager.iter_events(manager.register_cursor("late", 1).cursor))
    assert markers(events) == [(2, 4, MEMORY_CHECKPOINT)]
    assert seqnos(events) == [2, 3, 4]


def test_register_at_high_seqno_waits_in_a_fresh_open_checkpoint() -> None:
    manager = CheckpointManager(0, persistence=False)
    manager.register_cursor("keeper", 0)
    queue_all(manager, [item(s, f"k{s}") for s in range(1, 5)])
    cursor = manager.register_cursor("late", 4).cursor
    manager._check_invariants()
    assert manager.next_event(cursor) is CAUGHT_UP
    assert cursor.checkpoint is manager.open_checkpoint
    assert not manager.open_checkpoint.has_items


def test_register_below_memory_asks_for_a_backfill_and_pins_the_oldest_checkpoint() -> None:
    manager = CheckpointManager(0, high_seqno=10, persistence=False)
    manager.register_cursor("keeper", 10)
    queue_all(manager, [item(s, f"k{s}") for s in range(11, 15)])
    registration = manager.register_cursor("reader", 3)
    manager._check_invariants()
    assert registration.needs_backfill
    assert (registration.backfill_start, registration.backfill_end) == (4, 10)
    assert registration.cursor.checkpoint is manager.checkpoints()[0]
    assert registration.cursor.index == 0
    assert seqnos(manager.iter_events(registration.cursor)) == [
        11,
        12,
        13,
        14,
    ]  # after the caller's backfill


def test_register_with_a_taken_name_replaces_the_old_cursor() -> None:
    manager = CheckpointManager(0, persistence=False)
    old = manager.register_cursor("stream", 0).cursor
    queue_all(manager, [item(1, "a"), item(2, "b")])
    new = manager.register_cursor("stream", 1).cursor
    manager._check_invariants()
    assert manager.next_event(old) is DROPPED
    assert not old.attached
    assert manager.cursor("stream") is new
    assert seqnos(manager.iter_events(new)) == [2]


def test_removing_the_last_cursor_frees_every_closed_checkpoint() -> None:
    manager = CheckpointManager(0, persistence=False)
    cursor = manager.register_cursor("stream", 0).cursor
    queue_all(manager, [item(s, f"k{s}") for s in range(1, 6)])
    assert len(manager.checkpoints()) == 2
    manager.remove_cursor(cursor)
    manager._check_invariants()
    assert len(manager.checkpoints()) == 1
    assert manager.first_memory_seqno == 2  # the open checkpoint [2,5] remains


def test_seqnos_must_increase() -> None:
    manager = CheckpointManager(0, high_seqno=5)
    with pytest.raises(AssertionError):
        manager.queue(item(5, "a"))
    manager.queue(item(9, "a"))  # gaps are allowed (a replica's deduplicated stream)
    with pytest.raises(AssertionError):
        manager.queue(item(8, "b"))


def test_open_checkpoint_closes_at_its_size_limit() -> None:
    one = item_size_bytes(item(1, "k1"))
    manager = CheckpointManager(0, persistence=False, checkpoint_max_bytes=3 * one)
    manager.register_cursor("keeper", 0)
    queue_all(manager, [item(s, f"k{s}") for s in range(1, 6)])
    assert [c.live_count for c in manager.checkpoints()] == [1, 3, 1]  # [1] by figure 3
    queue_all(manager, [item(s, f"k{s}") for s in range(6, 11)])
    # Full checkpoints [2,4] and [5,7] were then collapsed: cursorless, between others.
    assert [c.live_count for c in manager.checkpoints()] == [1, 6, 3]


def test_find_returns_the_newest_version_in_memory() -> None:
    manager = CheckpointManager(0, persistence=False)
    manager.register_cursor("keeper", 0)
    queue_all(manager, [item(1, "a", b"1"), item(2, "b"), item(3, "a", b"3")])
    found = manager.find(b"a")
    assert found is not None
    assert found.value == b"3"
    assert manager.find(b"zzz") is None
    manager.queue(item(4, "a", b"", op=Op.DELETION))
    deleted = manager.find(b"a")
    assert deleted is not None
    assert deleted.deleted


def test_clone_and_move_cursor_restore_a_position() -> None:
    manager = CheckpointManager(0)
    persistence = manager.persistence_cursor
    assert persistence is not None
    queue_all(manager, [item(s, f"k{s}") for s in range(1, 6)])
    backup = manager.clone_cursor(persistence, "backup")
    assert not backup.droppable
    assert seqnos(manager.iter_events(persistence)) == [1, 2, 3, 4, 5]
    manager.move_cursor(persistence, backup)
    manager.remove_cursor(backup)
    manager._check_invariants()
    assert seqnos(manager.iter_events(persistence)) == [1, 2, 3, 4, 5]


def test_close_releases_all_memory_from_the_budget() -> None:
    budget = MemoryBudget(10**9)
    manager = CheckpointManager(0, budget=budget)
    queue_all(manager, [item(s, f"k{s}", b"x" * 50) for s in range(1, 20)])
    assert budget.used_bytes == manager.memory_bytes > 0
    manager.close()
    assert budget.used_bytes == 0
    assert manager.memory_bytes == 0


def test_manager_read_iter_events_and_has_next_agree() -> None:
    manager = CheckpointManager(0, persistence=False)
    cursor = manager.register_cursor("stream", 0).cursor
    assert not manager.has_next(cursor)
    queue_all(manager, [item(s, f"k{s}") for s in range(1, 6)])
    assert manager.has_next(cursor)
    first = manager.read(cursor, 3)
    assert len(first) == 3
    rest = list(manager.iter_events(cursor))
    assert seqnos(first + rest) == [1, 2, 3, 4, 5]
    assert not manager.has_next(cursor)
    assert manager.read(cursor, 5) == []


@settings(max_examples=100, deadline=None)
@given(
    writes=st.lists(st.sampled_from([b"a", b"b", b"c", b"d", b"e"]), max_size=40),
    reads=st.lists(st.integers(0, 6), max_size=40),
    asked=st.lists(st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"new"]), max_size=8),
)
def test_find_many_finds_what_find_finds(
    writes: list[bytes], reads: list[int], asked: list[bytes]
) -> None:
    """Keys spread over several checkpoints (a cursor inside the open one closes it at the next
    write), deduplicated within one: `find_many` answers each key as `find` does."""
    manager = CheckpointManager(VB, checkpoint_max_bytes=400)
    reader = manager.register_cursor("reader", 0).cursor
    for seqno, (key, read) in enumerate(zip(writes, reads + [0] * len(writes), strict=False), 1):
        manager.queue(Item(seqno, key, Op.MUTATION, b"v%d" % seqno, seqno))
        for _ in range(read):  # the reader moves on, sometimes into the open checkpoint
            if isinstance(manager.next_run(reader, 2), CursorSignal):
                break
    assert manager.find_many(asked) == [manager.find(key) for key in asked]
