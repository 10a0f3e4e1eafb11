"""A vbucket: seqno counter, CAS clock, state, failover log, and its mutation manager.

Contract:
- Writes (`set`, `add`, `replace`, `delete`) are taken only while ACTIVE; each gets the next seqno
  (strictly increasing, no gaps unless a write is refused before its seqno is used) and a CAS
  from a hybrid clock (wall-clock nanoseconds, but always above every CAS handed out or
  recovered, so CAS values increase even if the clock steps back). A write is queued into the
  checkpoint manager; it is durable once the flusher has written it (`persisted_seqno`,
  `flusher.wait_persisted`). When checkpoint memory is full the write is refused with
  `CheckpointMemoryFullError` (a TMPFAIL) and nothing changes.
- Operating errors are the wire's `StatusError` subclasses (`changefeed.protocol.errors`): one
  hierarchy from the mutation manager to the client, each class carrying its status and
  whether a retry helps, so no layer translates another's errors.
- Reads (`get`) look at memory first (the newest version of a key still in a checkpoint), then the
  store. A document whose expiry has passed reads as missing and, on an active vbucket, an
  EXPIRATION is queued for it (lazy expiry, as kv_engine does on access).
- Becoming ACTIVE from another state adds a failover entry at the high seqno (a new history
  branch, dcp-wire.md §9.4), persisted with the state at once. After an unclean shutdown an
  active vbucket also adds one on recovery: acknowledged writes that were not yet persisted are
  gone, and consumers that saw them must be rolled back.
- Construction recovers from the store: state, failover log, high seqno and snapshot range; a
  vbucket the store does not know is created (state persisted, fresh failover log).
- Replica/pending vbuckets take items from their active with `queue_replicated` (seqno and CAS
  as given).
- SyncWrites (durable writes): a write with a durability `level` queues a PREPARE (`SyncItem`)
  that reads and application streams do not see; the key is then refused to other writers
  (SYNC_WRITE_IN_PROGRESS) until `commit` queues the committed document at a new seqno (same
  CAS) or `abort` ends it. When to commit is the server's decision (server/sync_writes.py). A
  replica keeps the prepares it receives; a later committed change or an abort of the key ends
  one. Pending prepares survive a restart (the store keeps them); a vbucket that is or becomes
  ACTIVE with prepares still pending commits them — any of them may have been acknowledged as
  durable, and committing one that was not is an allowed outcome of an ambiguous write.

Not here: the wire (server/), streams (producer/ reads through `stream()`), replica rollback and
the replica's own snapshot ranges (cluster/), compaction scheduling. Not thread-safe: one event
loop owns a vbucket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final, NamedTuple

from changefeed import limits
from changefeed.checkpoint import (
    CheckpointManager,
    CheckpointMemoryFullError,
    CursorKind,
    Flusher,
    Item,
    MemoryBudget,
    StreamReader,
    SyncItem,
)
from changefeed.failover import FailoverLog
from changefeed.protocol.errors import (
    InvalidArgumentsError,
    KeyExistsError,
    KeyNotFoundError,
    LockedError,
    NotLockedError,
    NotMyVbucketError,
    StatusError,
    SyncWriteInProgressError,
    TemporaryFailureError,
)
from changefeed.protocol.kv import MutationResult
from changefeed.protocol.kv_ops import LOCKED_CAS, DocumentMeta
from changefeed.storage import Op, Record, Store
from changefeed.storage.record import DELETION_EXTRAS_SIZE, MUTATION_EXTRAS_SIZE
from changefeed.vbucket_state import Effect, Transition, VBucketState, transition

__all__ = ["Document", "MutationResult", "SetManyResult", "VBucket", "VBucketState"]

# Records read back at recovery to find the highest CAS handed out before (bounded, O(1)):
# the hybrid clock only needs it when the wall clock stepped back across the restart.
_CAS_RECOVERY_RECORDS_MAX: Final = 1024
_NS_PER_S: Final = 1_000_000_000
_MUTATION: Final = Op.MUTATION
# A run of SETs as `set_many` takes it: keys, values, flags, expiries, datatypes.
SetColumns = tuple[Sequence[bytes], Sequence[bytes], Sequence[int], Sequence[int], Sequence[int]]
_U32_MAX: Final = 0xFFFF_FFFF
_DATATYPE_MASK: Final = 0x07  # dcp-wire.md §1.4: JSON | Snappy | XATTR
_U64_MAX: Final = limits.SEQNO_MAX  # CAS is a u64 like a seqno
_KEY_SIZE_MAX: Final = limits.STORED_KEY_SIZE_MAX
_VALUE_SIZE_MAX: Final = limits.VALUE_SIZE_MAX
_EXTRAS_SIZE: Final = {
    Op.MUTATION: MUTATION_EXTRAS_SIZE,
    Op.DELETION: DELETION_EXTRAS_SIZE,
    Op.EXPIRATION: DELETION_EXTRAS_SIZE,
}  # an item body's extras, by op (checkpoint/item.py)


class RunLookup(NamedTuple):
    """What a run of writes to one vbucket finds before it applies: the newest version of
    each write's key in memory (`VBucket.lookup_memory`), and the stored version, or None, of
    every key memory had none of."""

    in_memory: list[Item | None]
    stored: Mapping[bytes, Record | None]


def fields_in_range(writes: SetColumns) -> bool:
    """Every write's key, value, flags, expiry and datatype are within `set`'s limits (one
    C-level pass per column)."""
    keys, values, flags, expiries, datatypes = writes
    key_sizes = list(map(len, keys))
    return (
        min(key_sizes) > 0
        and max(key_sizes) <= _KEY_SIZE_MAX
        and max(map(len, values)) <= _VALUE_SIZE_MAX
        and min(flags) >= 0
        and max(flags) <= _U32_MAX
        and min(expiries) >= 0
        and max(expiries) <= _U32_MAX
        and min(datatypes) >= 0
        and max(datatypes) <= _DATATYPE_MASK
    )


class SetManyResult(NamedTuple):
    """`VBucket.set_many`'s answers as columns (no object per write): write i got
    `seqnos[i]` and `cases[i]` on `vb_uuid`, unless `errors` holds i (its seqno and CAS
    are then 0)."""

    vb: int
    vb_uuid: int
    seqnos: Sequence[int]
    cases: Sequence[int]
    errors: dict[int, StatusError]

    def results(self) -> list[MutationResult | StatusError]:
        """One answer per write, as `set` gives them (tests and slow paths)."""
        return [
            self.errors[index]
            if index in self.errors
            else MutationResult(vbucket=self.vb, seqno=seqno, cas=cas, vb_uuid=self.vb_uuid)
            for index, (seqno, cas) in enumerate(zip(self.seqnos, self.cases, strict=True))
        ]


@dataclasses.dataclass(frozen=True, slots=True)
class Document:
    """The current version of a key as `get` returns it (never a tombstone)."""

    key: bytes
    value: bytes
    cas: int
    flags: int
    expiry: int
    datatype: int
    seqno: int
    rev_seqno: int


@dataclasses.dataclass(slots=True)
class _Lock:
    """A GET_LOCKED lock on the current version of a key (memory only, as kv_engine's).

    Attributes:
        cas: the CAS the holder got. While locked, a write needs it; once unlocked (or timed
            out) the document shows it as its CAS until rewritten, as kv_engine's does.
        until: wall-clock seconds (the vbucket's clock) when the lock ends; 0 once unlocked.
    """

    cas: int
    until: float


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
        self._locks: dict[bytes, _Lock] = {}  # GET_LOCKED; any write of the key drops its entry
        # key -> its pending SyncWrite prepare, oldest first (insertion order = seqno order).
        self._pending: dict[bytes, SyncItem] = {}
        for level, record in store.prepares(vb):
            self._pending[record.key] = _prepare_of(record, level)
        assert self.manager.high_seqno == self._high_seqno, (self.manager, self._high_seqno)
        if self._pending and self._state is VBucketState.ACTIVE:
            self.commit_all_pending()

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
        """Change state, persisted at once, performing this vbucket's effects of the edge
        (`vbucket_state.TRANSITIONS`): a new failover branch, locks dropped, prepares
        committed. The node's effects (streams, replication, waiters) are the caller's: call
        this through `ServerContext.set_vbucket_state`, the one entry for a state change.

        Returns:
            The edge taken, or None when `state` is the current state.
        """
        if state is self._state:
            return None
        edge = transition(self._state, state)
        if Effect.NEW_FAILOVER_ENTRY in edge.effects:
            self._failover_log.create_entry(self._high_seqno)
        if Effect.LOCKS_DROPPED in edge.effects:
            self._locks.clear()
        self._state = state
        self._persist_meta()
        if Effect.PREPARES_COMMITTED in edge.effects and self._pending:
            self.commit_all_pending()
        assert self._state is state, (self._state, state)
        assert Effect.LOCKS_DROPPED not in edge.effects or not self._locks, self._locks
        assert Effect.NEW_FAILOVER_ENTRY not in edge.effects or (
            self._failover_log.latest[1] <= self._high_seqno
        ), (self._failover_log.latest, self._high_seqno)
        return edge

    # -- SyncWrites -----------------------------------------------------------------------------

    @property
    def pending_prepares(self) -> list[SyncItem]:
        """Pending SyncWrite prepares, oldest first."""
        return list(self._pending.values())

    def pending_prepare(self, key: bytes) -> SyncItem | None:
        """The pending prepare of `key`, if any."""
        return self._pending.get(key) if self._pending else None

    def commit(self, key: bytes) -> MutationResult:
        """Commit the pending prepare of `key`: its document at a new seqno, with its CAS.

        Raises:
            NotMyVbucketError: not active.
            KeyNotFoundError: no prepare of `key` is pending.
            CheckpointMemoryFullError: checkpoint memory is full; the prepare stays pending.
        """
        self._require_active()
        prepare = self._pending.get(key)
        if prepare is None:
            raise KeyNotFoundError(f"vb {self._vb}: no durable write of {key[:64]!r} pending")
        seqno = self._high_seqno + 1
        self.manager.queue(prepare.committed(seqno))
        del self._pending[key]
        self._high_seqno = seqno
        if self._locks:
            self._locks.pop(key, None)
        self._retain_pending()
        return MutationResult(vbucket=self._vb, seqno=seqno, cas=prepare.cas, vb_uuid=self.vb_uuid)

    def abort(self, key: bytes) -> int:
        """Abort the pending prepare of `key` (it never becomes visible); return the abort's
        seqno, or 0 when no prepare of `key` was pending.

        Raises:
            NotMyVbucketError: not active.
            CheckpointMemoryFullError: checkpoint memory is full; the prepare stays pending.
        """
        self._require_active()
        prepare = self._pending.get(key)
        if prepare is None:
            return 0
        seqno = self._high_seqno + 1
        self.manager.queue(
            SyncItem(
                seqno,
                key,
                Op.ABORT,
                Op.DELETION,
                b"",
                prepare.cas,
                prepared_seqno=prepare.seqno,
            )
        )
        del self._pending[key]
        self._high_seqno = seqno
        self._retain_pending()
        return seqno

    def commit_all_pending(self) -> int:
        """Commit every pending prepare (a vbucket that is or became active with prepares
        pending); return how many. A prepare whose key has a newer committed version (an
        abort lost in a crash, the key written again) is aborted: never resurrected over a
        newer value. Checkpoint memory full leaves the rest pending for a later call."""
        committed = 0
        for key, prepare in list(self._pending.items()):
            newest = self.manager.find(key) or self._store.get(self._vb, key)
            try:
                if newest is not None and newest.seqno > prepare.seqno:
                    self.abort(key)
                    continue
                self.commit(key)
            except CheckpointMemoryFullError:
                break
            committed += 1
        return committed

    def _retain_pending(self) -> None:
        first = next(iter(self._pending.values()), None)
        self.manager.retain_from(None if first is None else first.seqno)

    # -- writes ---------------------------------------------------------------------------------

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
        self._require_active()
        current = self._current(key)
        self._check_lock(key, current, cas)
        if cas:
            self._check_cas(key, current, cas)
        rev_seqno = current.rev_seqno + 1 if current is not None else 1
        return self._queue_write(
            key,
            Op.MUTATION,
            value,
            flags=flags,
            expiry=expiry,
            datatype=datatype,
            rev_seqno=rev_seqno,
            level=level,
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
    ) -> SetManyResult:
        """`set` without CAS of each write, in order, as a received batch of SETs: the stored
        versions of the keys are looked up in one read transaction, and the writes are queued
        as one run (`CheckpointManager.queue_run`). A write that `set` would refuse gets its
        error in the result; the others still apply. A key found expired gets its expiration
        queued first, as `set` does; when checkpoint memory runs out part of the way, the
        writes past that point get CheckpointMemoryFullError (TMPFAIL) and take no seqno.

        A clean run — no key locked, pending or found expired, every field in range (a key
        may repeat: its later write finds the earlier) — is built with one C-level pass per
        column (`_clean_run_revs` decides); anything else goes write by write
        (`_set_one_by_one`). `expiries` are absolute, as `set`'s.

        `lookup`: the keys' versions, looked up by the caller with `lookup_memory` and a store
        lookup of the rest since (a bucket looks up every vbucket's keys at once).
        `fields_checked`: the caller checked every field is within limits
        (`fields_in_range`); the clean path does not check again.
        """
        count = len(keys)
        if self._state is not VBucketState.ACTIVE:
            error = NotMyVbucketError(f"vb {self._vb} is {self._state.value}, not active")
            return SetManyResult(self._vb, self.vb_uuid, [0] * count, [0] * count,
                                 dict.fromkeys(range(count), error))  # fmt: skip
        if lookup is None:
            in_memory, missing = self.lookup_memory(keys)
            stored: Mapping[bytes, Record | None] = (
                self._store.get_many(self._vb, missing) if missing else {}
            )
        else:
            in_memory, stored = lookup.in_memory, lookup.stored
        now = self._clock()
        writes = (keys, values, flags, expiries, datatypes)
        revs = self._clean_run_revs(writes, in_memory, stored, now, fields_checked)
        if revs is None:
            found = dict(zip(keys, in_memory, strict=True))
            return self._set_one_by_one(writes, found, stored, now)
        first_seqno = self._high_seqno + 1
        first_cas = max(int(now * _NS_PER_S), self._last_cas + 1)  # then one up per write
        seqnos = range(first_seqno, first_seqno + count)
        cases = range(first_cas, first_cas + count)
        items = list(
            map(Item, seqnos, keys, itertools.repeat(_MUTATION), values, cases, flags, expiries,
                datatypes, revs)
        )  # fmt: skip
        errors: dict[int, StatusError] = {}
        self._queue_answered(items, range(count), errors)
        return SetManyResult(self._vb, self.vb_uuid, seqnos, cases, errors)

    def lookup_memory(self, keys: Sequence[bytes]) -> tuple[list[Item | None], list[bytes]]:
        """The newest version of each key still in memory, and the keys memory has none of
        (for the store to look up): the first half of the lookup `set_many` needs."""
        in_memory = self.manager.find_many(keys)
        if in_memory.count(None) == len(keys):
            return in_memory, list(keys)
        return in_memory, [key for key, item in zip(keys, in_memory, strict=True) if item is None]

    def _clean_run_revs(
        self,
        writes: SetColumns,
        in_memory: list[Item | None],
        stored: Mapping[bytes, Record | None],
        now: float,
        fields_checked: bool,
    ) -> list[int] | None:
        """The new rev_seqno of each write if the run is clean (see `set_many`), else None.

        A key written twice in the run finds its earlier write, as `set` one at a time would
        (unless that write expires at once: its expiration comes first, one by one)."""
        keys, expiries = writes[0], writes[3]
        if not keys or self._locks:
            return None
        if self._pending and not self._pending.keys().isdisjoint(keys):
            return None
        if not fields_checked and not fields_in_range(writes):
            return None
        distinct = len(set(keys)) == len(keys)
        if (
            distinct
            and in_memory.count(None) == len(keys)
            and list(stored.values()).count(None) == len(keys)
        ):
            return [1] * len(keys)  # every key is new: the common case of an ingest
        revs = []
        earlier: dict[bytes, tuple[int, int]] = {}  # key -> (rev, expiry) of its last write here
        for key, current, expiry in zip(keys, in_memory, expiries, strict=True):  # bounded
            before = None if distinct else earlier.get(key)
            if before is not None:
                rev, earlier_expiry = before
                if earlier_expiry and earlier_expiry <= now:
                    return None  # the earlier write is found expired: one by one
                rev += 1
            else:
                found = current if current is not None else stored[key]
                if found is None or found.op is not _MUTATION:
                    rev = 1
                elif found.expiry and found.expiry <= now:
                    return None  # its expiration is queued first: one by one
                else:
                    rev = found.rev_seqno + 1
            revs.append(rev)
            if not distinct:
                earlier[key] = (rev, expiry)
        return revs

    def _set_one_by_one(
        self,
        writes: SetColumns,
        found_in_memory: dict[bytes, Item | None],
        stored: Mapping[bytes, Record | None],
        now: float,
    ) -> SetManyResult:
        """`set_many` write by write, each checked in `set`'s order."""
        keys, values, flags, expiries, datatypes = writes
        vb = self._vb
        now_cas = int(now * _NS_PER_S)
        seqno, cas = self._high_seqno, self._last_cas
        pending, locks = self._pending, self._locks
        seqnos = [0] * len(keys)
        cases = [0] * len(keys)
        errors: dict[int, StatusError] = {}
        items: list[Item] = []
        answers: list[int] = []  # per item, the index of its write (-1: an expiration)
        for index, (key, value, flag, expiry, datatype) in enumerate(
            zip(keys, values, flags, expiries, datatypes, strict=True)
        ):
            try:  # in the order `set` checks: the lookup (which may expire), lock, pending, fields
                current: Item | Record | None = found_in_memory[key]
                if current is None:
                    current = stored[key] if key in stored else self._store.get(vb, key)
                if current is not None and current.op is not Op.MUTATION:
                    current = None
                elif current is not None and current.expiry and current.expiry <= now:
                    seqno, cas = seqno + 1, max(now_cas, cas + 1)
                    expired = Item(
                        seqno, key, Op.EXPIRATION, b"", cas,
                        rev_seqno=current.rev_seqno + 1, delete_time=min(int(now), _U32_MAX),
                    )  # fmt: skip
                    items.append(expired)
                    answers.append(-1)
                    found_in_memory[key] = expired
                    current = None
                if locks:
                    self._check_lock(key, current, 0)
                if pending and key in pending:
                    raise SyncWriteInProgressError(
                        f"vb {vb}: key {key[:64]!r} has a durable write pending"
                    )
                if (
                    not 0 < len(key) <= _KEY_SIZE_MAX
                    or len(value) > _VALUE_SIZE_MAX
                    or not (0 <= flag <= _U32_MAX and 0 <= expiry <= _U32_MAX)
                    or datatype & ~_DATATYPE_MASK
                    or datatype < 0
                ):
                    _check_fields(key, value, flag, expiry, datatype)
            except StatusError as error:
                errors[index] = error
                continue
            seqno, cas = seqno + 1, max(now_cas, cas + 1)
            rev_seqno = current.rev_seqno + 1 if current is not None else 1
            item = Item(seqno, key, Op.MUTATION, value, cas, flag, expiry, datatype, rev_seqno)
            items.append(item)
            answers.append(index)
            found_in_memory[key] = item  # the next write of the key in this run follows it
            seqnos[index], cases[index] = seqno, cas
        self._queue_answered(items, answers, errors)
        return SetManyResult(vb, self.vb_uuid, seqnos, cases, errors)

    def _queue_answered(
        self, items: list[Item], answers: Sequence[int], errors: dict[int, StatusError]
    ) -> None:
        """Queue `items` as one run; the writes memory had no room for (`answers[i]` is the
        index of item i's write, -1 for an expiration) get CheckpointMemoryFullError in
        `errors` (the run stops there: later seqnos are never used)."""
        if not items:
            return
        full: CheckpointMemoryFullError | None = None
        try:
            queued = self.manager.queue_run(items)
        except CheckpointMemoryFullError as error:
            queued, full = 0, error
        if queued < len(items):
            if full is None:
                full = CheckpointMemoryFullError(f"vb {self._vb}: checkpoint memory is full")
            for index in answers[queued:]:
                if index >= 0:
                    errors[index] = full
        if queued:
            self._high_seqno, self._last_cas = items[queued - 1].seqno, items[queued - 1].cas
            if self._locks:
                for item in items[:queued]:  # a new version is never locked
                    self._locks.pop(item.key, None)
        assert self.manager.high_seqno == self._high_seqno, (self.manager, self._high_seqno)

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
        self._require_active()
        if self._current(key) is not None:
            raise KeyExistsError(f"vb {self._vb}: key {key[:64]!r} exists")
        return self.set(key, value, flags=flags, expiry=expiry, datatype=datatype, level=level)

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
        self._require_active()
        if self._current(key) is None:
            raise KeyNotFoundError(f"vb {self._vb}: key {key[:64]!r} not found")
        return self.set(
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
        self._require_active()
        current = self._current(key)
        if current is None:
            raise KeyNotFoundError(f"vb {self._vb}: key {key[:64]!r} not found")
        self._check_lock(key, current, cas)
        if cas:
            self._check_cas(key, current, cas)
        return self._queue_write(
            key, Op.DELETION, b"", rev_seqno=current.rev_seqno + 1, level=level
        )

    def queue_replicated(self, item: Item) -> None:
        """Take an item streamed from the active (replica or pending state), seqno and CAS as is.

        Raises:
            NotMyVbucketError: the vbucket is active or dead.
            CheckpointMemoryFullError: checkpoint memory is full (the replica stream pauses).
        """
        self._require_replica()
        if not self._high_seqno < item.seqno <= self.manager.snapshot_end:
            raise InvalidArgumentsError(
                f"vb {self._vb}: replicated seqno {item.seqno} outside the snapshot being "
                f"received ({self._high_seqno}, {self.manager.snapshot_end}]"
            )
        _check_fields(item.key, item.value, item.flags, item.expiry, item.datatype)
        if not 0 < item.cas <= limits.SEQNO_MAX:
            raise InvalidArgumentsError(f"vb {self._vb}: cas {item.cas} is not a non-zero u64")
        self.manager.queue(item)
        self._high_seqno = item.seqno
        self._last_cas = max(self._last_cas, item.cas)
        if item.op is Op.PREPARE:
            assert isinstance(item, SyncItem), item
            self._pending.pop(item.key, None)  # an older one, its end deduplicated away
            self._pending[item.key] = item
            self._retain_pending()
        elif self._pending and item.key in self._pending:
            # An abort, a commit, or a committed change of the key after them (a commit
            # deduplicated away, or sent as the document by a disk backfill): the prepare ends.
            del self._pending[item.key]
            self._retain_pending()

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
        self._require_replica()
        if not items:
            return 0
        high = self._high_seqno
        if not high < items[0].seqno or not items[-1].seqno <= self.manager.snapshot_end:
            raise InvalidArgumentsError(
                f"vb {self._vb}: replicated seqnos {items[0].seqno}..{items[-1].seqno} outside "
                f"the snapshot being received ({high}, {self.manager.snapshot_end}]"
            )
        previous = high
        for item in items:  # the replica's hot loop: each check inline, _check_fields explains
            seqno = item.seqno
            if (
                seqno <= previous
                or not 0 < item.cas <= _U64_MAX
                or not 0 < len(item.key) <= _KEY_SIZE_MAX
                or len(item.body) - len(item.key) - _EXTRAS_SIZE[item.op] > _VALUE_SIZE_MAX
                or item.datatype & ~_DATATYPE_MASK
            ):
                self._refuse_replicated(item, previous)
            previous = seqno
        queued = self.manager.queue_run(items)
        self._high_seqno = items[queued - 1].seqno
        self._last_cas = max(self._last_cas, max(item.cas for item in items[:queued]))
        if self._pending:
            for item in items[:queued]:  # a committed change of a pending key ends the prepare
                if item.key in self._pending:
                    del self._pending[item.key]
                    self._retain_pending()
        return queued

    def _refuse_replicated(self, item: Item, previous: int) -> None:
        """Raise the error `queue_replicated_run` found in `item` (after `previous`)."""
        if item.seqno <= previous:
            raise InvalidArgumentsError(
                f"vb {self._vb}: replicated seqno {item.seqno} does not follow {previous}"
            )
        if not 0 < item.cas <= limits.SEQNO_MAX:
            raise InvalidArgumentsError(f"vb {self._vb}: cas {item.cas} is not a non-zero u64")
        _check_fields(item.key, item.value, item.flags, item.expiry, item.datatype)
        raise AssertionError(f"the run's checks refused {item!r}, _check_fields did not")

    def replica_commit(self, key: bytes, prepared_seqno: int, commit_seqno: int) -> None:
        """DCP_COMMIT from the active: commit the pending prepare of `key` at `commit_seqno`.

        Raises:
            NotMyVbucketError: not a replica.
            InvalidArgumentsError: no prepare of `key` at `prepared_seqno` is pending here
                (the active sends DCP_COMMIT only to a replica that holds the prepare).
            CheckpointMemoryFullError: as `queue_replicated`.
        """
        self._require_replica()
        prepare = self._pending.get(key)
        if prepare is None or prepare.seqno != prepared_seqno:
            held = None if prepare is None else prepare.seqno
            raise InvalidArgumentsError(
                f"vb {self._vb}: DCP_COMMIT of {key[:64]!r} prepared at {prepared_seqno}, "
                f"pending here: {held}"
            )
        self.queue_replicated(prepare.committed(commit_seqno))

    def replica_snapshot(self, snap_start: int, snap_end: int) -> None:
        """The active's snapshot marker: items up to `snap_end` follow, in their own checkpoint.

        Raises:
            NotMyVbucketError: the vbucket is not a replica.
            InvalidArgumentsError: the range is empty or ends below what is held.
        """
        self._require_replica()
        if not 0 <= snap_start <= snap_end <= limits.SEQNO_MAX:
            raise InvalidArgumentsError(f"vb {self._vb}: snapshot [{snap_start}, {snap_end}]")
        self.manager.start_snapshot(snap_start, snap_end)

    def adopt_failover_log(self, entries: list[tuple[int, int]]) -> None:
        """Take the active's failover log (a replica's history is its active's), persisted.

        Raises:
            NotMyVbucketError: the vbucket is not a replica.
        """
        self._require_replica()
        if entries != self._failover_log.entries:
            self._failover_log = FailoverLog(entries, rng=self._rng)
            self._persist_meta()

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
        self._require_replica()
        if seqno >= self._high_seqno:
            return self._high_seqno
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
        self._pending = {k: p for k, p in self._pending.items() if p.seqno <= point}
        self._retain_pending()
        assert self.persisted_seqno == point, (self.persisted_seqno, point)
        return point

    def replica_request_range(self) -> tuple[int, int, int]:
        """``(start, snap_start, snap_end)`` a replica presents when it requests its stream.

        Inside a snapshot it holds only partly — being received, or persisted partly before a
        crash — the range is that snapshot's, so the active can tell whether history diverged
        inside it; else the replica holds a whole snapshot ending at its high seqno.
        """
        high = self._high_seqno
        end = self.manager.snapshot_end
        if end > high:
            return high, min(self.manager.open_checkpoint.snap_start, high), end
        meta = self._store.vbucket_meta(self._vb)
        if meta is not None and meta.high_seqno == high and meta.snap_end > high:
            return high, min(meta.snap_start, high), meta.snap_end
        return high, high, high

    def _require_replica(self) -> None:
        if self._state not in (VBucketState.REPLICA, VBucketState.PENDING):
            raise NotMyVbucketError(f"vb {self._vb} is {self._state.value}, not a replica")

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: bytes) -> Document | None:
        """The current version of `key`, or None if missing, deleted or expired.

        Raises:
            NotMyVbucketError: the vbucket is dead (replicas serve reads, as replica reads do).
        """
        if self._state is VBucketState.DEAD:
            raise NotMyVbucketError(f"vb {self._vb} is dead")
        current = self._current(key)
        if current is None:
            return None
        return Document(
            key,
            current.value,
            self._visible_cas(key, current.cas) if self._locks else current.cas,
            current.flags,
            current.expiry,
            current.datatype,
            current.seqno,
            current.rev_seqno,
        )

    # -- the SDK's KV surface: locks, touch, metadata ----------------------------------------------

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
        self._require_active()
        current = self._current(key)
        if current is None:
            raise KeyNotFoundError(f"vb {self._vb}: key {key[:64]!r} not found")
        now = self._clock()
        lock = self._locks.get(key)
        if lock is not None and lock.until > now:
            raise LockedError(f"vb {self._vb}: key {key[:64]!r} is locked")
        if lock is None and len(self._locks) >= limits.ITEM_LOCKS_PER_VBUCKET_MAX:
            self._forget_unlocked(now)
            if len(self._locks) >= limits.ITEM_LOCKS_PER_VBUCKET_MAX:
                raise TemporaryFailureError(f"vb {self._vb}: too many documents locked")
        cas = self._next_cas()
        self._last_cas = cas
        self._locks[key] = _Lock(cas, now + lock_s)
        return Document(
            key,
            current.value,
            cas,
            current.flags,
            current.expiry,
            current.datatype,
            current.seqno,
            current.rev_seqno,
        )

    def unlock(self, key: bytes, cas: int) -> None:
        """UNLOCK_KEY: end the lock whose CAS is `cas` (the document keeps showing that CAS).

        Raises:
            NotMyVbucketError: not active.
            KeyNotFoundError: missing, deleted or expired.
            NotLockedError: not locked (never, or the lock timed out).
            LockedError: locked with another CAS.
        """
        self._require_active()
        if self._current(key) is None:
            raise KeyNotFoundError(f"vb {self._vb}: key {key[:64]!r} not found")
        lock = self._locks.get(key)
        if lock is None or lock.until <= self._clock():
            raise NotLockedError(f"vb {self._vb}: key {key[:64]!r} is not locked")
        if lock.cas != cas:
            raise LockedError(f"vb {self._vb}: key {key[:64]!r} is locked with another CAS")
        lock.until = 0.0

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
        self._require_active()
        current = self._current(key)
        if current is None:
            raise KeyNotFoundError(f"vb {self._vb}: key {key[:64]!r} not found")
        self._check_lock(key, current, cas)
        if cas:
            self._check_cas(key, current, cas)
        return self._queue_write(
            key,
            Op.MUTATION,
            current.value,
            flags=current.flags,
            expiry=expiry,
            datatype=current.datatype,
            rev_seqno=current.rev_seqno + 1,
        )

    def check_write(self, key: bytes, cas: int) -> None:
        """Refuse, before a read-modify-write computes its new value, what the write would be
        refused for: LOCKED, then (with `cas`) KEY_ENOENT or KEY_EEXISTS.

        Raises:
            NotMyVbucketError, LockedError, KeyNotFoundError, KeyExistsError: as `set`.
        """
        self._require_active()
        current = self._current(key)
        self._check_lock(key, current, cas)
        if cas:
            self._check_cas(key, current, cas)

    def get_meta(self, key: bytes) -> DocumentMeta | None:
        """GET_META: the newest version's metadata, a tombstone's included (deleted, its
        delete time as expiry); None when the key has no version at all (or it was purged).

        Raises:
            NotMyVbucketError: the vbucket is dead.
        """
        if self._state is VBucketState.DEAD:
            raise NotMyVbucketError(f"vb {self._vb} is dead")
        current = self._current(key)  # queues the expiration of an expired document
        if current is not None:
            return DocumentMeta(
                False,
                current.flags,
                current.expiry,
                current.rev_seqno,
                current.datatype,
                self._visible_cas(key, current.cas),
            )
        found: Item | Record | None = self.manager.find(key)
        if found is None:
            found = self._store.get(self._vb, key)
        if found is None:
            return None
        # A tombstone; or an expired document whose expiration could not be queued yet.
        expiry = found.delete_time if found.op is not Op.MUTATION else found.expiry
        return DocumentMeta(True, found.flags, expiry, found.rev_seqno, found.datatype, found.cas)

    def expire_if_due(self, key: bytes) -> bool:
        """Queue an EXPIRATION for `key` if its newest version has expired (the expiry pager).

        The same path as lazy expiry on access (`_current`), on this vbucket's clock: a key
        rewritten or deleted since the caller looked is left alone.

        Returns:
            True if an EXPIRATION was queued; False if the key is live, missing, already a
            tombstone, the vbucket is not active, or checkpoint memory is full (the next pass
            or access retries).
        """
        if self._state is not VBucketState.ACTIVE:
            return False
        high_seqno = self._high_seqno
        self._current(key)  # queues the expiration when the key is due
        assert self._high_seqno - high_seqno in (0, 1), (self._high_seqno, high_seqno)
        return self._high_seqno > high_seqno

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

    # -- internals ------------------------------------------------------------------------------

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
        if recovered is VBucketState.ACTIVE and (unclean or not meta.failover_log):
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

    def _require_active(self) -> None:
        if self._state is not VBucketState.ACTIVE:
            raise NotMyVbucketError(f"vb {self._vb} is {self._state.value}, not active")

    def _current(
        self, key: bytes, stored: dict[bytes, Record | None] | None = None
    ) -> Item | Record | None:
        """The live (not deleted, not expired) newest version of `key`, memory first; then
        `stored` if it holds the key (looked up earlier in this loop step for keys not in
        memory; a commit running meanwhile on the writer thread cannot change them, as its
        items stay in memory until the loop accounts for it), else the store."""
        found: Item | Record | None = self.manager.find(key)
        if found is None:
            if stored is not None and key in stored:
                found = stored[key]
            else:
                found = self._store.get(self._vb, key)
        if found is None or found.op is not Op.MUTATION:
            return None
        if found.expiry and found.expiry <= self._clock():
            if self._state is VBucketState.ACTIVE:
                self._expire(found)
            return None
        return found

    def _expire(self, found: Item | Record) -> None:
        # Memory full: it still reads as missing, and the next access queues the expiration.
        with contextlib.suppress(CheckpointMemoryFullError, SyncWriteInProgressError):
            self._queue_write(found.key, Op.EXPIRATION, b"", rev_seqno=found.rev_seqno + 1)

    def _check_cas(self, key: bytes, current: Item | Record | None, cas: int) -> None:
        if current is None:
            raise KeyNotFoundError(f"vb {self._vb}: key {key[:64]!r} not found")
        lock = self._locks.get(key) if self._locks else None
        if (current.cas if lock is None else lock.cas) != cas:
            raise KeyExistsError(f"vb {self._vb}: key {key[:64]!r} has another CAS")

    def _check_lock(self, key: bytes, current: Item | Record | None, cas: int) -> None:
        """LockedError if `key` is locked and `cas` is not the lock's."""
        lock = self._locks.get(key) if self._locks else None
        if lock is None or current is None:
            return
        if lock.until > self._clock() and cas != lock.cas:
            raise LockedError(f"vb {self._vb}: key {key[:64]!r} is locked")

    def _visible_cas(self, key: bytes, cas: int) -> int:
        """The CAS a read shows: LOCKED_CAS while locked, the lock's once unlocked."""
        lock = self._locks.get(key) if self._locks else None
        if lock is None:
            return cas
        return LOCKED_CAS if lock.until > self._clock() else lock.cas

    def _forget_unlocked(self, now: float) -> None:
        """Drop the entries of unlocked documents (their CAS reverts to the stored one)."""
        for key in [k for k, lock in self._locks.items() if lock.until <= now]:
            del self._locks[key]

    def _next_cas(self) -> int:
        now_ns = int(self._clock() * _NS_PER_S)
        cas = max(now_ns, self._last_cas + 1)
        assert 0 < cas <= limits.SEQNO_MAX, cas  # CAS is a u64 like a seqno
        return cas

    def _queue_write(
        self,
        key: bytes,
        op: Op,
        value: bytes,
        *,
        rev_seqno: int,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        level: int = 0,
    ) -> MutationResult:
        if self._pending and key in self._pending:
            raise SyncWriteInProgressError(
                f"vb {self._vb}: key {key[:64]!r} has a durable write pending"
            )
        _check_fields(key, value, flags, expiry, datatype)
        seqno = self._high_seqno + 1
        cas = self._next_cas()
        delete_time = 0 if op is Op.MUTATION else min(int(self._clock()), _U32_MAX)
        item: Item
        if level:
            item = SyncItem(
                seqno, key, Op.PREPARE, Op.DELETION if op is Op.EXPIRATION else op, value, cas,
                flags, expiry, datatype, rev_seqno, delete_time, level=level,
            )  # fmt: skip
        else:
            item = Item(seqno, key, op, value, cas, flags, expiry, datatype, rev_seqno, delete_time)
        self.manager.queue(item)
        if level:
            assert isinstance(item, SyncItem), item
            self._pending[key] = item
            self._retain_pending()
        self._high_seqno = seqno
        self._last_cas = cas
        if self._locks:
            self._locks.pop(key, None)  # a new version is never locked
        assert self.manager.high_seqno == seqno, (self.manager.high_seqno, seqno)
        return MutationResult(vbucket=self._vb, seqno=seqno, cas=cas, vb_uuid=self.vb_uuid)


def _prepare_of(record: Record, level: int) -> SyncItem:
    """The pending prepare a kept record (Store.prepares) stands for."""
    return SyncItem(
        record.seqno, record.key, Op.PREPARE, Op.DELETION if record.deleted else Op.MUTATION,
        record.value, record.cas, record.flags, record.expiry, record.datatype,
        record.rev_seqno, record.delete_time, level=level,
    )  # fmt: skip


def _check_fields(key: bytes, value: bytes, flags: int, expiry: int, datatype: int) -> None:
    """Raise InvalidArgumentsError for what the store would refuse at flush time (batch.py)."""
    if not 0 < len(key) <= limits.STORED_KEY_SIZE_MAX:
        raise InvalidArgumentsError(
            f"key length {len(key)} outside 1..{limits.STORED_KEY_SIZE_MAX}"
        )
    if len(value) > limits.VALUE_SIZE_MAX:
        raise InvalidArgumentsError(f"value of {len(value)} bytes over {limits.VALUE_SIZE_MAX}")
    if not (0 <= flags <= _U32_MAX and 0 <= expiry <= _U32_MAX):
        raise InvalidArgumentsError(f"flags {flags} or expiry {expiry} is not a u32")
    if datatype & ~_DATATYPE_MASK or datatype < 0:
        raise InvalidArgumentsError(f"datatype {datatype:#x} has bits above {_DATATYPE_MASK:#x}")
