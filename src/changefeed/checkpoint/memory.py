"""Checkpoint memory: what one queued item costs, and the quota shared by a bucket's managers.

Contract: every byte a checkpoint holds is charged to a `MemoryBudget` when the item is queued and
released when dedup, collapse or removal frees it, so `used_bytes` is exact against our own
accounting (`item_size_bytes`). When usage passes the upper mark the budget runs memory recovery
over its managers, largest first, down to the lower mark (kv_engine's CheckpointMemRecoveryTask,
dcp-wire.md §10): first every manager closes its open checkpoint so it can be freed, then managers
drop droppable cursors from their oldest checkpoints. A write that would still not fit under the
quota is refused with `CheckpointMemoryFullError` (kv_engine's TempOOM) before anything changes.

Not here: which cursor is droppable and how checkpoints are freed (manager.py); item expel
(kv_engine's middle step, dropping already-read items from a referenced checkpoint) is not done:
cursor dropping alone brings usage under the lower mark whenever the persistence cursor keeps up.
"""

from __future__ import annotations

import weakref
from typing import Final, Protocol

from changefeed import limits
from changefeed.checkpoint.item import Item
from changefeed.protocol.errors import TemporaryFailureError
from changefeed.storage import Op
from changefeed.storage.record import DELETION_EXTRAS_SIZE, MUTATION_EXTRAS_SIZE

# Bytes one queued item costs beyond its key and value, measured with tracemalloc on CPython 3.11
# (tests/unit/checkpoint/test_memory.py checks it to within 15 %; the bench prints it):
#   Item object, 10 slots                      16 header + 16 GC + 10 x 8 = 112
#   seqno int (< 2**30) / cas int (64-bit)     32 + 40                    =  72
#   key and body bytes objects, headers        2 x 33                     =  66
#   the body's extras (31, a mutation) and its own copy of the key,
#                    charged at a 10-byte key  31 + 10                    =  41
#   slot in the checkpoint's item list         8, ~1.1x for list growth   ~   9
#   key index entry: dict slot ~29 (24-byte entry + index at 2/3 load)
#                    + the int index it maps to (32)                     ~  61
# total 361 (a 6-byte key and 100-byte value measured 463 B against 467 accounted; a 10-byte
# key 472 against 471). The body replaced a separate value object (320 before it).
ITEM_OVERHEAD_BYTES: Final = 361
_MUTATION: Final = Op.MUTATION
_PREPARE: Final = Op.PREPARE
# Bytes charged beyond len(body), whose extras are part of the overhead above.
MUTATION_BODY_OVERHEAD_BYTES: Final = ITEM_OVERHEAD_BYTES - MUTATION_EXTRAS_SIZE
TOMBSTONE_BODY_OVERHEAD_BYTES: Final = ITEM_OVERHEAD_BYTES - DELETION_EXTRAS_SIZE


def item_size_bytes(item: Item) -> int:
    """Bytes charged for `item`: key + value + ITEM_OVERHEAD_BYTES."""
    # len(body) = extras + key + value; read from the body, `value` would copy it.
    if item.op is _MUTATION or (item.op is _PREPARE and not item.deleted):
        return len(item.body) + MUTATION_BODY_OVERHEAD_BYTES
    return len(item.body) + TOMBSTONE_BODY_OVERHEAD_BYTES


class CheckpointMemoryFullError(TemporaryFailureError):
    """A write would take checkpoint memory over the quota and recovery could not make room.

    Operating error, not a bug: it is a TMPFAIL (kv_engine TempOOM) and reaches the client as one
    without translation; the writer retries later. Raise `MemoryBudget.quota_bytes` or let the
    flusher catch up.
    """


class Recoverable(Protocol):
    """What the budget needs of a checkpoint manager (manager.py implements it)."""

    @property
    def vb(self) -> int: ...

    @property
    def memory_bytes(self) -> int: ...

    def close_open_checkpoint(self) -> None: ...

    def drop_cursors(self, target_bytes: int) -> None: ...


class MemoryBudget:
    """Checkpoint memory quota shared by the checkpoint managers of one bucket on one node.

    Args:
        quota_bytes: hard limit on checkpoint memory; writes beyond it are refused.
        upper_mark_percent: usage (percent of quota) above which recovery runs.
        lower_mark_percent: usage recovery works down to.
    """

    def __init__(
        self,
        quota_bytes: int = limits.CHECKPOINT_MEMORY_QUOTA_BYTES_DEFAULT,
        *,
        upper_mark_percent: int = limits.CHECKPOINT_MEMORY_UPPER_MARK_PERCENT,
        lower_mark_percent: int = limits.CHECKPOINT_MEMORY_LOWER_MARK_PERCENT,
    ) -> None:
        assert quota_bytes > 0, quota_bytes
        assert 0 < lower_mark_percent < upper_mark_percent <= 100, (
            lower_mark_percent,
            upper_mark_percent,
        )
        self.quota_bytes = quota_bytes
        self.upper_mark_bytes = quota_bytes * upper_mark_percent // 100
        self.lower_mark_bytes = quota_bytes * lower_mark_percent // 100
        self.used_bytes = 0
        self.recoveries = 0
        self._recovering = False
        # Weak: a manager that is dropped without detach() must not be kept alive by its budget.
        self._managers: weakref.WeakSet[Recoverable] = weakref.WeakSet()

    def attach(self, manager: Recoverable) -> None:
        """Make `manager` part of this budget's recovery (its memory is charged by itself)."""
        self._managers.add(manager)

    def detach(self, manager: Recoverable) -> None:
        """Remove `manager`; it must have released all it charged."""
        assert manager.memory_bytes == 0, (manager.vb, manager.memory_bytes)
        self._managers.discard(manager)

    def charge(self, delta_bytes: int) -> None:
        """Add (or, negative, release) checkpoint memory."""
        self.used_bytes += delta_bytes
        assert self.used_bytes >= 0, (self.used_bytes, delta_bytes)

    @property
    def over_upper_mark(self) -> bool:
        """True when recovery should run."""
        return self.used_bytes > self.upper_mark_bytes

    def make_room(self, nbytes: int) -> None:
        """Ensure `nbytes` more fit under the quota, recovering memory if needed.

        Raises:
            CheckpointMemoryFullError: still no room after recovery.
        """
        if self.used_bytes + nbytes <= self.quota_bytes:
            return
        self.recover()
        if self.used_bytes + nbytes > self.quota_bytes:
            raise CheckpointMemoryFullError(
                f"checkpoint memory {self.used_bytes} + {nbytes} > quota {self.quota_bytes}: "
                "raise MemoryBudget.quota_bytes or let the flusher catch up"
            )

    def recover(self) -> None:
        """Bring usage down to the lower mark where cursors allow it (dcp-wire.md §10 order)."""
        # A manager freeing memory may re-enter through queue(); one recovery at a time is enough.
        if self._recovering:
            return
        self._recovering = True
        try:
            self.recoveries += 1
            for manager in self._by_memory():
                if self.used_bytes <= self.lower_mark_bytes:
                    return
                manager.close_open_checkpoint()
            for manager in self._by_memory():
                if self.used_bytes <= self.lower_mark_bytes:
                    break
                manager.drop_cursors(self.lower_mark_bytes)
        finally:
            self._recovering = False

    def _by_memory(self) -> list[Recoverable]:
        # Largest first, then by vb so that a run replays the same way (STYLE.md §3).
        return sorted(self._managers, key=lambda m: (-m.memory_bytes, m.vb))
