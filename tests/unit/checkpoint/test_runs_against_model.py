"""`Checkpoint.add_run` and `CheckpointManager.next_run` against plain per-item models.

The models are the per-item rules written out: `add_run` adds each item in turn (a repeated
key leaves a hole where it was, and the flusher is told) until the checkpoint holds
`full_bytes`; a byte-bounded `next_run` (the flusher's) takes the items after the cursor,
skipping holes, until `items_max` slots or `bytes_max` charged bytes. The runs mix new and
repeated keys, runs of only new keys (a replica catching up), mutations and tombstones, plain
and committed items, and byte bounds from below one item to past the whole run, with bounds
exactly at, one under and one over an item's edge. Any run-at-once form of either (issue 29
item 2: a replica's run applied as columns) must keep these answers.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import CheckpointManager, Item, MemoryBudget, SyncItem, item_size_bytes
from changefeed.checkpoint.checkpoint import Checkpoint, Slot
from changefeed.checkpoint.cursor import CursorKind
from changefeed.checkpoint.manager import ItemRun
from changefeed.storage import Op

ONE = item_size_bytes(Item(1, b"k", Op.MUTATION, b"v" * 20, 1))
TOMBSTONES = (Op.DELETION, Op.EXPIRATION)

# (key number, tombstone op or None, value length) per item
changes = st.lists(
    st.tuples(st.integers(0, 40), st.sampled_from((None, None, None, *TOMBSTONES)),
              st.integers(0, 60)),
    min_size=1,
    max_size=60,
)  # fmt: skip


def build(
    first_seqno: int, spec: list[tuple[int, Op | None, int]], commits: bool, fresh: bool = False
) -> list[Item]:
    """Items with rising seqnos from `spec`; with `commits`, each commits a prepare; with
    `fresh`, every key is new (named by its seqno): runs of new keys, the fast paths'."""
    items: list[Item] = []
    for seqno, (key_no, tombstone, size) in enumerate(spec, first_seqno):
        key = b"new-%d" % seqno if fresh else b"key-%d" % key_no
        value = b"" if tombstone else bytes([65 + key_no % 26]) * size
        if not commits:
            op = tombstone or Op.MUTATION
            items.append(Item(seqno, key, op, value, 500 + seqno, 3, 7, 1, 2, seqno))
            continue
        doc_op = Op.DELETION if tombstone else Op.MUTATION
        prepare = SyncItem(seqno, key, Op.PREPARE, doc_op, value, 500 + seqno, level=1)
        items.append(prepare.committed(seqno))  # a commit may take its prepare's seqno here
    return items


def model_add_run(
    slots: list[Slot],
    index: dict[bytes, int],
    memory: int,
    items: list[Item],
    full: int,
    replaced: list[tuple[int, int]],
) -> tuple[int, int]:
    """The per-item rule: (items added, change in bytes); `slots`, `index` and `replaced`
    ((old seqno, new seqno) per deduplication) updated."""
    delta = 0
    added = 0
    for one in items:
        size = item_size_bytes(one)
        old = index.get(one.key)
        if old is not None:
            replaced_item = slots[old]
            assert isinstance(replaced_item, Item)
            size -= item_size_bytes(replaced_item)
            replaced.append((replaced_item.seqno, one.seqno))
            slots[old] = None
        slots.append(one)
        index[one.key] = len(slots) - 1
        delta += size
        added += 1
        if memory + delta >= full:
            break
    return added, delta


def state(checkpoint: Checkpoint) -> tuple[object, ...]:
    slots = [slot if slot is None or not isinstance(slot, Item) else slot.seqno
             for slot in checkpoint.items]  # fmt: skip
    return (slots, dict(checkpoint.key_index), checkpoint.memory_bytes, checkpoint.live_count,
            checkpoint.hole_count, checkpoint.snap_end, checkpoint.visible_end,
            checkpoint.high_completed)  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    before=changes,
    run=changes,
    commits=st.booleans(),
    full_items=st.integers(0, 70),
    exact=st.none() | st.tuples(st.integers(1, 60), st.integers(-1, 1)),
    start_at=st.integers(0, 5),
    fresh=st.booleans(),
)
def test_add_run_is_each_item_added_in_turn(
    before: list[tuple[int, Op | None, int]],
    run: list[tuple[int, Op | None, int]],
    commits: bool,
    full_items: int,
    exact: tuple[int, int] | None,
    start_at: int,
    fresh: bool,
) -> None:
    """`exact` (k, d): full_bytes is d bytes off what the first k items of the run bring
    the checkpoint to, the bound's edge."""
    checkpoint = Checkpoint(1, snap_start=1, created_s=0.0)
    replaced: list[tuple[int, int]] = []
    checkpoint.on_replace = lambda old, new: replaced.append((old, new))
    for one in build(1, before, commits=False):
        checkpoint.add(one, item_size_bytes(one))
    slots = list(checkpoint.items)
    index = dict(checkpoint.key_index)
    memory = checkpoint.memory_bytes
    items = build(len(before) + 1, run, commits, fresh)
    start = min(start_at, len(items) - 1)
    full = memory + full_items * ONE  # from at or below what it holds to past the whole run
    if exact is not None:
        dry_slots, dry_index = list(slots), dict(index)
        deltas = [model_add_run(dry_slots, dry_index, 0, [one], 1, [])[1]
                  for one in items[start:]]  # fmt: skip
        full = memory + sum(deltas[: exact[0]]) + exact[1]
    holes_before = checkpoint.hole_count
    expected_replaced: list[tuple[int, int]] = []
    expected_added, expected_delta = model_add_run(
        slots, index, memory, items[start:], full, expected_replaced
    )
    replaced.clear()

    stop, delta = checkpoint.add_run(items, start, full, commits=commits)

    assert (stop - start, delta) == (expected_added, expected_delta)
    checkpoint.check_invariants()
    assert checkpoint.memory_bytes == memory + delta
    taken = items[start:stop]
    assert checkpoint.snap_end == checkpoint.visible_end == taken[-1].seqno
    if commits:
        assert checkpoint.high_completed == max(one.seqno for one in taken)
    if checkpoint.hole_count == holes_before + len(replaced):  # not compacted: slot for slot
        assert [s if not isinstance(s, Item) else s.seqno for s in checkpoint.items] == [
            s if not isinstance(s, Item) else s.seqno for s in slots
        ]
        assert checkpoint.key_index == index
    live = {one.key: one.seqno for one in checkpoint.live_items()}
    assert live == {key: slot.seqno for key, at in index.items()
                    if isinstance(slot := slots[at], Item)}  # fmt: skip
    assert replaced == expected_replaced  # the flusher is told of every deduplication


