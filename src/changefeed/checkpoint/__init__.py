"""The mutation manager: per-vbucket checkpoints, cursors, dedup, collapse, memory recovery.

Seed: shared/seeds/mutation-manager.md; production facts: shared/reference/dcp-wire.md §10.
A vbucket queues items into its `CheckpointManager`; the `Flusher` drains the persistence cursor
into the store; a stream reads through a `StreamReader`, which switches between memory and disk
backfill by itself. This layer imports only changefeed.limits, changefeed.storage and, from
changefeed.protocol, the marker flags and the TMPFAIL error class.
"""

from changefeed.checkpoint.backfill import Backfill, BackfillQueue, DiskCursor
from changefeed.checkpoint.checkpoint import Checkpoint
from changefeed.checkpoint.cursor import Cursor, CursorKind, Event
from changefeed.checkpoint.flusher import Flusher
from changefeed.checkpoint.item import CommitItem, Item, SyncItem
from changefeed.checkpoint.manager import PERSISTENCE_CURSOR_NAME, CheckpointManager, Registration
from changefeed.checkpoint.memory import (
    ITEM_OVERHEAD_BYTES,
    CheckpointMemoryFullError,
    MemoryBudget,
    item_size_bytes,
)
from changefeed.checkpoint.reader import StreamReader
from changefeed.checkpoint.snapshot import (
    CAUGHT_UP,
    DROPPED,
    MARKER_FLAG_CHECKPOINT,
    MARKER_FLAG_DISK,
    MARKER_FLAG_MEMORY,
    CursorSignal,
    SnapshotStart,
)
from changefeed.checkpoint.wakeup import Wakeup

__all__ = [
    "CAUGHT_UP",
    "DROPPED",
    "ITEM_OVERHEAD_BYTES",
    "MARKER_FLAG_CHECKPOINT",
    "MARKER_FLAG_DISK",
    "MARKER_FLAG_MEMORY",
    "PERSISTENCE_CURSOR_NAME",
    "Backfill",
    "BackfillQueue",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointMemoryFullError",
    "CommitItem",
    "Cursor",
    "CursorKind",
    "CursorSignal",
    "DiskCursor",
    "Event",
    "Flusher",
    "Item",
    "MemoryBudget",
    "Registration",
    "SnapshotStart",
    "StreamReader",
    "SyncItem",
    "Wakeup",
    "item_size_bytes",
]
