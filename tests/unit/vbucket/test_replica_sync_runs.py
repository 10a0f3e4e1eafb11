"""A replica's runs of DCP_PREPAREs and DCP_COMMITs (`queue_replicated_prepares`,
`replica_commit_many`) against one call each (`queue_replicated`, `replica_commit`) on a twin
vbucket: the same error at the same place, and the same checkpoints, pending prepares, high
seqno and, once flushed, the same records and high completed seqno on disk."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.checkpoint import Item, SyncItem
from changefeed.protocol.errors import StatusError
from changefeed.storage import Op, Store
from changefeed.vbucket import VBucket
from changefeed.vbucket_state import VBucketState

NOW = 1_700_000_000.0
SNAPSHOT_END = 200

# One step of the active's stream: (kind, key, variant). Variants other than 0 make the step
# bad in one way (kept rare by the weights): a commit of the wrong prepare, a seqno that does
# not rise, a seqno past the snapshot, an empty key.
steps = st.lists(
    st.tuples(
        st.sampled_from(["prepare", "prepare", "commit", "commit", "commit"]),
        st.integers(0, 5),
        st.sampled_from([0] * 30 + [1, 2, 3, 4]),
    ),
    min_size=1,
    max_size=40,
)


def replica(root: Path, name: str, checkpoint_max_bytes: int) -> tuple[Store, VBucket]:
    store = Store(root / name, map_size_bytes=64 << 20, durable=False)
    vbucket = VBucket(
        store, 0, clock=lambda: NOW, rng=random.Random(1), checkpoint_max_bytes=checkpoint_max_bytes
    )
    vbucket.set_state(VBucketState.REPLICA)
    vbucket.replica_snapshot(1, SNAPSHOT_END)
    return store, vbucket


Event = tuple[str, SyncItem | tuple[bytes, int, int]]


def stream_of(script: list[tuple[str, int, int]]) -> list[Event]:
    """The events an active would send (with the bad variants mixed in)."""
    events: list[Event] = []
    pending: dict[bytes, int] = {}
    for seqno, (kind, key_number, variant) in enumerate(script, start=1):
        key = b"k%d" % key_number
        at = {2: seqno - 1, 3: SNAPSHOT_END + 1}.get(variant, seqno)
        if kind == "prepare" or key not in pending:
            value = b"v%d" % seqno
            item = SyncItem(
                at, b"" if variant == 4 else key, Op.PREPARE, Op.MUTATION, value, 1000 + seqno,
                level=1,
            )  # fmt: skip
            events.append(("prepare", item))
            pending[key] = at
        else:
            prepared = pending.pop(key) + (1 if variant == 1 else 0)
            events.append(("commit", (key, prepared, at)))
    return events


def one_at_a_time(vbucket: VBucket, events: list[Event]) -> str | None:
    for kind, event in events:
        try:
            if kind == "prepare":
                assert isinstance(event, SyncItem)
                vbucket.queue_replicated(event)
            else:
                assert isinstance(event, tuple)
                vbucket.replica_commit(*event)
        except StatusError as error:
            return f"{type(error).__name__}: {error}"
    return None


def as_runs(vbucket: VBucket, events: list[Event]) -> str | None:
    start = 0
    while start < len(events):  # bounded: each round takes >= 1 event
        kind = events[start][0]
        stop = start
        while stop < len(events) and events[stop][0] == kind:
            stop += 1
        run = [event for _, event in events[start:stop]]
        try:
            if kind == "prepare":
                prepares = [e for e in run if isinstance(e, SyncItem)]
                assert vbucket.queue_replicated_prepares(prepares) == len(run)
            else:
                commits = [e for e in run if isinstance(e, tuple)]
                assert vbucket.replica_commit_many(commits) == len(run)
        except StatusError as error:
            return f"{type(error).__name__}: {error}"
        start = stop
    return None


def summary(vbucket: VBucket, store: Store) -> tuple[object, ...]:
    """What a run must keep equal. Not the checkpoint boundaries: a run fills the open
    checkpoint where single calls close it behind each cursor (`CheckpointManager.queue_run`),
    so a run may also deduplicate more; the newest item of each key in each namespace, the
    highest completed prepare and the seqnos are the same."""
    newest: dict[tuple[bool, bytes], tuple[int, Op, bytes, int]] = {}
    completed = 0
    for checkpoint in vbucket.manager.checkpoints():
        completed = max(completed, checkpoint.high_completed)
        for slot in checkpoint.items:
            if isinstance(slot, Item) and slot.seqno:
                sync = isinstance(slot, SyncItem)
                newest[(sync, slot.key)] = (slot.seqno, slot.op, slot.value, slot.cas)
    pending = [(p.key, p.seqno, p.value) for p in vbucket.pending_prepares]
    high = vbucket.high_seqno
    vbucket.flush()
    records = [(r.key, r.seqno, r.op, r.value, r.cas) for r in store.scan(0, 0, 1 << 40)]
    return newest, completed, pending, high, records, store.high_completed_seqno(0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps, st.sampled_from([300, 1 << 20]))
def test_runs_are_one_call_each(script: list[tuple[str, int, int]], checkpoint_bytes: int) -> None:
    events = stream_of(script)
    with tempfile.TemporaryDirectory() as root:
        store_a, runs = replica(Path(root), "a", checkpoint_bytes)
        store_b, singles = replica(Path(root), "b", checkpoint_bytes)
        try:
            assert as_runs(runs, events) == one_at_a_time(singles, events)
            assert summary(runs, store_a) == summary(singles, store_b)
        finally:
            store_a.close()
            store_b.close()


def test_a_second_prepare_of_a_key_in_one_run_goes_to_the_next_checkpoint(tmp_path: Path) -> None:
    store, vbucket = replica(tmp_path, "a", 1 << 20)
    try:
        prepares = [
            SyncItem(1, b"x", Op.PREPARE, Op.MUTATION, b"lead", 4, level=1),
            SyncItem(2, b"k", Op.PREPARE, Op.MUTATION, b"one", 5, level=1),
            SyncItem(3, b"j", Op.PREPARE, Op.MUTATION, b"two", 6, level=1),
            SyncItem(4, b"k", Op.PREPARE, Op.MUTATION, b"three", 7, level=1),
        ]
        assert vbucket.queue_replicated_prepares(prepares) == 4
        indexes = [sorted(c.prepared_index) for c in vbucket.manager.checkpoints()]
        # The flusher's checkpoint takes one (as `queue` leaves it); the prepares namespace
        # holds a key once, so the second prepare of k starts the next.
        assert indexes[-3:] == [[b"x"], [b"j", b"k"], [b"k"]]
        pending = [(p.key, p.seqno) for p in vbucket.pending_prepares]
        assert pending == [(b"x", 1), (b"j", 3), (b"k", 4)]
        assert vbucket.replica_commit_many([(b"k", 4, 5), (b"j", 3, 6), (b"x", 1, 7)]) == 3
        assert vbucket.pending_prepares == [] and vbucket.high_seqno == 7
        got = vbucket.get(b"k")
        assert got is not None and (got.value, got.seqno, got.cas) == (b"three", 5, 7)
    finally:
        store.close()
