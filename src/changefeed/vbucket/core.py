"""A vbucket: seqno counter, CAS clock, state, failover log, its mutation manager, and the role
its state gives it.

Contract:
- What every state shares lives here: the seqno counter, the hybrid CAS clock (wall-clock
  nanoseconds, but always above every CAS handed out or recovered, so CAS values increase even
  if the clock steps back), the failover log, the checkpoint manager and flusher, the store.
  What a state does lives in its role (`active`, `replica`, `dead`), which this vbucket owns and
  swaps on each state change (`set_state`); every operation is one call to the role, which
  refuses what its state does not take (NOT_MY_VBUCKET). Roles see this class only through
  `port.VBucketCore`.
- Writes are the active role's (`active.py`): each gets the next seqno and CAS and is queued
  into the checkpoint manager; it is durable once the flusher has written it
  (`persisted_seqno`). When checkpoint memory is full the write is refused with
  `CheckpointMemoryFullError` (a TMPFAIL) and nothing changes. Replicated items are the replica
  role's (`replica.py`), seqno and CAS as the active gave them.
- Operating errors are the wire's `StatusError` subclasses (`changefeed.protocol.errors`): one
  hierarchy from the mutation manager to the client, so no layer translates another's errors.
- Reads (`get`) look at memory first (the newest version of a key still in a checkpoint), then
  the store. A document whose expiry has passed reads as missing and, on an active vbucket, an
  EXPIRATION is queued for it (lazy expiry, as kv_engine does on access).
- Becoming ACTIVE from another state adds a failover entry at the high seqno (a new history
  branch, dcp-wire.md §9.4), persisted with the state at once. After an unclean shutdown an
  active vbucket also adds one on recovery: acknowledged writes that were not yet persisted are
  gone, and consumers that saw them must be rolled back.
- Construction recovers from the store: state, failover log, high seqno, snapshot range and the
  pending SyncWrite prepares; a vbucket the store does not know is created (state persisted,
  fresh failover log). A vbucket that is or becomes ACTIVE with prepares pending commits them.

Not here: the wire (server/), streams (producer/ reads through `stream()`), the node's effects of
a state change (`ServerContext.set_vbucket_state`), compaction scheduling. Not thread-safe: one
event loop owns a vbucket.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from changefeed import limits
from changefeed.checkpoint import (
    CheckpointManager,
    CursorKind,
    Flusher,
    Item,
    MemoryBudget,
    StreamReader,
    SyncItem,
)
from changefeed.failover import FailoverLog
from changefeed.protocol.errors import StatusError
from changefeed.protocol.kv import MutationResult
from changefeed.protocol.kv_ops import DocumentMeta
from changefeed.storage import Op, Record, Store
from changefeed.vbucket.role import Role
from changefeed.vbucket.roles import role_for, serves
from changefeed.vbucket.values import (
    NS_PER_S,
    Document,
    ReplicatedColumns,
    RunLookup,
    SetManyResult,
)
from changefeed.vbucket_state import Effect, Transition, VBucketState, transition

# Records read back at recovery to find the highest CAS handed out before (bounded, O(1)):
# the hybrid clock only needs it when the wall clock stepped back across the restart.
_CAS_RECOVERY_RECORDS_MAX: Final = 1024


class VBucket:
    """One vbucket of a bucket on this node.

    Args:
        store: the bucket's store; this vbucket's records and metadata live there.
        vb: vbucket id.
        state: the state of a vbucket the store does not know yet (ignored on recovery).
        clock: wall-clock seconds since the epoch (CAS, delete times, expiry); inject for tests.
        rng: draws vb_uuids; pass a seeded one for replayable runs (STYLE.md §3).
        budget: checkpoint memory budget shared by the bucket's vbuckets.
        checkpoint_max_bytes: see `CheckpointManager`.
        replica_cursors_droppable: see `CheckpointManager`.
        flush_batch_bytes_max: see `Flusher`.
    """

    def __init__(
        self,
        store: Store,
        vb: int,
        *,
        state: VBucketState = VBucketState.ACTIVE,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        budget: MemoryBudget | None = None,
        checkpoint_max_bytes: int = limits.CHECKPOINT_MAX_BYTES_DEFAULT,
        replica_cursors_droppable: bool = False,
        flush_batch_bytes_max: int = limits.FLUSH_BATCH_BYTES_MAX,
    ) -> None:
        assert 0 <= vb < limits.VBUCKETS_MAX, vb
        self._store = store
        self._vb = vb
        self._clock = clock
        self._rng = rng
        self._state, self._failover_log = self._recover_meta(state)
        self._high_seqno = store.high_seqno(vb)
        self.manager = CheckpointManager(
            vb,
            high_seqno=self._high_seqno,
            budget=budget,
            checkpoint_max_bytes=checkpoint_max_bytes,
            replica_cursors_droppable=replica_cursors_droppable,
        )
        self.flusher = Flusher(self.manager, store, batch_bytes_max=flush_batch_bytes_max)
        self._checkpoint_max_bytes = checkpoint_max_bytes
        self._replica_cursors_droppable = replica_cursors_droppable
        self._flush_batch_bytes_max = flush_batch_bytes_max
        self._last_cas = self._recover_cas()
        # key -> its pending SyncWrite prepare, oldest first (insertion order = seqno order).
        pending = {record.key: _prepare_of(record, level) for level, record in store.prepares(vb)}
        self._role: Role = role_for(self._state, self, pending)
        assert self.manager.high_seqno == self._high_seqno, (self.manager, self._high_seqno)
        if pending and self._state.is_active:
            self._role.commit_all_pending()

    def __repr__(self) -> str:
        return (
            f"VBucket({self._vb}, {self._state.value}, high_seqno={self._high_seqno}, "
            f"persisted_seqno={self.persisted_seqno}, vb_uuid={self.vb_uuid})"
        )

    # -- state ----------------------------------------------------------------------------------

    @property
    def vb(self) -> int:
        """The vbucket id."""
        return self._vb

    @property
    def state(self) -> VBucketState:
        """Current state."""
        return self._state

    @property
    def role(self) -> Role:
        """The role serving the current state (tests and stats; operations go through here)."""
        return self._role

    @property
    def high_seqno(self) -> int:
        """Seqno of the last write taken (queued, maybe not yet persisted)."""
        return self._high_seqno

    @property
    def persisted_seqno(self) -> int:
        """Seqno of the last write committed to the store."""
        return self.flusher.persisted_seqno

    @property
    def purge_seqno(self) -> int:
        """Highest seqno of a tombstone compaction removed."""
        return self._store.purge_seqno(self._vb)

    @property
    def failover_log(self) -> FailoverLog:
        """The failover log (the producer's rollback decisions read it; do not change it)."""
        return self._failover_log

    @property
    def vb_uuid(self) -> int:
        """The current branch's uuid: the newest failover entry's."""
        return self._failover_log.latest[0]

    def set_state(self, state: VBucketState) -> Transition | None:
        """Change state, persisted at once, swapping in the new state's role and performing
        this vbucket's effects of the edge (`vbucket_state.TRANSITIONS`): a new failover branch,
        locks dropped (they leave with the active role), prepares committed. The node's effects
        (streams, replication, waiters) are the caller's: call this through
        `ServerContext.set_vbucket_state`, the one entry for a state change.

        Returns:
            The edge taken, or None when `state` is the current state.
        """
        if state is self._state:
            return None
        edge = transition(self._state, state)
        if Effect.NEW_FAILOVER_ENTRY in edge.effects:
            self._failover_log.create_entry(self._high_seqno)
        old = self._role
        self._state = state
        self._role = role_for(state, self, old.pending)
        self._persist_meta()
        if Effect.PREPARES_COMMITTED in edge.effects and self._role.pending:
            self._role.commit_all_pending()
        # Paired checks: a new role serves the new state (the old one is unreachable); locks
        # held before are gone only on an edge that drops them, and the new role holds none.
        assert serves(self._role, state) and self._role is not old, (old, self._role, state)
        assert Effect.LOCKS_DROPPED in edge.effects or old.locks_held == 0, (edge, old)
        assert self._role.locks_held == 0, self._role
        assert Effect.NEW_FAILOVER_ENTRY not in edge.effects or (
            self._failover_log.latest[1] <= self._high_seqno
        ), (self._failover_log.latest, self._high_seqno)
        return edge

    # -- SyncWrites (the active role commits and aborts, the replica role keeps) ----------------

    @property
    def pending_prepares(self) -> list[SyncItem]:
        """Pending SyncWrite prepares, oldest first."""
        return list(self._role.pending.values())

    @property
    def has_pending_prepares(self) -> bool:
        """Whether any SyncWrite prepare is pending (cheaper than `pending_prepares`)."""
        return bool(self._role.pending)

    def pending_prepare(self, key: bytes) -> SyncItem | None:
        """The pending prepare of `key`, if any."""
        pending = self._role.pending
        return pending.get(key) if pending else None

    def commit(self, key: bytes) -> MutationResult:
        """Commit the pending prepare of `key`: its document at a new seqno, with its CAS.

        Raises:
            NotMyVbucketError: not active.
            KeyNotFoundError: no prepare of `key` is pending.
            CheckpointMemoryFullError: checkpoint memory is full; the prepare stays pending.
        """
        return self._role.commit(key)

    def commit_many(self, keys: Sequence[bytes]) -> list[MutationResult | StatusError]:
        """`commit` of each of `keys` (distinct) in order, queued as one run: one result per
        key, KeyNotFoundError for a key with no prepare pending. When checkpoint memory runs
        out part of the way the list stops before the first commit not queued (that key and
        the ones after it stay as they were: call again later).

        Raises:
            NotMyVbucketError: not active.
            CheckpointMemoryFullError: not even the first commit fits; nothing changed.
        """
        return self._role.commit_many(keys)

    def abort(self, key: bytes) -> int:
        """Abort the pending prepare of `key` (it never becomes visible); return the abort's
        seqno, or 0 when no prepare of `key` was pending.

        Raises:
            NotMyVbucketError: not active.
            CheckpointMemoryFullError: checkpoint memory is full; the prepare stays pending.
        """
        return self._role.abort(key)

    def commit_all_pending(self) -> int:
        """Commit every pending prepare (a vbucket that is or became active with prepares
        pending); return how many. A prepare whose key has a newer committed version (an
        abort lost in a crash, the key written again) is aborted: never resurrected over a
        newer value. Checkpoint memory full leaves the rest pending for a later call.

        Raises:
            NotMyVbucketError: not active.
        """
        return self._role.commit_all_pending()

    # -- writes (the active role's) -------------------------------------------------------------

    def set(
        self,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        cas: int = 0,
        level: int = 0,
    ) -> MutationResult:
        """Store `value` under `key`; with a non-zero `cas`, only if it is the current CAS.

        Args:
            expiry: absolute seconds since the epoch after which the document expires; 0 never.
            level: a durability level (SyncWrite): queue a prepare, committed later (`commit`).

        Raises:
            NotMyVbucketError: not active.
            KeyNotFoundError: `cas` given and the key does not exist.
            KeyExistsError: `cas` given and it differs from the key's CAS.
            CheckpointMemoryFullError: checkpoint memory is full (TMPFAIL).
            SyncWriteInProgressError: a durable write of the key is pending.
        """
        return self._role.set(
            key, value, flags=flags, expiry=expiry, datatype=datatype, cas=cas, level=level
        )

    def set_many(
        self,
        keys: Sequence[bytes],
        values: Sequence[bytes],
        flags: Sequence[int],
        expiries: Sequence[int],
        datatypes: Sequence[int],
        *,
        lookup: RunLookup | None = None,
        fields_checked: bool = False,
        level: int = 0,
    ) -> SetManyResult:
        """`set` without CAS of each write, in order, as a received batch of SETs: the stored
        versions of the keys are looked up in one read transaction, and the writes are queued
        as one run (`CheckpointManager.queue_run`). A write that `set` would refuse gets its
        error in the result; the others still apply. A key found expired gets its expiration
        queued first, as `set` does; when checkpoint memory runs out part of the way, the
        writes past that point get CheckpointMemoryFullError (TMPFAIL) and take no seqno.

        A clean run — no key locked, pending or found expired, every field in range (a key
        may repeat: its later write finds the earlier) — is built with one C-level pass per
        column; anything else goes write by write (`ActiveRole._set_one_by_one`). `expiries`
        are absolute, as `set`'s.

        `lookup`: the keys' versions, looked up by the caller with `lookup_memory` and a store
        lookup of the rest since (a bucket looks up every vbucket's keys at once).
        `fields_checked`: the caller checked every field is within limits
        (`fields_in_range`); the clean path does not check again.
        `level`: a durability level (SyncWrites): each write queues a prepare, as `set` with
        that level does (a key written twice in the run: SyncWriteInProgressError for the
        second, its first prepare is pending); a clean run is queued with one
        `CheckpointManager.queue_prepares`.
        """
        return self._role.set_many(
            keys, values, flags, expiries, datatypes, lookup=lookup,
            fields_checked=fields_checked, level=level,
        )  # fmt: skip

    def set_single(
        self, key: bytes, value: bytes, flags: int, expiry: int, datatype: int, *,
        found: Item | None, stored: Mapping[bytes, Record | None], fields_checked: bool,
    ) -> SetManyResult | None:  # fmt: skip
        """`set_many` of one plain write (no CAS, no durability) without building a run: what
        a bucket's window of a few SETs over many vbuckets gives most vbuckets.

        Args:
            key, value, flags, expiry, datatype: the write, as `set` takes it.
            found: the key's newest version in memory (`lookup_memory`), None if none.
            stored: the store's lookup, holding `key` when `found` is None.
            fields_checked: the caller checked the fields (`fields_in_range`).

        Returns:
            What `set_many` of the write answers (a memory-full refusal with seqno and CAS
            0), or None when the write is not a clean one of an active (its key locked or
            pending, found expired, a field out of range, not active): then ask `set_many`,
            which answers it as `set` would.
        """
        return self._role.set_single(
            key, value, flags, expiry, datatype, found=found, stored=stored,
            fields_checked=fields_checked,
        )  # fmt: skip

    def lookup_memory(self, keys: Sequence[bytes]) -> tuple[list[Item | None], list[bytes]]:
        """The newest version of each key still in memory, and the keys memory has none of
        (for the store to look up): the first half of the lookup `set_many` needs."""
        if len(keys) == 1:  # most of a small window's vbuckets: `find` costs a third
            key = keys[0]
            item = self.manager.find(key)
            return [item], [key] if item is None else []
        in_memory = self.manager.find_many(keys)
        if in_memory.count(None) == len(keys):
            return in_memory, list(keys)
        return in_memory, [key for key, item in zip(keys, in_memory, strict=True) if item is None]

    def add(
        self,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        level: int = 0,
    ) -> MutationResult:
        """Store `value` only if `key` does not exist.

        Raises:
            KeyExistsError: the key exists. Others as `set`.
        """
        return self._role.add(
            key, value, flags=flags, expiry=expiry, datatype=datatype, level=level
        )

    def replace(
        self,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        cas: int = 0,
        level: int = 0,
    ) -> MutationResult:
        """Store `value` only if `key` exists (and, with `cas`, has that CAS).

        Raises:
            KeyNotFoundError: the key does not exist. Others as `set`.
        """
        return self._role.replace(
            key, value, flags=flags, expiry=expiry, datatype=datatype, cas=cas, level=level
        )

    def delete(self, key: bytes, *, cas: int = 0, level: int = 0) -> MutationResult:
        """Delete `key` (queue a tombstone); with a non-zero `cas`, only if it matches.

        Raises:
            NotMyVbucketError: not active.
            KeyNotFoundError: the key does not exist.
            KeyExistsError: `cas` given and it differs from the key's CAS.
            CheckpointMemoryFullError: checkpoint memory is full (TMPFAIL).
        """
        return self._role.delete(key, cas=cas, level=level)

    # -- replication (the replica role's) -------------------------------------------------------

    def queue_replicated(self, item: Item) -> None:
        """Take an item streamed from the active (replica or pending state), seqno and CAS as is.

        Raises:
            NotMyVbucketError: the vbucket is active or dead.
            InvalidArgumentsError: the item is outside the snapshot being received, or a field
                is out of range.
            CheckpointMemoryFullError: checkpoint memory is full (the replica stream pauses).
        """
        self._role.queue_replicated(item)

    def queue_replicated_run(self, items: Sequence[Item]) -> int:
        """`queue_replicated` for a run of plain items (type `Item`: mutations and tombstones,
        seqnos rising), checked as a run and queued with one `CheckpointManager.queue_run`.

        Returns:
            How many were queued: all, unless checkpoint memory ran out part of the way (the
            replica stream holds the rest back and pauses).

        Raises:
            NotMyVbucketError, InvalidArgumentsError, CheckpointMemoryFullError: as
                `queue_replicated`; on a bad item nothing of the run is queued.
        """
        return self._role.queue_replicated_run(items)

    def queue_replicated_columns(self, run: ReplicatedColumns) -> int:
        """`queue_replicated_run` for a run of mutations as columns (`ReplicatedColumns`: the
        slices of a received batch), checked a column at a time.

        Returns:
            How many were queued (the first ones; memory may run out part of the way).

        Raises:
            NotMyVbucketError, InvalidArgumentsError, CheckpointMemoryFullError: as
                `queue_replicated_run`.
        """
        return self._role.queue_replicated_columns(run)

    def replica_commit(self, key: bytes, prepared_seqno: int, commit_seqno: int) -> None:
        """DCP_COMMIT from the active: commit the pending prepare of `key` at `commit_seqno`.

        Raises:
            NotMyVbucketError: not a replica.
            InvalidArgumentsError: no prepare of `key` at `prepared_seqno` is pending here
                (the active sends DCP_COMMIT only to a replica that holds the prepare).
            CheckpointMemoryFullError: as `queue_replicated`.
        """
        self._role.replica_commit(key, prepared_seqno, commit_seqno)

    def queue_replicated_prepares(self, prepares: Sequence[SyncItem]) -> int:
        """`queue_replicated` for a run of DCP_PREPAREs (seqnos rising), queued as one run.

        Returns:
            How many were queued (the first ones; memory may run out part of the way).

        Raises:
            NotMyVbucketError, InvalidArgumentsError, CheckpointMemoryFullError: as
                `queue_replicated`; on a bad prepare the ones before it are queued (as one
                call each would), memory full only if not even the first fits.
        """
        return self._role.queue_replicated_prepares(prepares)

    def replica_commit_many(self, commits: Sequence[tuple[bytes, int, int]]) -> int:
        """`replica_commit` for a run of DCP_COMMITs: (key, prepared seqno, commit seqno)
        each, commit seqnos rising, queued as one run.

        Returns:
            How many were queued (the first ones; memory may run out part of the way).

        Raises:
            NotMyVbucketError, InvalidArgumentsError, CheckpointMemoryFullError: as
                `replica_commit`; on a bad commit the ones before it are queued.
        """
        return self._role.replica_commit_many(commits)

    def replica_snapshot(self, snap_start: int, snap_end: int) -> None:
        """The active's snapshot marker: items up to `snap_end` follow, in their own checkpoint.

        Raises:
            NotMyVbucketError: the vbucket is not a replica.
            InvalidArgumentsError: the range is empty or ends below what is held.
        """
        self._role.replica_snapshot(snap_start, snap_end)

    def adopt_failover_log(self, entries: list[tuple[int, int]]) -> None:
        """Take the active's failover log (a replica's history is its active's), persisted.

        Raises:
            NotMyVbucketError: the vbucket is not a replica.
        """
        self._role.adopt_failover_log(entries)

    def rollback(self, seqno: int) -> int:
        """Truncate a replica to `seqno` before it takes anything past it (KAFKA-14704: truncate
        first), or to 0 when the store cannot rebuild the state at `seqno` (Store.rollback).

        Everything queued is flushed first, then the store truncates and the mutation manager
        starts afresh at the rollback point (its wakeup kept, so waiters still hear of writes).

        Returns:
            The seqno the vbucket now ends at.

        Raises:
            NotMyVbucketError: the vbucket is not a replica.
            StorageError: the flush or the truncation failed; nothing was truncated.
        """
        return self._role.rollback(seqno)

    def replica_request_range(self) -> tuple[int, int, int]:
        """``(start, snap_start, snap_end)`` a replica presents when it requests its stream.

        Inside a snapshot it holds only partly — being received, or persisted partly before a
        crash — the range is that snapshot's, so the active can tell whether history diverged
        inside it; else the vbucket holds a whole snapshot ending at its high seqno. A read of
        what the copy holds, answered in any state.
        """
        high = self._high_seqno
        end = self.manager.snapshot_end
        if end > high:
            return high, min(self.manager.open_checkpoint.snap_start, high), end
        meta = self._store.vbucket_meta(self._vb)
        if meta is not None and meta.high_seqno == high and meta.snap_end > high:
            return high, min(meta.snap_start, high), meta.snap_end
        return high, high, high

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: bytes) -> Document | None:
        """The current version of `key`, or None if missing, deleted or expired.

        Raises:
            NotMyVbucketError: the vbucket is dead (replicas serve reads, as replica reads do).
        """
        role = self._role
        role.check_readable()
        current = self.current(key)
        if current is None:
            return None
        return Document(
            key,
            current.value,
            role.visible_cas(key, current.cas),
            current.flags,
            current.expiry,
            current.datatype,
            current.seqno,
            current.rev_seqno,
        )

    def get_meta(self, key: bytes) -> DocumentMeta | None:
        """GET_META: the newest version's metadata, a tombstone's included (deleted, its
        delete time as expiry); None when the key has no version at all (or it was purged).

        Raises:
            NotMyVbucketError: the vbucket is dead.
        """
        role = self._role
        role.check_readable()
        current = self.current(key)  # queues the expiration of an expired document
        if current is not None:
            return DocumentMeta(
                False,
                current.flags,
                current.expiry,
                current.rev_seqno,
                current.datatype,
                role.visible_cas(key, current.cas),
            )
        found: Item | Record | None = self.manager.find(key)
        if found is None:
            found = self._store.get(self._vb, key)
        if found is None:
            return None
        # A tombstone; or an expired document whose expiration could not be queued yet.
        expiry = found.delete_time if found.op is not Op.MUTATION else found.expiry
        return DocumentMeta(True, found.flags, expiry, found.rev_seqno, found.datatype, found.cas)

    # -- the SDK's KV surface: locks, touch (the active role's) --------------------------------

    def get_locked(self, key: bytes, lock_s: float) -> Document:
        """GET_LOCKED: lock `key` for `lock_s` seconds; the document returned carries the lock's
        CAS (a new one from the CAS clock), the one a write or UNLOCK must present. Nothing is
        written: a lock is not a change and is not streamed.

        Raises:
            NotMyVbucketError: not active.
            KeyNotFoundError: missing, deleted or expired.
            LockedError: already locked.
            TemporaryFailureError: this vbucket holds ITEM_LOCKS_PER_VBUCKET_MAX locks.
        """
        return self._role.get_locked(key, lock_s)

    def unlock(self, key: bytes, cas: int) -> None:
        """UNLOCK_KEY: end the lock whose CAS is `cas` (the document keeps showing that CAS).

        Raises:
            NotMyVbucketError: not active.
            KeyNotFoundError: missing, deleted or expired.
            NotLockedError: not locked (never, or the lock timed out).
            LockedError: locked with another CAS.
        """
        self._role.unlock(key, cas)

    def touch(self, key: bytes, expiry: int, *, cas: int = 0) -> MutationResult:
        """TOUCH / GAT: a new version of `key` with the same value and a new `expiry` (absolute
        seconds, 0 never): a change with its own seqno and CAS, streamed like any other.

        Raises:
            NotMyVbucketError: not active.
            KeyNotFoundError: missing, deleted or expired.
            LockedError: locked, and `cas` is not the lock's.
            KeyExistsError: `cas` given and it differs from the key's CAS.
            CheckpointMemoryFullError: checkpoint memory is full (TMPFAIL).
        """
        return self._role.touch(key, expiry, cas=cas)

    def check_write(self, key: bytes, cas: int) -> None:
        """Refuse, before a read-modify-write computes its new value, what the write would be
        refused for: LOCKED, then (with `cas`) KEY_ENOENT or KEY_EEXISTS.

        Raises:
            NotMyVbucketError, LockedError, KeyNotFoundError, KeyExistsError: as `set`.
        """
        self._role.check_write(key, cas)

    def expire_if_due(self, key: bytes) -> bool:
        """Queue an EXPIRATION for `key` if its newest version has expired (the expiry pager).

        The same path as lazy expiry on access (`current`), on this vbucket's clock: a key
        rewritten or deleted since the caller looked is left alone.

        Returns:
            True if an EXPIRATION was queued; False if the key is live, missing, already a
            tombstone, the vbucket is not active, or checkpoint memory is full (the next pass
            or access retries).
        """
        return self._role.expire_if_due(key)

    # -- streams, flushing, closing -------------------------------------------------------------

    def stream(
        self,
        name: str,
        start_seqno: int,
        *,
        kind: CursorKind = CursorKind.STREAM,
        droppable: bool | None = None,
        end_seqno: int | None = None,
    ) -> StreamReader:
        """A reader of every change after `start_seqno` (memory or disk, it decides); disk
        snapshots stop at `end_seqno` when given; `droppable` overrides the kind's default."""
        return StreamReader(
            self.manager,
            self._store,
            name=name,
            start_seqno=start_seqno,
            kind=kind,
            droppable=droppable,
            end_seqno=end_seqno,
        )

    def flush(self) -> int:
        """Write everything queued to the store; return the items written."""
        return self.flusher.flush()

    def close(self) -> None:
        """Flush and free checkpoint memory (node stopping, vbucket moved away).

        Raises:
            StorageError: the flush failed; nothing is freed (call `release` to give up).
        """
        self.flusher.flush()
        self.manager.close()

    def release(self) -> None:
        """Free checkpoint memory without flushing (after a flush that failed at shutdown)."""
        self.manager.close()

    # -- the port the roles reach this vbucket through (port.VBucketCore) ------------------------

    @property
    def store(self) -> Store:
        """The bucket's store (a role's lookups and the replica's rollback)."""
        return self._store

    @property
    def last_cas(self) -> int:
        """The highest CAS handed out or taken."""
        return self._last_cas

    def now(self) -> float:
        """Wall-clock seconds on this vbucket's clock."""
        return self._clock()

    def next_cas(self) -> int:
        """The hybrid clock's next CAS: now in nanoseconds, but above every CAS so far."""
        now_ns = int(self._clock() * NS_PER_S)
        cas = max(now_ns, self._last_cas + 1)
        assert 0 < cas <= limits.SEQNO_MAX, cas  # CAS is a u64 like a seqno
        return cas

    def advanced(self, seqno: int, cas: int) -> None:
        """A role queued everything up to `seqno` and handed out (or took) `cas`."""
        assert seqno >= self._high_seqno, (seqno, self._high_seqno)
        self._high_seqno = seqno
        if cas > self._last_cas:
            self._last_cas = cas
        assert self.manager.high_seqno == seqno, (self.manager.high_seqno, seqno)

    def current(
        self, key: bytes, stored: dict[bytes, Record | None] | None = None
    ) -> Item | Record | None:
        """The live (not deleted, not expired) newest version of `key`, memory first; then
        `stored` if it holds the key (looked up earlier in this loop step for keys not in
        memory; a commit running meanwhile on the writer thread cannot change them, as its
        items stay in memory until the loop accounts for it), else the store. An expired one
        reads as missing and the role decides whether to queue its expiration."""
        found: Item | Record | None = self.manager.find(key)
        if found is None:
            if stored is None:
                stored = self._stored_ahead
            if stored is not None and key in stored:
                found = stored[key]
            else:
                found = self._store.get(self._vb, key)
        if found is None or found.op is not Op.MUTATION:
            return None
        if found.expiry and found.expiry <= self._clock():
            self._role.on_expired(found)
            return None
        return found

    # Records of keys memory had none of, read ahead in one store transaction for the requests
    # of this loop step (`read_ahead`); None: every `current` reads the store itself.
    _stored_ahead: dict[bytes, Record | None] | None = None

    def read_ahead(
        self, stored: dict[bytes, Record | None] | None
    ) -> dict[bytes, Record | None] | None:
        """Let `current` take `stored` (keys memory had none of, looked up in this loop step:
        the invariant `current` states for its `stored`) until the next call; None ends it.
        Returns what it replaces, for the caller to put back (windows may nest)."""
        previous, self._stored_ahead = self._stored_ahead, stored
        return previous

    def replace_failover_log(self, entries: list[tuple[int, int]]) -> None:
        """Take `entries` as the failover log, persisted at once."""
        self._failover_log = FailoverLog(entries, rng=self._rng)
        self._persist_meta()

    def truncate_to(self, seqno: int) -> int:
        """Flush, truncate the store to `seqno` (or 0 when it cannot rebuild that point) and
        restart the mutation manager there, its wakeup kept; return the point."""
        self.flusher.flush()
        point = self._store.rollback(self._vb, seqno)
        old = self.manager
        old.close()
        self.manager = CheckpointManager(
            self._vb,
            high_seqno=point,
            budget=old.budget,
            checkpoint_max_bytes=self._checkpoint_max_bytes,
            replica_cursors_droppable=self._replica_cursors_droppable,
            wakeup=old.wakeup,
        )
        self.flusher = Flusher(
            self.manager, self._store, batch_bytes_max=self._flush_batch_bytes_max
        )
        self._high_seqno = point
        assert self.persisted_seqno == point, (self.persisted_seqno, point)
        return point

    # -- recovery and metadata ------------------------------------------------------------------

    def _recover_meta(self, state: VBucketState) -> tuple[VBucketState, FailoverLog]:
        meta = self._store.vbucket_meta(self._vb)
        if meta is None:
            log = FailoverLog.fresh(rng=self._rng)
            self._state, self._failover_log = state, log
            self._persist_meta()
            return state, log
        recovered = meta.state
        if meta.failover_log:
            log = FailoverLog(meta.failover_log, rng=self._rng)
        else:
            log = FailoverLog.fresh(rng=self._rng)
        unclean = not self._store.was_clean_shutdown
        if recovered.is_active and (unclean or not meta.failover_log):
            # Writes acknowledged before the crash but not persisted are lost: a new branch
            # makes consumers that saw them roll back (kv_engine warmup does the same). It
            # starts at the last persisted snapshot's end when that snapshot is whole, else at
            # its start (dcp-wire.md §9.4): a partial snapshot is not a consistent point.
            whole = meta.high_seqno == meta.snap_end
            log.create_entry(meta.high_seqno if whole else min(meta.snap_start, meta.high_seqno))
        if log.entries != meta.failover_log:
            self._state, self._failover_log = recovered, log
            self._persist_meta()
        return recovered, log

    def _recover_cas(self) -> int:
        high = self._high_seqno
        first = max(1, high - _CAS_RECOVERY_RECORDS_MAX + 1)
        last_cas = 0
        if high >= first:
            for record in self._store.scan(self._vb, first, high):
                last_cas = max(last_cas, record.cas)
        return last_cas

    def _persist_meta(self) -> None:
        with self._store.write_batch() as batch:
            batch.set_vbucket_meta(
                self._vb,
                state=self._state,
                failover_log=self._failover_log.entries,
            )
        meta = self._store.vbucket_meta(self._vb)
        assert meta is not None, self._vb
        assert meta.state is self._state, (meta.state, self._state)


def _prepare_of(record: Record, level: int) -> SyncItem:
    """The pending prepare a kept record (Store.prepares) stands for."""
    return SyncItem(
        record.seqno, record.key, Op.PREPARE, Op.DELETION if record.deleted else Op.MUTATION,
        record.value, record.cas, record.flags, record.expiry, record.datatype,
        record.rev_seqno, record.delete_time, level=level,
    )  # fmt: skip
