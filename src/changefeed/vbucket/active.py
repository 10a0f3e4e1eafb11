"""The active role: writes, GET_LOCKED locks, lazy expiry and the active side of durability.

Writes (`set`, `add`, `replace`, `delete`, `touch`) each get the core's next seqno and CAS
(`VBucketCore.next_cas`, recorded with `advanced` once queued); a write with a durability
`level` queues a PREPARE (`SyncItem`) that reads and application streams do not see, and the
key is refused to other writers (SYNC_WRITE_IN_PROGRESS) until `commit` queues the committed
document at a new seqno (same CAS) or `abort` ends it. When to commit is the server's decision
(server/sync_writes.py). Locks live here only: a state change retires this role and its locks
with it (`Effect.LOCKS_DROPPED`). Entering the role commits the prepares the copy holds
(`Effect.PREPARES_COMMITTED`): any may have been acknowledged as durable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
from collections.abc import Mapping, Sequence
from typing import Final

from changefeed import limits
from changefeed.checkpoint import CheckpointMemoryFullError, Item, SyncItem
from changefeed.protocol.errors import (
    KeyExistsError,
    KeyNotFoundError,
    LockedError,
    NotLockedError,
    StatusError,
    SyncWriteInProgressError,
    TemporaryFailureError,
)
from changefeed.protocol.kv import MutationResult
from changefeed.protocol.kv_ops import LOCKED_CAS
from changefeed.storage import Op, Record
from changefeed.vbucket.port import VBucketCore, retain_pending
from changefeed.vbucket.role import Role
from changefeed.vbucket.values import (
    NS_PER_S,
    U32_MAX,
    Document,
    RunLookup,
    SetColumns,
    SetManyResult,
    check_fields,
    fields_in_range,
    write_in_range,
)

_MUTATION: Final = Op.MUTATION
_ABORT: Final = Op.ABORT
_DELETION: Final = Op.DELETION
_EXPIRATION: Final = Op.EXPIRATION
_PREPARE: Final = Op.PREPARE
_committed: Final = SyncItem.committed
_cas_of: Final = operator.attrgetter("cas")


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


class ActiveRole(Role):
    """The one copy that takes writes (see the module docstring)."""

    def __init__(self, core: VBucketCore, pending: dict[bytes, SyncItem]) -> None:
        super().__init__(core, pending)
        self.locks: dict[bytes, _Lock] = {}  # GET_LOCKED; any write of the key drops its entry

    @property
    def locks_held(self) -> int:
        return len(self.locks)

    # -- reads ----------------------------------------------------------------------------------

    def check_readable(self) -> None:
        return None

    def visible_cas(self, key: bytes, cas: int) -> int:
        """LOCKED_CAS while locked, the lock's once unlocked, else `cas`."""
        lock = self.locks.get(key) if self.locks else None
        if lock is None:
            return cas
        return LOCKED_CAS if lock.until > self.core.now() else lock.cas

    def on_expired(self, found: Item | Record) -> None:
        # Memory full: it still reads as missing, and the next access queues the expiration.
        with contextlib.suppress(CheckpointMemoryFullError, SyncWriteInProgressError):
            self._queue_write(found.key, _EXPIRATION, b"", rev_seqno=found.rev_seqno + 1)

    def expire_if_due(self, key: bytes) -> bool:
        core = self.core
        high_seqno = core.high_seqno
        core.current(key)  # queues the expiration when the key is due
        assert core.high_seqno - high_seqno in (0, 1), (core.high_seqno, high_seqno)
        return core.high_seqno > high_seqno

    # -- SyncWrites -----------------------------------------------------------------------------

    def commit(self, key: bytes) -> MutationResult:
        core = self.core
        prepare = self.pending.get(key)
        if prepare is None:
            raise KeyNotFoundError(f"vb {core.vb}: no durable write of {key[:64]!r} pending")
        seqno = core.high_seqno + 1
        core.manager.queue(prepare.committed(seqno))
        del self.pending[key]
        core.advanced(seqno, prepare.cas)
        if self.locks:
            self.locks.pop(key, None)
        retain_pending(core.manager, self.pending)
        return MutationResult(vbucket=core.vb, seqno=seqno, cas=prepare.cas, vb_uuid=core.vb_uuid)

    def commit_many(self, keys: Sequence[bytes]) -> list[MutationResult | StatusError]:
        """See `VBucket.commit_many`."""
        assert len(set(keys)) == len(keys), "a key commits once per run"
        if not keys:
            return []
        try:  # the monitor's runs: every key pending (no per-key check; SyncItem.__eq__ neither)
            prepares = list(map(self.pending.__getitem__, keys))
        except KeyError:
            return self._commit_some(keys)
        return self._commit_pending(prepares)

    def _commit_some(self, keys: Sequence[bytes]) -> list[MutationResult | StatusError]:
        """`commit_many` of a run with keys not pending: the pending ones commit as one run
        (`_commit_pending`) and every other key is answered KeyNotFound in its place. Memory
        running out part of the way ends the answers at the first commit not queued."""
        pending = self.pending
        was_pending = [key in pending for key in keys]
        prepares = [pending[key] for key, found in zip(keys, was_pending, strict=True) if found]
        done = iter(self._commit_pending(prepares) if prepares else ())  # may raise: no change
        vb = self.core.vb
        out: list[MutationResult | StatusError] = []
        for key, found in zip(keys, was_pending, strict=True):  # bounded by the caller's run
            if not found:
                out.append(KeyNotFoundError(f"vb {vb}: no durable write of {key[:64]!r} pending"))
                continue
            result = next(done, None)
            if result is None:  # not queued: this key and the rest stay unanswered
                break
            out.append(result)
        return out

    def _commit_pending(self, prepares: list[SyncItem]) -> list[MutationResult | StatusError]:
        """`commit_many` of keys each with its prepare pending (`prepares`, in the keys' order,
        at least one): the commits take the next seqnos in order, built and answered in column
        passes."""
        core = self.core
        first = core.high_seqno + 1
        seqnos = range(first, first + len(prepares))
        commits = list(map(_committed, prepares, seqnos))
        queued = core.manager.queue_run(commits, commits=True)  # may raise: nothing changed
        if queued < len(commits):  # memory ran out part of the way: the rest stay pending
            prepares = prepares[:queued]
        vb, vb_uuid = core.vb, core.vb_uuid  # read once: properties of the core
        out: list[MutationResult | StatusError] = [
            MutationResult(vbucket=vb, seqno=seqno, cas=prepare.cas, vb_uuid=vb_uuid)
            for seqno, prepare in zip(seqnos, prepares, strict=False)  # prepares: those queued
        ]
        pending = self.pending
        for prepare in prepares:  # bounded by the run
            del pending[prepare.key]
        locks = self.locks
        if locks:
            for prepare in prepares:  # bounded by the run
                locks.pop(prepare.key, None)
        core.advanced(seqnos[queued - 1], max(map(_cas_of, prepares)))
        retain_pending(core.manager, pending)
        return out

    def abort(self, key: bytes) -> int:
        core = self.core
        prepare = self.pending.get(key)
        if prepare is None:
            return 0
        seqno = core.high_seqno + 1
        abort = SyncItem(
            seqno, key, _ABORT, _DELETION, b"", prepare.cas, prepared_seqno=prepare.seqno
        )
        core.manager.queue(abort)
        del self.pending[key]
        core.advanced(seqno, prepare.cas)
        retain_pending(core.manager, self.pending)
        return seqno

    def commit_all_pending(self) -> int:
        core = self.core
        committed = 0
        for key, prepare in list(self.pending.items()):
            newest = core.manager.find(key) or core.store.get(core.vb, key)
            try:
                if newest is not None and newest.seqno > prepare.seqno:
                    self.abort(key)
                    continue
                self.commit(key)
            except CheckpointMemoryFullError:
                break
            committed += 1
        return committed

    # -- writes ---------------------------------------------------------------------------------

    def set(
        self, key: bytes, value: bytes, *, flags: int = 0, expiry: int = 0, datatype: int = 0,
        cas: int = 0, level: int = 0,
    ) -> MutationResult:  # fmt: skip
        current = self.core.current(key)
        self._check_lock(key, current, cas)
        if cas:
            self._check_cas(key, current, cas)
        rev_seqno = current.rev_seqno + 1 if current is not None else 1
        return self._queue_write(
            key, _MUTATION, value, flags=flags, expiry=expiry, datatype=datatype,
            rev_seqno=rev_seqno, level=level,
        )  # fmt: skip

    def add(
        self, key: bytes, value: bytes, *, flags: int = 0, expiry: int = 0, datatype: int = 0,
        level: int = 0,
    ) -> MutationResult:  # fmt: skip
        if self.core.current(key) is not None:
            raise KeyExistsError(f"vb {self.core.vb}: key {key[:64]!r} exists")
        return self.set(key, value, flags=flags, expiry=expiry, datatype=datatype, level=level)

    def replace(
        self, key: bytes, value: bytes, *, flags: int = 0, expiry: int = 0, datatype: int = 0,
        cas: int = 0, level: int = 0,
    ) -> MutationResult:  # fmt: skip
        if self.core.current(key) is None:
            raise KeyNotFoundError(f"vb {self.core.vb}: key {key[:64]!r} not found")
        return self.set(
            key, value, flags=flags, expiry=expiry, datatype=datatype, cas=cas, level=level
        )

    def delete(self, key: bytes, *, cas: int = 0, level: int = 0) -> MutationResult:
        current = self._existing(key, cas)
        return self._queue_write(key, _DELETION, b"", rev_seqno=current.rev_seqno + 1, level=level)

    def touch(self, key: bytes, expiry: int, *, cas: int = 0) -> MutationResult:
        current = self._existing(key, cas)
        return self._queue_write(
            key, _MUTATION, current.value, flags=current.flags, expiry=expiry,
            datatype=current.datatype, rev_seqno=current.rev_seqno + 1,
        )  # fmt: skip

    def _existing(self, key: bytes, cas: int) -> Item | Record:
        """The live version of `key` a change of it starts from, checked as `set` checks:
        KeyNotFoundError when there is none, then the lock, then (with `cas`) the CAS."""
        current = self.core.current(key)
        if current is None:
            raise KeyNotFoundError(f"vb {self.core.vb}: key {key[:64]!r} not found")
        self._check_lock(key, current, cas)
        if cas:
            self._check_cas(key, current, cas)
        return current

    def check_write(self, key: bytes, cas: int) -> None:
        current = self.core.current(key)
        self._check_lock(key, current, cas)
        if cas:
            self._check_cas(key, current, cas)

    # -- locks ----------------------------------------------------------------------------------

    def get_locked(self, key: bytes, lock_s: float) -> Document:
        core = self.core
        current = core.current(key)
        if current is None:
            raise KeyNotFoundError(f"vb {core.vb}: key {key[:64]!r} not found")
        now = core.now()
        lock = self.locks.get(key)
        if lock is not None and lock.until > now:
            raise LockedError(f"vb {core.vb}: key {key[:64]!r} is locked")
        if lock is None and len(self.locks) >= limits.ITEM_LOCKS_PER_VBUCKET_MAX:
            self._forget_unlocked(now)
            if len(self.locks) >= limits.ITEM_LOCKS_PER_VBUCKET_MAX:
                raise TemporaryFailureError(f"vb {core.vb}: too many documents locked")
        cas = core.next_cas()
        core.advanced(core.high_seqno, cas)  # a lock takes a CAS, not a seqno
        self.locks[key] = _Lock(cas, now + lock_s)
        return Document(
            key, current.value, cas, current.flags, current.expiry, current.datatype,
            current.seqno, current.rev_seqno,
        )  # fmt: skip

    def unlock(self, key: bytes, cas: int) -> None:
        core = self.core
        if core.current(key) is None:
            raise KeyNotFoundError(f"vb {core.vb}: key {key[:64]!r} not found")
        lock = self.locks.get(key)
        if lock is None or lock.until <= core.now():
            raise NotLockedError(f"vb {core.vb}: key {key[:64]!r} is not locked")
        if lock.cas != cas:
            raise LockedError(f"vb {core.vb}: key {key[:64]!r} is locked with another CAS")
        lock.until = 0.0

    def _check_cas(self, key: bytes, current: Item | Record | None, cas: int) -> None:
        if current is None:
            raise KeyNotFoundError(f"vb {self.core.vb}: key {key[:64]!r} not found")
        lock = self.locks.get(key) if self.locks else None
        if (current.cas if lock is None else lock.cas) != cas:
            raise KeyExistsError(f"vb {self.core.vb}: key {key[:64]!r} has another CAS")

    def _check_lock(self, key: bytes, current: Item | Record | None, cas: int) -> None:
        """LockedError if `key` is locked and `cas` is not the lock's."""
        lock = self.locks.get(key) if self.locks else None
        if lock is None or current is None:
            return
        if lock.until > self.core.now() and cas != lock.cas:
            raise LockedError(f"vb {self.core.vb}: key {key[:64]!r} is locked")

    def _forget_unlocked(self, now: float) -> None:
        """Drop the entries of unlocked documents (their CAS reverts to the stored one)."""
        for key in [k for k, lock in self.locks.items() if lock.until <= now]:
            del self.locks[key]

    # -- one write ------------------------------------------------------------------------------

    def _queue_write(
        self, key: bytes, op: Op, value: bytes, *, rev_seqno: int, flags: int = 0,
        expiry: int = 0, datatype: int = 0, level: int = 0,
    ) -> MutationResult:  # fmt: skip
        core = self.core
        if self.pending and key in self.pending:
            raise SyncWriteInProgressError(
                f"vb {core.vb}: key {key[:64]!r} has a durable write pending"
            )
        check_fields(key, value, flags, expiry, datatype)
        seqno = core.high_seqno + 1
        cas = core.next_cas()
        delete_time = 0 if op is _MUTATION else min(int(core.now()), U32_MAX)
        item: Item
        if level:
            item = SyncItem(
                seqno, key, _PREPARE, _DELETION if op is _EXPIRATION else op, value, cas,
                flags, expiry, datatype, rev_seqno, delete_time, level=level,
            )  # fmt: skip
        else:
            item = Item(seqno, key, op, value, cas, flags, expiry, datatype, rev_seqno, delete_time)
        manager = core.manager
        manager.queue(item)
        if level:
            assert isinstance(item, SyncItem), item
            self.pending[key] = item
            retain_pending(manager, self.pending)
        core.advanced(seqno, cas)
        if self.locks:
            self.locks.pop(key, None)  # a new version is never locked
        return MutationResult(vbucket=core.vb, seqno=seqno, cas=cas, vb_uuid=core.vb_uuid)

    # -- a run of writes ------------------------------------------------------------------------

    def set_many(
        self, keys: Sequence[bytes], values: Sequence[bytes], flags: Sequence[int],
        expiries: Sequence[int], datatypes: Sequence[int], *, lookup: RunLookup | None = None,
        fields_checked: bool = False, level: int = 0,
    ) -> SetManyResult:  # fmt: skip
        """See `VBucket.set_many`."""
        core = self.core
        count = len(keys)
        if level and len(set(keys)) != count:  # a key's second prepare is refused: one by one
            return self._prepare_one_by_one((keys, values, flags, expiries, datatypes), level)
        if lookup is None:
            in_memory = core.manager.find_many(keys)
            missing = [key for key, item in zip(keys, in_memory, strict=True) if item is None]
            stored: Mapping[bytes, Record | None] = (
                core.store.get_many(core.vb, missing) if missing else {}
            )
        else:
            in_memory, stored = lookup.in_memory, lookup.stored
        now = core.now()
        writes = (keys, values, flags, expiries, datatypes)
        if count == 1 and not level and (fields_checked or fields_in_range(writes)):
            single = self._set_single(
                keys[0], values[0], flags[0], expiries[0], datatypes[0], in_memory[0], stored, now
            )  # a small window over many vbuckets: most runs are one
            # (a bucket's `set_single` that declined is asked again here: only for a key
            # locked, pending or found expired, each a dict lookup; not worth a flag through
            # `VBucket.set_many` and every role)
            if single is not None:
                return single
        revs = self._clean_run_revs(writes, in_memory, stored, now, fields_checked)
        if revs is None:
            if level:
                return self._prepare_one_by_one(writes, level)
            found = dict(zip(keys, in_memory, strict=True))
            return self._set_one_by_one(writes, found, stored, now)
        first_seqno = core.high_seqno + 1
        first_cas = max(int(now * NS_PER_S), core.last_cas + 1)  # then one up per write
        seqnos = range(first_seqno, first_seqno + count)
        cases = range(first_cas, first_cas + count)
        if level:
            return self._queue_prepares(writes, seqnos, cases, revs, level)
        items = list(
            map(Item, seqnos, keys, itertools.repeat(_MUTATION), values, cases, flags, expiries,
                datatypes, revs)
        )  # fmt: skip
        errors: dict[int, StatusError] = {}
        self._queue_answered(items, range(count), errors)
        return SetManyResult(core.vb, core.vb_uuid, seqnos, cases, errors)

    def set_single(
        self, key: bytes, value: bytes, flags: int, expiry: int, datatype: int, *,
        found: Item | None, stored: Mapping[bytes, Record | None], fields_checked: bool,
    ) -> SetManyResult | None:  # fmt: skip
        """See `VBucket.set_single`."""
        if not fields_checked and not write_in_range(key, value, flags, expiry, datatype):
            return None
        return self._set_single(key, value, flags, expiry, datatype, found, stored, self.core.now())

    def _set_single(
        self,
        key: bytes,
        value: bytes,
        flags: int,
        expiry: int,
        datatype: int,
        found: Item | None,
        stored: Mapping[bytes, Record | None],
        now: float,
    ) -> SetManyResult | None:
        """`set_many` of one plain write, its fields in range, when it is clean
        (`_clean_run_revs`' rule), queued with `CheckpointManager.queue`: a run's bookkeeping
        (ranges, a map of `Item`, the manager's run closures and bound) cost ~2.4 us against
        ~1.1 for the one item, and a window of 16 over 64 vbuckets is mostly runs of one.
        None when not clean: the caller takes the general path, which checks the write again
        in `set`'s order. Only this key's lock counts: a write looks at no other key's
        (`_check_lock`, and the pop after it), so a lock left on another key (unlocked or timed
        out, never written since) must not keep every write off this path."""
        if key in self.locks or (self.pending and key in self.pending):
            return None
        assert found is not None or key in stored, key
        rev = _rev_after(found if found is not None else stored[key], now)
        if rev is None:
            return None  # its expiration is queued first: one by one
        core = self.core
        seqno = core.high_seqno + 1
        cas = max(int(now * NS_PER_S), core.last_cas + 1)
        assert cas > core.last_cas, (cas, core.last_cas)
        item = Item(seqno, key, _MUTATION, value, cas, flags, expiry, datatype, rev)
        try:
            core.manager.queue(item)
        except CheckpointMemoryFullError as error:  # nothing queued: no seqno taken
            return SetManyResult(core.vb, core.vb_uuid, (0,), (0,), {0: error})
        core.advanced(seqno, cas)
        return SetManyResult(core.vb, core.vb_uuid, (seqno,), (cas,), {})

    def _queue_prepares(
        self, writes: SetColumns, seqnos: range, cases: range, revs: list[int], level: int
    ) -> SetManyResult:
        """A clean run of distinct keys as prepares (`_queue_write` with `level`, each), queued
        with one `queue_prepares`: one budget check, one wakeup, one `retain_pending`."""
        core = self.core
        keys, values, flags, expiries, datatypes = writes
        items = SyncItem.prepares(
            seqnos, keys, values, cases, flags, expiries, datatypes, revs, level
        )
        errors: dict[int, StatusError] = {}
        try:
            queued = core.manager.queue_prepares(items)
        except CheckpointMemoryFullError as error:
            queued = 0
            errors = dict.fromkeys(range(len(items)), error)
        if 0 < queued < len(items):  # memory ran out part of the way: the rest take no seqno
            full = CheckpointMemoryFullError(f"vb {core.vb}: checkpoint memory is full")
            errors = dict.fromkeys(range(queued, len(items)), full)
        if queued:
            pending = self.pending
            for item in items[:queued]:  # in seqno order, as `pending` keeps them
                pending[item.key] = item
            retain_pending(core.manager, pending)
            core.advanced(items[queued - 1].seqno, items[queued - 1].cas)
        if errors:
            seqnos_out = [seqno if at < queued else 0 for at, seqno in enumerate(seqnos)]
            cases_out = [cas if at < queued else 0 for at, cas in enumerate(cases)]
            return SetManyResult(core.vb, core.vb_uuid, seqnos_out, cases_out, errors)
        return SetManyResult(core.vb, core.vb_uuid, seqnos, cases, errors)

    def _prepare_one_by_one(self, writes: SetColumns, level: int) -> SetManyResult:
        """A run of prepares that is not clean, write by write through `set` (each checked and
        queued exactly as a durable SET alone is)."""
        keys, values, flags, expiries, datatypes = writes
        seqnos = [0] * len(keys)
        cases = [0] * len(keys)
        errors: dict[int, StatusError] = {}
        for index, (key, value, flag, expiry, datatype) in enumerate(
            zip(keys, values, flags, expiries, datatypes, strict=True)
        ):  # bounded by the run
            try:
                result = self.set(
                    key, value, flags=flag, expiry=expiry, datatype=datatype, level=level
                )
            except StatusError as error:
                errors[index] = error
                continue
            seqnos[index], cases[index] = result.seqno, result.cas
        return SetManyResult(self.core.vb, self.core.vb_uuid, seqnos, cases, errors)

    def _clean_run_revs(
        self,
        writes: SetColumns,
        in_memory: list[Item | None],
        stored: Mapping[bytes, Record | None],
        now: float,
        fields_checked: bool,
    ) -> list[int] | None:
        """The new rev_seqno of each write if the run is clean (see `VBucket.set_many`), else
        None. A key written twice in the run finds its earlier write, as `set` one at a time
        would (unless that write expires at once: its expiration comes first, one by one)."""
        keys, expiries = writes[0], writes[3]
        if not keys or (self.locks and not self.locks.keys().isdisjoint(keys)):
            return None  # only the run's own keys' locks count (see `_set_single`)
        if self.pending and not self.pending.keys().isdisjoint(keys):
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
                after = _rev_after(current if current is not None else stored[key], now)
                if after is None:
                    return None  # its expiration is queued first: one by one
                rev = after
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
        core = self.core
        vb, store = core.vb, core.store
        now_cas = int(now * NS_PER_S)
        seqno, cas = core.high_seqno, core.last_cas
        pending, locks = self.pending, self.locks
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
                    current = stored[key] if key in stored else store.get(vb, key)
                if current is not None and current.op is not _MUTATION:
                    current = None
                elif current is not None and current.expiry and current.expiry <= now:
                    seqno, cas = seqno + 1, max(now_cas, cas + 1)
                    expired = Item(
                        seqno, key, _EXPIRATION, b"", cas,
                        rev_seqno=current.rev_seqno + 1, delete_time=min(int(now), U32_MAX),
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
                if not write_in_range(key, value, flag, expiry, datatype):
                    check_fields(key, value, flag, expiry, datatype)
            except StatusError as error:
                errors[index] = error
                continue
            seqno, cas = seqno + 1, max(now_cas, cas + 1)
            rev_seqno = current.rev_seqno + 1 if current is not None else 1
            item = Item(seqno, key, _MUTATION, value, cas, flag, expiry, datatype, rev_seqno)
            items.append(item)
            answers.append(index)
            found_in_memory[key] = item  # the next write of the key in this run follows it
            seqnos[index], cases[index] = seqno, cas
        self._queue_answered(items, answers, errors)
        return SetManyResult(vb, core.vb_uuid, seqnos, cases, errors)

    def _queue_answered(
        self, items: list[Item], answers: Sequence[int], errors: dict[int, StatusError]
    ) -> None:
        """Queue `items` as one run; the writes memory had no room for (`answers[i]` is the
        index of item i's write, -1 for an expiration) get CheckpointMemoryFullError in
        `errors` (the run stops there: later seqnos are never used)."""
        if not items:
            return
        core = self.core
        full: CheckpointMemoryFullError | None = None
        try:
            queued = core.manager.queue_run(items)
        except CheckpointMemoryFullError as error:
            queued, full = 0, error
        if queued < len(items):
            if full is None:
                full = CheckpointMemoryFullError(f"vb {core.vb}: checkpoint memory is full")
            for index in answers[queued:]:
                if index >= 0:
                    errors[index] = full
        if queued:
            core.advanced(items[queued - 1].seqno, items[queued - 1].cas)
            if self.locks:
                for item in items[:queued]:  # a new version is never locked
                    self.locks.pop(item.key, None)


def _rev_after(current: Item | Record | None, now: float) -> int | None:
    """The rev_seqno of a write over `current`, its key's newest version (`set`'s rule): 1
    over nothing or a tombstone (deletion or expiration), its rev + 1 over a live document,
    None over one found expired at `now` (its expiration must be queued first, and a run's
    clean paths queue none: they go one by one, which does)."""
    if current is None or current.op is not _MUTATION:
        return 1
    if current.expiry and current.expiry <= now:
        return None
    return current.rev_seqno + 1
