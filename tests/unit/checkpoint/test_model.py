"""Random interleavings of queue / register / advance / drop / collapse / flush against a model.

The model (helpers.Model) is a plain ordered log of every accepted change. After every step:
  (a) every checkpoint holds each key at most once (and every manager invariant holds);
  (b) each reader sees strictly increasing seqnos, each item inside the snapshot announced
      before it (ReaderCheck asserts this as events arrive);
  (c) a reader that reads to the end holds, for every key, the model's latest state;
  (d) the persistence cursor is never dropped, and after a flush the store (a real LMDB store
      in a temp dir) equals the model;
  memory never exceeds the quota (writes are refused instead: then the model does not change).
Hypothesis prints the failing sequence of rules; rerun with the printed seed to reproduce.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from changefeed.checkpoint import (
    CAUGHT_UP,
    CheckpointManager,
    CheckpointMemoryFullError,
    CursorKind,
    Flusher,
    MemoryBudget,
    StreamReader,
    item_size_bytes,
)
from changefeed.storage import Op

from .helpers import VB, Model, ReaderCheck, item, open_store, store_view

KEYS = [b"k%d" % n for n in range(12)]
ONE = item_size_bytes(item(1, KEYS[0], b"x" * 20))
READERS_MAX = 4


class MutationManagerMachine(RuleBasedStateMachine):
    readers = Bundle("readers")

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="checkpoint-model-")
        self.store = open_store(Path(self.directory))
        self.model = Model()
        self.budget = MemoryBudget(40 * ONE)
        self.manager = CheckpointManager(
            VB, budget=self.budget, checkpoint_max_bytes=6 * ONE, replica_cursors_droppable=True
        )
        self.flusher = Flusher(self.manager, self.store, batch_bytes_max=7 * ONE)
        self.open_readers: dict[str, tuple[StreamReader, ReaderCheck]] = {}
        self.next_reader = 0
        self.refused = 0

    def teardown(self) -> None:
        for reader, _ in self.open_readers.values():
            reader.close()
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- writers --------------------------------------------------------------------------------

    def _queue(self, key: bytes, delete: bool, value: bytes) -> None:
        seqno = self.model.high_seqno + 1
        op = Op.DELETION if delete else Op.MUTATION
        one = item(seqno, key, value if not delete else b"", op=op)
        try:
            self.manager.queue(one)
        except CheckpointMemoryFullError:
            self.refused += 1
            assert self.manager.high_seqno == self.model.high_seqno
            return
        self.model.append(one)

    @rule(key=st.sampled_from(KEYS), delete=st.booleans(), value=st.binary(max_size=20))
    def queue(self, key: bytes, delete: bool, value: bytes) -> None:
        self._queue(key, delete, value)

    @rule(count=st.integers(1, 30), keys=st.integers(1, 100))
    def queue_many(self, count: int, keys: int) -> None:
        # Up to 100 distinct keys: more than the quota holds, so dedup cannot save memory.
        for n in range(count):
            self._queue(b"m%d" % ((self.model.high_seqno + n) % keys), False, b"x" * 20)

    @rule(
        changes=st.lists(
            st.tuples(st.sampled_from(KEYS), st.booleans(), st.binary(max_size=20)),
            min_size=1,
            max_size=40,
        )
    )
    def queue_run(self, changes: list[tuple[bytes, bool, bytes]]) -> None:
        """A run queued at once (a received batch, a replica's run): keys may repeat inside
        it; memory may run out part of the way, and then exactly a prefix is queued."""
        first = self.model.high_seqno + 1
        run = [
            item(seqno, key, b"" if delete else value, Op.DELETION if delete else Op.MUTATION)
            for seqno, (key, delete, value) in enumerate(changes, first)
        ]
        try:
            queued = self.manager.queue_run(run)
        except CheckpointMemoryFullError:
            self.refused += 1
            assert self.manager.high_seqno == self.model.high_seqno
            return
        assert 1 <= queued <= len(run), queued
        assert self.manager.high_seqno == run[queued - 1].seqno
        for one in run[:queued]:
            self.model.append(one)

    @rule()
    def flush(self) -> None:
        self.flusher.flush()
        assert self.flusher.persisted_seqno == self.model.high_seqno
        assert store_view(self.store) == self.model.latest()  # (d)

    @rule()
    def flush_one_batch(self) -> None:
        self.flusher.flush_batch()

    @rule()
    def close_open_checkpoint(self) -> None:
        self.manager.close_open_checkpoint()

    @rule()
    def collapse(self) -> None:
        self.manager.collapse()

    # -- readers --------------------------------------------------------------------------------

    @precondition(lambda self: len(self.open_readers) < READERS_MAX)
    @rule(target=readers, fraction=st.floats(0, 1), replica=st.booleans())
    def register(self, fraction: float, replica: bool) -> str:
        start = int(self.model.high_seqno * fraction)
        name = f"reader{self.next_reader}"
        self.next_reader += 1
        kind = CursorKind.REPLICA if replica else CursorKind.STREAM
        reader = StreamReader(self.manager, self.store, name=name, start_seqno=start, kind=kind)
        self.open_readers[name] = (reader, ReaderCheck(start, self.model.state_at(start)))
        return name

    @rule(name=readers, count=st.integers(1, 40))
    def advance(self, name: str, count: int) -> None:
        if name not in self.open_readers:
            return
        reader, check = self.open_readers[name]
        for _ in range(count):
            event = reader.next()
            if event is CAUGHT_UP:
                break
            check.see(event)  # (b)

    @rule(name=readers)
    def read_to_end(self, name: str) -> None:
        if name not in self.open_readers:
            return
        reader, check = self.open_readers[name]
        for event in reader:
            check.see(event)  # (b)
        assert reader.next() is CAUGHT_UP
        assert check.position == self.model.high_seqno
        assert check.view == self.model.latest()  # (c)
        assert reader.from_memory

    @rule(name=readers)
    def drop(self, name: str) -> None:
        cursor = self.manager.cursor(name)
        if cursor is not None and cursor.droppable:
            self.manager.drop_cursor(cursor)

    @rule(name=consumes(readers))
    def close_reader(self, name: str) -> None:
        if name in self.open_readers:
            reader, _ = self.open_readers.pop(name)
            reader.close()

    # -- after every step ---------------------------------------------------------------------

    @invariant()
    def manager_invariants_hold(self) -> None:
        self.manager._check_invariants()
        for checkpoint in self.manager.checkpoints():  # (a), also inside _check_invariants
            keys = [one.key for one in checkpoint.live_items()]
            assert len(keys) == len(set(keys)), checkpoint

    @invariant()
    def persistence_cursor_is_never_dropped(self) -> None:
        cursor = self.manager.persistence_cursor
        assert cursor is not None
        assert cursor.attached
        assert not cursor.dropped

    @invariant()
    def memory_stays_within_the_quota(self) -> None:
        assert self.budget.used_bytes <= self.budget.quota_bytes, self.budget.used_bytes
        assert self.budget.used_bytes == self.manager.memory_bytes


MutationManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
TestMutationManager = MutationManagerMachine.TestCase
