"""A reader's position in one vbucket's checkpoint list.

Contract: a `Cursor` yields, through `next()`, a `SnapshotStart` before the items of each
checkpoint it reads, then those items in strictly increasing seqno order; never a dummy or meta
item, never an item twice, never skipping one. When it has everything it returns `CAUGHT_UP`
(wait on the manager's wakeup and call again). Once dropped by memory recovery, or removed, it
returns `DROPPED` forever and the reader must continue from disk; `StreamReader` does that.

A cursor is a plain record: it is created only by `CheckpointManager.register_cursor` /
`clone_cursor` and moved only by the manager (`next_event`, `has_next`, `read`), which owns the
list it walks. This module holds its state and its kinds, and imports nothing that moves it.

Not here: disk backfill (backfill.py), memory/disk switching (reader.py).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from changefeed.checkpoint.item import Item
from changefeed.checkpoint.snapshot import SnapshotStart

if TYPE_CHECKING:
    from changefeed.checkpoint.checkpoint import Checkpoint

Event = Item | SnapshotStart


class CursorKind(enum.Enum):
    """Who reads through a cursor, which decides whether memory recovery may drop it.

    PERSISTENCE: the flusher's cursor; never dropped (what it has not read is not on disk).
    BACKUP: the flusher's copy of the persistence cursor while a batch is being written; never
        dropped (ep-engine's backup pcursor, dcp-wire.md §10).
    REPLICA: a replica stream; dropped only if the manager is configured so
        (kv_engine supports_cursor_dropping for "replication" connections).
    STREAM: any other DCP stream; droppable.
    """

    PERSISTENCE = "persistence"
    BACKUP = "backup"
    REPLICA = "replica"
    STREAM = "stream"


class Cursor:
    """Position of one reader: a checkpoint and the index of the last slot it consumed.

    Attributes:
        name: unique per manager (registering the same name replaces the old cursor).
        kind: see `CursorKind`.
        droppable: whether memory recovery may drop it.
        checkpoint, index: the position; `checkpoint.items[index]` has been consumed.
        last_seqno: seqno of the last item yielded (or the registration seqno).
        attached: False once dropped or removed.
        dropped: True if memory recovery dropped it.
        pending_marker: snapshot start to yield first when registered mid-checkpoint.
    """

    __slots__ = (
        "attached",
        "checkpoint",
        "droppable",
        "dropped",
        "index",
        "kind",
        "last_seqno",
        "name",
        "pending_marker",
    )

    def __init__(
        self,
        name: str,
        kind: CursorKind,
        *,
        droppable: bool,
        checkpoint: Checkpoint,
        last_seqno: int,
    ) -> None:
        assert name, name
        assert not droppable or kind in (CursorKind.STREAM, CursorKind.REPLICA), (name, kind)
        self.name = name
        self.kind = kind
        self.droppable = droppable
        self.checkpoint = checkpoint
        self.index = 0
        self.last_seqno = last_seqno
        self.attached = False
        self.dropped = False
        self.pending_marker: SnapshotStart | None = None

    def __repr__(self) -> str:
        where = (
            f"checkpoint {self.checkpoint.id} index {self.index}" if self.attached else "detached"
        )
        return f"Cursor({self.name!r}, {self.kind.value}, {where}, last_seqno={self.last_seqno})"
