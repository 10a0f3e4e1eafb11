"""A vbucket role: what one state does. The base refuses everything, as a dead copy does.

The vbucket (`core.VBucket`) holds exactly one role and swaps it on each state change
(`roles.role_for`); each of its operations is one call to the role. An operation a state does
not take is refused here, once, with NOT_MY_VBUCKET naming the state (there are no guards
scattered through the operations). A role reaches its vbucket only through `port.VBucketCore`.

Pending SyncWrite prepares are handed from role to role: a replica keeps those it receives,
an active commits them (`Effect.PREPARES_COMMITTED`), a dead copy keeps what the store keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NoReturn

from changefeed.checkpoint import Item, SyncItem
from changefeed.protocol.errors import NotMyVbucketError, StatusError
from changefeed.protocol.kv import MutationResult
from changefeed.storage import Record
from changefeed.vbucket.port import VBucketCore
from changefeed.vbucket.values import Document, ReplicatedColumns, RunLookup, SetManyResult


class Role:
    """The operations of a vbucket, each refused; a state's role overrides what it takes.

    Args:
        core: the vbucket, through its port.
        pending: the pending prepares the previous role held (the store's, at recovery),
            oldest first; this role owns the dict from now on.
    """

    def __init__(self, core: VBucketCore, pending: dict[bytes, SyncItem]) -> None:
        self.core = core
        self.pending = pending

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vb={self.core.vb}, pending={len(self.pending)})"

    @property
    def locks_held(self) -> int:
        """GET_LOCKED entries held (only an active copy holds any)."""
        return 0

    def _refuse(self, wanted: str) -> NoReturn:
        core = self.core
        raise NotMyVbucketError(f"vb {core.vb} is {core.state.value}, not {wanted}")

    # -- reads ----------------------------------------------------------------------------------

    def check_readable(self) -> None:
        """Raise NotMyVbucketError unless reads are served (active and replica copies)."""
        core = self.core
        raise NotMyVbucketError(f"vb {core.vb} is {core.state.value}")

    def visible_cas(self, key: bytes, cas: int) -> int:
        """The CAS a read of `key` shows (locks change it on an active copy)."""
        return cas

    def on_expired(self, found: Item | Record) -> None:
        """A read found `found` expired: only an active copy queues its EXPIRATION."""

    def expire_if_due(self, key: bytes) -> bool:
        """The expiry pager's entry; only an active copy expires anything."""
        return False

    # -- the active copy's ----------------------------------------------------------------------

    def set(
        self, key: bytes, value: bytes, *, flags: int = 0, expiry: int = 0, datatype: int = 0,
        cas: int = 0, level: int = 0,
    ) -> MutationResult:  # fmt: skip
        self._refuse("active")

    def set_many(
        self, keys: Sequence[bytes], values: Sequence[bytes], flags: Sequence[int],
        expiries: Sequence[int], datatypes: Sequence[int], *, lookup: RunLookup | None = None,
        fields_checked: bool = False, level: int = 0,
    ) -> SetManyResult:  # fmt: skip
        """Every write of the run refused (a run answers per write, it does not raise)."""
        core, count = self.core, len(keys)
        error = NotMyVbucketError(f"vb {core.vb} is {core.state.value}, not active")
        errors: dict[int, StatusError] = dict.fromkeys(range(count), error)
        return SetManyResult(core.vb, core.vb_uuid, [0] * count, [0] * count, errors)

    def set_single(
        self, key: bytes, value: bytes, flags: int, expiry: int, datatype: int, *,
        found: Item | None, stored: Mapping[bytes, Record | None], fields_checked: bool,
    ) -> SetManyResult | None:  # fmt: skip
        """None: this role takes no write without `set_many` (which answers it)."""
        return None

    def add(
        self, key: bytes, value: bytes, *, flags: int = 0, expiry: int = 0, datatype: int = 0,
        level: int = 0,
    ) -> MutationResult:  # fmt: skip
        self._refuse("active")

    def replace(
        self, key: bytes, value: bytes, *, flags: int = 0, expiry: int = 0, datatype: int = 0,
        cas: int = 0, level: int = 0,
    ) -> MutationResult:  # fmt: skip
        self._refuse("active")

    def delete(self, key: bytes, *, cas: int = 0, level: int = 0) -> MutationResult:
        self._refuse("active")

    def touch(self, key: bytes, expiry: int, *, cas: int = 0) -> MutationResult:
        self._refuse("active")

    def check_write(self, key: bytes, cas: int) -> None:
        self._refuse("active")

    def get_locked(self, key: bytes, lock_s: float) -> Document:
        self._refuse("active")

    def unlock(self, key: bytes, cas: int) -> None:
        self._refuse("active")

    def commit(self, key: bytes) -> MutationResult:
        self._refuse("active")

    def commit_many(self, keys: Sequence[bytes]) -> list[MutationResult | StatusError]:
        self._refuse("active")

    def abort(self, key: bytes) -> int:
        self._refuse("active")

    def commit_all_pending(self) -> int:
        self._refuse("active")

    # -- the replica copy's ---------------------------------------------------------------------

    def queue_replicated(self, item: Item) -> None:
        self._refuse("a replica")

    def queue_replicated_run(self, items: Sequence[Item]) -> int:
        self._refuse("a replica")

    def queue_replicated_columns(self, run: ReplicatedColumns) -> int:
        self._refuse("a replica")

    def queue_replicated_prepares(self, prepares: Sequence[SyncItem]) -> int:
        self._refuse("a replica")

    def replica_commit(self, key: bytes, prepared_seqno: int, commit_seqno: int) -> None:
        self._refuse("a replica")

    def replica_commit_many(self, commits: Sequence[tuple[bytes, int, int]]) -> int:
        self._refuse("a replica")

    def replica_snapshot(self, snap_start: int, snap_end: int) -> None:
        self._refuse("a replica")

    def adopt_failover_log(self, entries: list[tuple[int, int]]) -> None:
        self._refuse("a replica")

    def rollback(self, seqno: int) -> int:
        self._refuse("a replica")
