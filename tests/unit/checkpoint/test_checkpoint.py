"""``Checkpoint``: dedup by holes, stable positions, binary search with holes, collapse, compact."""

from __future__ import annotations

import random

import pytest

from changefeed.checkpoint.checkpoint import Checkpoint
from changefeed.checkpoint.item import CHECKPOINT_START, DUMMY, Item
from changefeed.checkpoint.memory import item_size_bytes

from .helpers import item


def add(checkpoint: Checkpoint, one: Item) -> int:
    delta = checkpoint.add(one, item_size_bytes(one))
    checkpoint.check_invariants()
    return delta


def read_from(checkpoint: Checkpoint, index: int) -> list[int]:
    """Seqnos a cursor at `index` (last consumed) would read next from `checkpoint`."""
    return [slot.seqno for slot in checkpoint.items[index + 1 :] if isinstance(slot, Item)]


def test_new_checkpoint_holds_only_the_dummy() -> None:
    checkpoint = Checkpoint(1, snap_start=5, created_s=0.0)
    checkpoint.check_invariants()
    assert checkpoint.items == [DUMMY]
    assert not checkpoint.has_items
    assert (checkpoint.snap_start, checkpoint.snap_end) == (5, 4)


def test_first_item_adds_the_start_item_and_fixes_the_range() -> None:
    checkpoint = Checkpoint(1, snap_start=5, created_s=0.0)
    add(checkpoint, item(5, "a"))
    add(checkpoint, item(6, "b"))
    assert checkpoint.items[:2] == [DUMMY, CHECKPOINT_START]
    assert (checkpoint.snap_start, checkpoint.snap_end) == (5, 6)
    assert checkpoint.first_seqno == 5


def test_dedup_replaces_the_older_item_and_keeps_the_range() -> None:
    checkpoint = Checkpoint(1, snap_start=1, created_s=0.0)
    add(checkpoint, item(1, "a", b"x" * 10))
    add(checkpoint, item(2, "b"))
    delta = add(checkpoint, item(3, "a", b"y"))
    assert delta == item_size_bytes(item(3, "a", b"y")) - item_size_bytes(item(1, "a", b"x" * 10))
    assert [one.seqno for one in checkpoint.live_items()] == [2, 3]
    assert (checkpoint.snap_start, checkpoint.snap_end) == (1, 3)  # 1 stays in the range
    assert checkpoint.live_count == 2
    assert checkpoint.hole_count == 1


@pytest.mark.parametrize(
    ("position", "expected_next"),
    [
        (2, [3, 4]),  # on "a" (seqno 1), before the replaced item
        (3, [3, 4]),  # on the replaced item itself ("b", seqno 2): it becomes a hole
        (4, [4]),  # on "c" (seqno 3), after it
    ],
)
def test_cursor_on_or_around_the_replaced_item_neither_rereads_nor_skips(
    position: int, expected_next: list[int]
) -> None:
    """Positions are indexes and dedup leaves a hole, so a position stays valid through dedup:
    the reader gets the new version once and nothing it already read."""
    checkpoint = Checkpoint(1, snap_start=1, created_s=0.0)
    for seqno, key in [(1, "a"), (2, "b"), (3, "c")]:
        add(checkpoint, item(seqno, key))
    checkpoint.cursor_count = 1  # a cursor holds `position`: no compaction may move slots
    add(checkpoint, item(4, "b"))  # replaces seqno 2
    assert checkpoint.items[3] is None
    assert read_from(checkpoint, position) == expected_next


def test_holes_are_kept_while_a_cursor_is_inside_and_squeezed_out_after() -> None:
    checkpoint = Checkpoint(1, snap_start=1, created_s=0.0)
    checkpoint.cursor_count = 1
    for seqno in range(1, 101):
        add(checkpoint, item(seqno, f"k{seqno % 2}"))
    assert checkpoint.hole_count == 98
    checkpoint.cursor_count = 0
    checkpoint.compact()
    checkpoint.check_invariants()
    assert checkpoint.hole_count == 0
    assert len(checkpoint.items) == 4
    assert [one.seqno for one in checkpoint.live_items()] == [99, 100]


def test_position_after_finds_the_boundary_despite_holes() -> None:
    rng = random.Random(7)
    print("seed 7")
    checkpoint = Checkpoint(1, snap_start=1, created_s=0.0)
    checkpoint.cursor_count = 1  # keep holes
    for seqno in range(1, 400):
        add(checkpoint, item(seqno, f"k{rng.randrange(60)}"))
    live = [one.seqno for one in checkpoint.live_items()]
    for seqno in range(0, 401):
        index = checkpoint.position_after(seqno)
        assert read_from(checkpoint, index) == [s for s in live if s > seqno], seqno
        assert index >= 1


def test_absorb_collapses_with_dedup_and_merges_ranges() -> None:
    older = Checkpoint(1, snap_start=1, created_s=0.0)
    newer = Checkpoint(2, snap_start=4, created_s=0.0)
    for seqno, key in [(1, "a"), (2, "b"), (3, "c")]:
        add(older, item(seqno, key))
    for seqno, key in [(4, "b"), (5, "d"), (6, "a")]:
        add(newer, item(seqno, key))
    older.close()
    newer.close()
    older.next = newer
    memory_before = older.memory_bytes + newer.memory_bytes
    freed = older.absorb(newer)
    older.check_invariants()
    assert [(one.seqno, one.key) for one in older.live_items()] == [
        (3, b"c"),
        (4, b"b"),
        (5, b"d"),
        (6, b"a"),
    ]
    assert (older.snap_start, older.snap_end) == (1, 6)
    assert freed == item_size_bytes(item(1, "a")) + item_size_bytes(item(2, "b"))
    assert older.memory_bytes == memory_before - freed
    assert newer.items == [DUMMY]
    assert newer.memory_bytes == 0


def test_closing_requires_items_and_closed_checkpoints_refuse_items() -> None:
    checkpoint = Checkpoint(1, snap_start=1, created_s=0.0)
    with pytest.raises(AssertionError):
        checkpoint.close()
    add(checkpoint, item(1, "a"))
    checkpoint.close()
    with pytest.raises(AssertionError):
        checkpoint.add(item(2, "b"), 10)


def test_seqnos_must_increase() -> None:
    checkpoint = Checkpoint(1, snap_start=1, created_s=0.0)
    add(checkpoint, item(3, "a"))
    with pytest.raises(AssertionError):
        checkpoint.add(item(3, "b"), 10)
