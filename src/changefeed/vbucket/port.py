"""The narrow port a vbucket's role reaches its core through (the core never hands out more).

The core (`vbucket.core.VBucket`) owns what every state shares: the seqno counter, the CAS
clock, the failover log, the checkpoint manager and flusher, the store. A role
(`active`, `replica`, `dead`) owns what one state does with them, and sees the core only as
`VBucketCore`: it never imports the core module, so a role can be read, and tested, alone.
"""

from __future__ import annotations

from typing import Protocol

from changefeed.checkpoint import CheckpointManager, Item, SyncItem
from changefeed.failover import FailoverLog
from changefeed.storage import Record, Store
from changefeed.vbucket_state import VBucketState


class VBucketCore(Protocol):
    """What a role may read and ask of the vbucket that owns it."""

    # Replaced by a rollback (`truncate_to`): read it through the core every time.
    manager: CheckpointManager

    @property
    def vb(self) -> int: ...

    @property
    def state(self) -> VBucketState: ...

    @property
    def high_seqno(self) -> int: ...

    @property
    def last_cas(self) -> int: ...

    @property
    def vb_uuid(self) -> int: ...

    @property
    def failover_log(self) -> FailoverLog: ...

    @property
    def store(self) -> Store: ...

    def now(self) -> float:
        """Wall-clock seconds on the vbucket's clock (CAS, expiry, delete times, locks)."""
        ...

    def next_cas(self) -> int:
        """The CAS the next change gets (not yet taken: `advanced` records it)."""
        ...

    def advanced(self, seqno: int, cas: int) -> None:
        """The role queued everything up to `seqno` (the new high seqno) and handed out `cas`."""
        ...

    def current(
        self, key: bytes, stored: dict[bytes, Record | None] | None = None
    ) -> Item | Record | None:
        """The live newest version of `key` (memory, then `stored`, then the store)."""
        ...

    def replace_failover_log(self, entries: list[tuple[int, int]]) -> None:
        """Take `entries` as the failover log, persisted at once."""
        ...

    def truncate_to(self, seqno: int) -> int:
        """Flush, truncate the store to `seqno` (or 0) and restart memory there; the point."""
        ...


def retain_pending(manager: CheckpointManager, pending: dict[bytes, SyncItem]) -> None:
    """Keep checkpoints from the oldest pending prepare on (a restart or a promotion needs it)."""
    first = next(iter(pending.values()), None)
    manager.retain_from(None if first is None else first.seqno)