def test_add_run_of_new_keys_stops_where_the_checkpoint_is_full() -> None:
    """A run of new keys stops at the item that fills the checkpoint, after at least one."""
    checkpoint = Checkpoint(1, snap_start=1, created_s=0.0)
    items = build(1, [(n, None, 20) for n in range(10)], commits=False)
    size = item_size_bytes(items[0])
    stop, delta = checkpoint.add_run(items, 0, 3 * size)
    assert (stop, delta) == (3, 3 * size)
    stop, delta = checkpoint.add_run(items, 3, 3 * size + 1)
    assert (stop, delta) == (4, size)  # at least one
    stop, delta = checkpoint.add_run(items, 4, 6 * size + 1)
    assert (stop, delta) == (7, 3 * size)  # through the item that reaches full_bytes
    checkpoint.check_invariants()
    assert checkpoint.key_index == {one.key: at for at, one in enumerate(items[:7], 2)}


def model_next_run(
    slots: list[Slot], after: int, items_max: int, bytes_max: int
) -> tuple[list[Item], int]:
    """The items a byte-bounded `next_run` takes from the slots after index `after`."""
    run: list[Item] = []
    size = 0
    for slot in slots[after + 1 : after + 1 + items_max]:
        if slot is None:
            continue
        assert isinstance(slot, Item)
        run.append(slot)
        size += item_size_bytes(slot)
        if size >= bytes_max:
            break
    return run, size


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    spec=changes,
    reads=st.lists(
        st.tuples(
            st.integers(1, 30),
            st.integers(1, 25 * ONE),
            st.none() | st.tuples(st.integers(1, 30), st.integers(-1, 1)),
        ),
        min_size=1,
    ),
    commit_part=st.booleans(),
    fresh=st.booleans(),
)
def test_next_run_takes_what_the_per_item_walk_takes(
    spec: list[tuple[int, Op | None, int]],
    reads: list[tuple[int, int, tuple[int, int] | None]],
    commit_part: bool,
    fresh: bool,
) -> None:
    """A read's `exact` (k, d): bytes_max is d bytes off the charge of the next k items."""
    manager = CheckpointManager(0, budget=MemoryBudget(10**9), checkpoint_max_bytes=10**9)
    reader = manager.register_cursor("reader", 0, kind=CursorKind.STREAM).cursor
    items = build(1, spec, commits=False, fresh=fresh)
    half = len(items) // 2
    if half:
        manager.queue_run(items[:half])
    if commit_part:
        tail = build(half + 1, spec[half:], commits=True, fresh=fresh)
        manager.queue_run(tail, commits=True)
    else:
        manager.queue_run(items[half:])
    manager._check_invariants()
    seen: list[int] = []
    for items_max, bytes_max, exact in reads:
        if not reader.attached or reader.index + 1 >= len(reader.checkpoint.items):
            break
        slots = list(reader.checkpoint.items)
        at = reader.index
        if exact is not None:
            following = [slot for slot in slots[at + 1 :] if isinstance(slot, Item)]
            bytes_max = max(1, sum(map(item_size_bytes, following[: exact[0]])) + exact[1])
            items_max = max(items_max, exact[0] + 1)  # the bytes bound decides, not this one
        got = manager.next_run(reader, items_max, bytes_max)
        if not isinstance(got, ItemRun):
            continue  # a snapshot marker or a signal: next_event's, not the run's
        expected_run, expected_size = model_next_run(slots, at, items_max, bytes_max)
        assert got.items == expected_run
        assert got.charged_bytes == expected_size
        assert reader.last_seqno == expected_run[-1].seqno
        passed = [slot for slot in slots[at + 1 : reader.index + 1] if slot is not None]
        assert passed == expected_run  # the cursor passed exactly the run: nothing skipped
        seen += [one.seqno for one in got.items]
    assert seen == sorted(set(seen))
