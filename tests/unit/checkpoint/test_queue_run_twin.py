"""`CheckpointManager.queue_run` against `queue` of each item in turn: the same checkpoints.

A run must leave the checkpoint chain exactly as queueing its items one at a time does, or
what memory recovery can later merge and free differs between the two: a window's SETs were
refused TMPFAIL where the same SETs sent one at a time were not (a fresh-clone run's find in
tests/unit/server/test_window_read_ahead.py). There the flusher's cursor waited in the empty
open checkpoint; `queue` closes such a checkpoint after one item, the run filled it.

The quota is large enough that no recovery runs (it closes open checkpoints at its own
moments, once per run against once per item); checkpoints are small, keys repeat, and the
flusher catches up between some runs, so its cursor waits in the open checkpoint again.
"""

from __future__ import annotations

from pathlib import Path
from tempfile import TemporaryDirectory

from hypothesis import example, given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import CheckpointManager, Flusher, Item, MemoryBudget, item_size_bytes

from .helpers import VB, item, open_store

ONE = item_size_bytes(item(1, b"k0", b"x" * 20))

# A run: (key number, value length) per item; a step: a run and whether to flush after it.
runs = st.lists(
    st.tuples(
        st.lists(st.tuples(st.integers(0, 6), st.integers(0, 60)), min_size=1, max_size=12),
        st.booleans(),
    ),
    min_size=1,
    max_size=8,
)


def chain(manager: CheckpointManager) -> list[tuple[object, ...]]:
    """Every checkpoint in memory: its seqno range, its slots (seqno or a hole), its bytes,
    the cursors inside and whether it is open."""
    return [
        (
            checkpoint.snap_start,
            checkpoint.snap_end,
            [slot.seqno if isinstance(slot, Item) else None for slot in checkpoint.items],
            checkpoint.memory_bytes,
            checkpoint.cursor_count,
            checkpoint.is_open,
        )
        for checkpoint in manager.checkpoints()
    ]


@settings(max_examples=150, deadline=None)
@example(  # the flusher's cursor in the empty open checkpoint; a key written again
    [([(0, 5), (0, 50), (1, 5)], False), ([(0, 50)], True), ([(2, 5), (2, 5)], False)]
)
@given(runs)
def test_a_run_leaves_the_checkpoints_one_at_a_time_leaves(
    steps: list[tuple[list[tuple[int, int]], bool]],
) -> None:
    with TemporaryDirectory() as directory:
        twins = []
        for name in ("run", "one"):
            store = open_store(Path(directory) / name)
            manager = CheckpointManager(
                VB, budget=MemoryBudget(10_000 * ONE), checkpoint_max_bytes=3 * ONE
            )
            twins.append((manager, Flusher(manager, store), store))
        try:
            seqno = 0
            for run, flush in steps:
                items = [
                    item(seqno + n, b"k%d" % key, b"v" * size)
                    for n, (key, size) in enumerate(run, 1)
                ]
                seqno += len(items)
                (by_run, run_flusher, _), (one_by_one, one_flusher, _) = twins
                assert by_run.queue_run(items) == len(items)
                for one in items:
                    one_by_one.queue(one)
                if flush:
                    run_flusher.flush()
                    one_flusher.flush()
                assert chain(by_run) == chain(one_by_one)
                assert by_run.memory_bytes == one_by_one.memory_bytes
        finally:
            for _, _, store in twins:
                store.close()
