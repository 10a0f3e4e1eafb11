"""What a reader receives besides items: snapshot starts, and the "nothing now" signals.

Contract: a reader of the mutation manager (memory cursor, disk backfill or `StreamReader`) yields
`SnapshotStart` before the items of every snapshot, then items whose seqnos lie inside
[snap_start, snap_end] and increase strictly. A reader holds a consistent view only once it has
read the item at snap_end (or learnt there is none), dcp-wire.md §7.2.

The flag values are the DCP snapshot marker's (dcp-wire.md §7.2, marker flags u32), taken from
the protocol layer below this one, so the producer copies them into a marker unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Final

from changefeed.protocol.snapshot_marker import MarkerFlag

MARKER_FLAG_MEMORY: Final = int(MarkerFlag.MEMORY)  # items come from in-memory checkpoints
MARKER_FLAG_DISK: Final = int(MarkerFlag.DISK)  # items come from a disk backfill
# The snapshot is a whole checkpoint (it starts at the checkpoint's snap_start).
MARKER_FLAG_CHECKPOINT: Final = int(MarkerFlag.CHECKPOINT)


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotStart:
    """The start of a snapshot: the items that follow have seqnos in [snap_start, snap_end].

    Attributes:
        snap_start: first seqno the snapshot may hold (a deduplicated one may never arrive).
        snap_end: last seqno of the snapshot; the view is consistent once it is reached.
        flags: MARKER_FLAG_MEMORY [| MARKER_FLAG_CHECKPOINT] or MARKER_FLAG_DISK.
        max_visible_seqno: the newest seqno in the snapshot a reader sees (SyncWrite
            prepares and aborts are not seen), 0 if unknown.
        high_completed_seqno: a prepare at or below which every prepare is committed or
            aborted (0 if unknown). Both go in V2.0 markers (replica streams); they describe
            the snapshot rather than delimit it, so equality ignores them.
    """

    snap_start: int
    snap_end: int
    flags: int
    max_visible_seqno: int = dataclasses.field(default=0, compare=False)
    high_completed_seqno: int = dataclasses.field(default=0, compare=False)

    def __post_init__(self) -> None:
        assert 0 <= self.snap_start <= self.snap_end, (self.snap_start, self.snap_end)
        assert self.flags & (MARKER_FLAG_MEMORY | MARKER_FLAG_DISK), self.flags
        both = MARKER_FLAG_MEMORY | MARKER_FLAG_DISK
        assert self.flags & both != both, self.flags

    @property
    def from_disk(self) -> bool:
        """True when the snapshot's items come from a disk backfill."""
        return bool(self.flags & MARKER_FLAG_DISK)


class CursorSignal(enum.Enum):
    """Returned by `next()` instead of an event: "not yet" is a value, not an exception.

    CAUGHT_UP: the reader has everything queued so far; wait for the manager's wakeup.
    DROPPED: memory recovery dropped this memory cursor; the reader must continue from disk
        (`StreamReader` does so itself and never returns DROPPED).
    """

    CAUGHT_UP = "caught_up"
    DROPPED = "dropped"


CAUGHT_UP: Final = CursorSignal.CAUGHT_UP
DROPPED: Final = CursorSignal.DROPPED
