"""Shared helpers: item builders, a store in a temp dir, and the reference model.

The reference model is deliberately plain: an ordered log of every accepted change. A key's
latest state is the last log entry for it; nothing about checkpoints, cursors or dedup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from changefeed.checkpoint import (
    MARKER_FLAG_CHECKPOINT,
    MARKER_FLAG_DISK,
    MARKER_FLAG_MEMORY,
    CheckpointManager,
    Event,
    Item,
    SnapshotStart,
)
from changefeed.storage import Op, Store

VB = 0
MEMORY_CHECKPOINT = MARKER_FLAG_MEMORY | MARKER_FLAG_CHECKPOINT
MEMORY = MARKER_FLAG_MEMORY
DISK = MARKER_FLAG_DISK


def item(seqno: int, key: bytes | str, value: bytes = b"", op: Op = Op.MUTATION) -> Item:
    """An item with a CAS derived from the seqno (unique, increasing)."""
    key_bytes = key.encode() if isinstance(key, str) else key
    if op is not Op.MUTATION:
        return Item(seqno, key_bytes, op, value, cas=1_000_000 + seqno, delete_time=seqno)
    return Item(seqno, key_bytes, op, value or b"v%d" % seqno, cas=1_000_000 + seqno)


def queue_all(manager: CheckpointManager, items: Iterable[Item]) -> None:
    """Queue each item and check the manager's invariants after each."""
    for one in items:
        manager.queue(one)
        manager._check_invariants()


def open_store(path: Path, vb: int = VB) -> Store:
    """A non-durable store (tests need no fsync) with `vb` created as active."""
    store = Store(path, map_size_bytes=256 * 1024 * 1024, durable=False)
    if store.vbucket_meta(vb) is None:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(vb, state="active")
    return store


def seqnos(events: Iterable[Event]) -> list[int]:
    """Seqnos of the items among `events`."""
    return [event.seqno for event in events if isinstance(event, Item)]


def markers(events: Iterable[Event]) -> list[tuple[int, int, int]]:
    """(start, end, flags) of the snapshot starts among `events`."""
    return [
        (event.snap_start, event.snap_end, event.flags)
        for event in events
        if isinstance(event, SnapshotStart)
    ]


def store_view(store: Store, vb: int = VB) -> dict[bytes, tuple[Op, bytes]]:
    """Every key's newest stored state: key -> (op, value), tombstones included."""
    return {
        record.key: (record.op, record.value) for record in store.scan(vb, 0, store.high_seqno(vb))
    }


@dataclasses.dataclass
class ReaderCheck:
    """What one reader has seen, checked as it goes: (b) and (c) of the model test.

    `view` maps key -> (op, value) of the newest change seen; it starts from the model's state
    at the reader's start seqno.
    """

    position: int
    view: dict[bytes, tuple[Op, bytes]]
    snapshot: SnapshotStart | None = None

    def see(self, event: Event) -> None:
        """Check one event against what came before, then record it."""
        if isinstance(event, SnapshotStart):
            assert event.snap_start > self.position, (event, self.position)
            self.snapshot = event
            return
        assert self.snapshot is not None, event
        assert self.snapshot.snap_start <= event.seqno <= self.snapshot.snap_end, (
            self.snapshot,
            event,
        )
        assert event.seqno > self.position, (event, self.position)
        self.position = event.seqno
        self.view[event.key] = (event.op, event.value)


class Model:
    """The reference: an ordered log of all accepted changes."""

    def __init__(self) -> None:
        self.log: list[Item] = []

    @property
    def high_seqno(self) -> int:
        return self.log[-1].seqno if self.log else 0

    def append(self, one: Item) -> None:
        assert one.seqno > self.high_seqno, (one, self.high_seqno)
        self.log.append(one)

    def state_at(self, seqno: int) -> dict[bytes, tuple[Op, bytes]]:
        """key -> (op, value) of the newest change at or below `seqno`."""
        state: dict[bytes, tuple[Op, bytes]] = {}
        for one in self.log:
            if one.seqno > seqno:
                break
            state[one.key] = (one.op, one.value)
        return state

    def latest(self) -> dict[bytes, tuple[Op, bytes]]:
        return self.state_at(self.high_seqno)
