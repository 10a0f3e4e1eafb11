"""A write batch: the writes of one group commit, buffered until the store commits them.

Contract: `WriteBatch` methods check their arguments and encode the stored bytes at once (a bad
call raises ValueError and leaves the batch as it was), but touch LMDB only in `apply`, which
the store calls inside its single write transaction when the `with store.write_batch()` block
ends normally. Within the batch, later writes of a key replace earlier ones, so only the newest
version of each key reaches `by_seqno`; `apply` also removes the key's older committed version.
Per vbucket, seqnos must strictly increase across the batch and after the committed high seqno.

Not here: opening, committing or aborting the transaction (store.py), reading.
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol

from changefeed import limits
from changefeed.storage.keys import BY_KEY_VALUE, SEQNO_KEY, VB_KEY
from changefeed.storage.record import (
    DATATYPE_MASK,
    DELETION_EXTRAS_SIZE,
    DELETION_HEAD,
    MUTATION_EXTRAS_SIZE,
    MUTATION_HEAD,
    PREFIX,
    TAG_DELETION,
    TAG_EXPIRATION,
    TAG_MUTATION,
    Op,
    Record,
    encode_stored,
)
from changefeed.storage.replaced import drop_replaced
from changefeed.storage.staged_runs import StagedRun, StagedRuns
from changefeed.storage.vbmeta import VbState, check_failover_log, check_state, encode_vbstate
from changefeed.vbucket_state import VBucketState

if TYPE_CHECKING:
    import lmdb

_U64_MAX: Final = 0xFFFF_FFFF_FFFF_FFFF
_KEY_SIZE_MAX: Final = limits.STORED_KEY_SIZE_MAX
_VALUE_SIZE_MAX: Final = limits.VALUE_SIZE_MAX
_VB_PREFIXES: Final = tuple(VB_KEY.pack(vb) for vb in range(limits.VBUCKETS_MAX))
_pack_mutation_head: Final = MUTATION_HEAD.pack
_pack_prefix: Final = PREFIX.pack
_unpack_body_seqno: Final = struct.Struct(">Q").unpack_from  # both extras layouts start with it
_TAGS: Final = {Op.MUTATION: TAG_MUTATION, Op.DELETION: TAG_DELETION, Op.EXPIRATION: TAG_EXPIRATION}
_MUTATION_EXTRAS_SIZE: Final = MUTATION_EXTRAS_SIZE
_DELETION_EXTRAS_SIZE: Final = DELETION_EXTRAS_SIZE
_pack_seqno_key: Final = SEQNO_KEY.pack
_pack_by_key_value: Final = BY_KEY_VALUE.pack
_key_of: Final = operator.attrgetter("key")
_seqno_of: Final = operator.attrgetter("seqno")
_body_of: Final = operator.attrgetter("body")
_op_of: Final = operator.attrgetter("op")
_datatype_of: Final = operator.attrgetter("datatype")
_cas_of: Final = operator.attrgetter("cas")
# Shorter runs go item by item: the whole-run passes cost ~6 us however short the run
# (measured: 1 item 6.5 us against 2.5, 8 items 10.9 against 12.8).
CLEAN_RUN_MIN: Final = 6
_LEVEL_BYTES: Final = [bytes((level,)) for level in range(256)]
_EXTRAS_SIZE_OF_OP: Final = {
    Op.MUTATION: MUTATION_EXTRAS_SIZE,
    Op.DELETION: DELETION_EXTRAS_SIZE,
    Op.EXPIRATION: DELETION_EXTRAS_SIZE,
}


class BodyItem(Protocol):
    """A version whose DCP body is encoded (the checkpoint's items are): `put_bodies` takes
    runs of them. Read-only attributes, as `put_body`'s arguments; `body` holds `key` and
    `seqno` by construction (checkpoint/item.py builds it from them, or takes a received
    frame's body the decoder read them from), which `put_bodies` asserts at a run's ends
    rather than re-reading every body (`put_body` checks each one)."""

    @property
    def key(self) -> bytes: ...
    @property
    def seqno(self) -> int: ...
    @property
    def op(self) -> Op: ...
    @property
    def datatype(self) -> int: ...
    @property
    def cas(self) -> int: ...
    @property
    def body(self) -> bytes: ...


class _ColumnItem(NamedTuple):
    """One mutation of `put_columns`' columns as a BodyItem, for the one-by-one loop."""

    key: bytes
    seqno: int
    op: Op
    datatype: int
    cas: int
    body: bytes


class PreparedItem(BodyItem, Protocol):
    """A SyncWrite prepare whose body is encoded in its document's layout (the checkpoint's
    `SyncItem`): `put_prepares` takes runs of them."""

    @property
    def doc_op(self) -> Op: ...
    @property
    def level(self) -> int: ...


class WriteBatch:
    """Writes that commit together; get one from `Store.write_batch()`.

    Nothing is visible to readers, and nothing is durable, until the `with` block that created
    the batch ends without an exception. An exception out of the block discards the whole batch.
    Using the batch after its block ended raises RuntimeError.
    """

    __slots__ = (
        "_bytes",
        "_committed",
        "_keys",
        "_mutations",
        "_open",
        "_prepared",
        "_records",
        "_rows",
        "_runs",
    )

    def __init__(self, committed: Mapping[int, VbState]) -> None:
        self._committed = committed
        self._rows: dict[int, VbState] = {}  # vb -> working copy of its metadata
        self._records: dict[bytes, bytes] = {}  # by_seqno key -> stored record
        self._keys: dict[bytes, bytes] = {}  # by_key key -> by_key value
        # Clean runs, held as their columns (a key is in _keys or in one run, never both).
        self._runs = StagedRuns()
        # vb -> how many of the versions the batch holds are mutations (its item_count change
        # before the versions they replace in the store are counted, at apply)
        self._mutations: dict[int, int] = {}
        # prepared key -> level byte + stored prepare, or None: the key's prepare has ended.
        self._prepared: dict[bytes, bytes | None] = {}
        self._bytes = 0  # stored bytes held in _records and _runs
        self._open = True

    @property
    def stored_bytes(self) -> int:
        """Bytes of records the batch holds (a caller filling one batch from many sources
        stops before limits.STORAGE_BATCH_BYTES_MAX)."""
        return self._bytes

    def set(
        self,
        vb: int,
        key: bytes,
        seqno: int,
        value: bytes,
        *,
        cas: int,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        rev_seqno: int = 1,
    ) -> None:
        """Write a mutation of `key` at `seqno`.

        Raises:
            ValueError: vb has no metadata, seqno <= the vb's high seqno, key length outside
                1..STORED_KEY_SIZE_MAX, value over VALUE_SIZE_MAX, datatype above 0x07, an
                integer that does not fit its field, or the batch would exceed
                limits.STORAGE_BATCH_BYTES_MAX.
            RuntimeError: the batch has ended.
        """
        # The hot path of every write: checks are inlined, _check_item only explains a failure.
        row = self._rows.get(vb) if self._open else None
        if row is None:
            row = self._row(vb)
        if (
            seqno <= row.high_seqno
            or not 0 < len(key) <= _KEY_SIZE_MAX
            or len(value) > _VALUE_SIZE_MAX
            or datatype & ~DATATYPE_MASK
        ):
            _check_item(vb, row, key, seqno, len(value), datatype)
        try:
            head = _pack_mutation_head(
                TAG_MUTATION, datatype, len(key), cas, seqno, rev_seqno, flags, expiry, 0, 0, 0
            )
        except struct.error as error:
            raise ValueError(f"vb {vb} seqno {seqno}: field out of range: {error}") from None
        self._add(vb, row, key, seqno, Op.MUTATION, head + key + value)

    def delete(
        self,
        vb: int,
        key: bytes,
        seqno: int,
        *,
        cas: int,
        rev_seqno: int = 1,
        delete_time: int = 0,
        expiration: bool = False,
        value: bytes = b"",
        datatype: int = 0,
    ) -> None:
        """Write a tombstone (deletion, or expiration if `expiration`) of `key` at `seqno`.

        Args:
            delete_time: seconds since the epoch (u32). Compaction purges the tombstone once
                `delete_time <= now - tombstone_age_s`, so 0 ("unknown") is purgeable at once.
            value, datatype: a tombstone's body may keep xattrs (datatype XATTR).

        Raises:
            ValueError, RuntimeError: as for `set`.
        """
        row = self._row(vb)
        _check_item(vb, row, key, seqno, len(value), datatype)
        tag = TAG_EXPIRATION if expiration else TAG_DELETION
        try:
            head = DELETION_HEAD.pack(
                tag, datatype, len(key), cas, seqno, rev_seqno, delete_time, 0
            )
        except struct.error as error:
            raise ValueError(f"vb {vb} seqno {seqno}: field out of range: {error}") from None
        op = Op.EXPIRATION if expiration else Op.DELETION
        self._add(vb, row, key, seqno, op, head + key + value)

    def put_body(
        self, vb: int, key: bytes, seqno: int, op: Op, *, datatype: int, cas: int, body: bytes
    ) -> None:
        """Write a version whose DCP body (extras for `op`, `key`, value) is already encoded:
        the flusher stores each checkpoint item's body as it was built when queued.

        Raises:
            ValueError: as for `set`, or a body too short for its extras and key.
            RuntimeError: the batch has ended.
        """
        row = self._rows.get(vb) if self._open else None
        if row is None:
            row = self._row(vb)
        key_at = _MUTATION_EXTRAS_SIZE if op is Op.MUTATION else _DELETION_EXTRAS_SIZE
        value_size = len(body) - key_at - len(key)
        if (
            seqno <= row.high_seqno
            or not 0 < len(key) <= _KEY_SIZE_MAX
            or value_size > _VALUE_SIZE_MAX
            or datatype & ~DATATYPE_MASK
        ):
            _check_item(vb, row, key, seqno, value_size, datatype)
        if value_size < 0 or body[key_at : key_at + len(key)] != key:
            raise ValueError(f"vb {vb} seqno {seqno}: body does not hold key {key[:64]!r}")
        if _unpack_body_seqno(body)[0] != seqno:
            raise ValueError(f"vb {vb} seqno {seqno}: body says another seqno")
        try:
            prefix = _pack_prefix(_TAGS[op], datatype, len(key), cas)
        except struct.error as error:
            raise ValueError(f"vb {vb} seqno {seqno}: field out of range: {error}") from None
        self._add(vb, row, key, seqno, op, prefix + body)

    def put_bodies(self, vb: int, items: Sequence[BodyItem]) -> None:
        """`put_body` for each of `items`, in order (seqnos rising): the flusher's run of one
        vbucket. The checks and encodings run over the whole run at once, each as one
        C-level pass (`map`, `all`, `max`), when the run is clean — the usual case: every
        check passes and no key repeats, in the run or in the batch. Otherwise, one loop
        item by item, which names the first bad item.

        Raises:
            ValueError, RuntimeError: as for `put_body`; the items before the bad one stay in
                the batch (the flusher discards a batch that raised).
        """
        if not items:
            return
        row = self._rows.get(vb) if self._open else None
        if row is None:
            row = self._row(vb)
        if len(items) < CLEAN_RUN_MIN or not self._put_clean_runs([(vb, row, items)]):
            self._put_bodies_one_by_one(vb, items)

    def put_runs(self, runs: Sequence[tuple[int, Sequence[BodyItem]]]) -> None:
        """`put_bodies` of several vbuckets' runs, vbuckets rising: a flush round's. The
        checks and encodings of all the runs go as one C-level pass per step, so a round of
        many vbuckets with a few items each costs per item rather than per vbucket; if the
        runs are not clean together, each goes through `put_bodies`.

        Raises:
            ValueError: as for `put_bodies`, or the vbuckets do not rise.
            RuntimeError: as for `put_bodies`.
        """
        runs = [(vb, items) for vb, items in runs if items]
        if not runs:
            return
        vbs = [vb for vb, _ in runs]
        if any(map(operator.ge, vbs, itertools.islice(vbs, 1, None))):  # bounded by the round
            raise ValueError(f"put_runs: vbuckets {vbs} do not rise")
        rows = [(vb, self._row(vb), items) for vb, items in runs]
        if len(rows) == 1 or not self._put_clean_runs(rows):
            for vb, items in runs:
                self.put_bodies(vb, items)

    def put_columns(
        self,
        vb: int,
        seqnos: Sequence[int],
        keys: Sequence[bytes],
        bodies: Sequence[bytes],
        cases: Sequence[int],
        datatypes: Sequence[int],
    ) -> None:
        """`put_bodies` of mutations given as columns (seqnos rising; each body a mutation's
        DCP body holding its key and seqno — by construction, as a BodyItem's: the decoder
        read those from it — checked at a long run's ends): a replica's received run, which
        the checkpoint keeps as columns. Clean runs go as `put_bodies`' do, one C-level pass
        per step; otherwise `put_body` one at a time, which names the first bad one.

        The columns are read as given, neither copied (the flusher's slices of a run are its
        one copy) nor kept.

        Raises:
            ValueError: as for `put_bodies`, or columns of different lengths.
            RuntimeError: the batch has ended.
        """
        count = len(seqnos)
        if not len(keys) == len(bodies) == len(cases) == len(datatypes) == count:
            lengths = [len(column) for column in (seqnos, keys, bodies, cases, datatypes)]
            raise ValueError(f"vb {vb}: columns of different lengths {lengths}")
        if not count:
            return
        row = self._rows.get(vb) if self._open else None
        if row is None:
            row = self._row(vb)
        ops = [Op.MUTATION] * count
        if (
            count < CLEAN_RUN_MIN
            or row.high_seqno >= seqnos[0]
            or not self._put_clean_columns(
                [(vb, row)], [count], keys, seqnos, bodies, ops, datatypes, cases
            )
        ):
            items = map(_ColumnItem, keys, seqnos, ops, datatypes, cases, bodies)
            self._put_bodies_one_by_one(vb, items)

    def _put_clean_runs(self, runs: Sequence[tuple[int, VbState, Sequence[BodyItem]]]) -> bool:
        """Put every run of `runs` (vbuckets rising) if all pass every check of `put_body`;
        False (nothing put) if anything needs a closer look."""
        sizes = [len(run) for _, _, run in runs]
        items = (
            runs[0][2]
            if len(runs) == 1
            else list(itertools.chain.from_iterable(r for *_, r in runs))
        )
        if any(row.high_seqno >= run[0].seqno for _, row, run in runs):
            return False
        return self._put_clean_columns(
            [(vb, row) for vb, row, _ in runs], sizes, list(map(_key_of, items)),
            list(map(_seqno_of, items)), list(map(_body_of, items)), list(map(_op_of, items)),
            list(map(_datatype_of, items)), map(_cas_of, items),
        )  # fmt: skip

    def _put_clean_columns(
        self,
        rows: Sequence[tuple[int, VbState]],
        sizes: list[int],
        keys: Sequence[bytes],
        seqnos: Sequence[int],
        bodies: Sequence[bytes],
        ops: list[Op],
        datatypes: Sequence[int],
        cases: Iterable[int],
    ) -> bool:
        """`_put_clean_runs` of runs given as columns laid end to end (`sizes[i]` items of
        vbucket `rows[i]`, each run's first seqno above its row's high seqno)."""
        vbs = itertools.chain.from_iterable(
            itertools.repeat(vb, n) for (vb, _), n in zip(rows, sizes, strict=True)
        )
        prefixes = itertools.chain.from_iterable(
            itertools.repeat(_VB_PREFIXES[vb], n) for (vb, _), n in zip(rows, sizes, strict=True)
        )
        key_sizes = list(map(len, keys))
        body_sizes = list(map(len, bodies))
        by_keys = list(map(operator.add, prefixes, keys))
        try:
            seqno_keys = list(map(_pack_seqno_key, vbs, seqnos))
        except struct.error:
            return False  # a seqno out of range: the loop names it
        key_size_max = max(key_sizes)
        if not (
            # (vb, seqno) keys rising: seqnos rise within each run, and the vbuckets rise.
            all(map(operator.lt, seqno_keys, itertools.islice(seqno_keys, 1, None)))
            and min(key_sizes) > 0
            and key_size_max <= _KEY_SIZE_MAX
            # Every body holds its extras and key, and no value is too long (a run that is
            # not clearly within both bounds is checked item by item).
            and _bodies_hold_extras_and_keys(body_sizes, key_sizes, key_size_max, ops)
            and max(body_sizes) <= _VALUE_SIZE_MAX
            and max(datatypes) <= DATATYPE_MASK  # a negative one fails to pack below
            and len(key_set := set(by_keys)) == len(by_keys)
            and self._keys.keys().isdisjoint(key_set)
            and not self._runs.overlaps((vb for vb, _ in rows), key_set)
        ):
            return False
        if not _bodies_hold_fields(sizes, keys, seqnos, bodies, ops):
            return False  # item by item: the bad one is named
        try:
            # A run of mutations (a replica's, most flushes) needs no tag lookup per item.
            all_mutations = ops.count(Op.MUTATION) == len(ops)
            tags = itertools.repeat(TAG_MUTATION) if all_mutations else map(_TAGS.__getitem__, ops)
            heads = map(_pack_prefix, tags, datatypes, key_sizes, cases)
            stored = list(map(operator.add, heads, bodies))
        except struct.error:
            return False  # a CAS out of range: the loop names it
        stored_bytes = self._bytes + sum(body_sizes) + len(stored) * PREFIX.size
        if stored_bytes > limits.STORAGE_BATCH_BYTES_MAX:
            return False
        by_key_values = list(map(_pack_by_key_value, seqnos, ops))
        vbs_covered = tuple(vb for vb, _ in rows)
        self._runs.add(StagedRun(vbs_covered, seqno_keys, stored, by_keys, by_key_values, key_set))
        self._bytes = stored_bytes
        first = 0
        mutations = self._mutations
        for (vb, row), n in zip(rows, sizes, strict=True):  # bounded by the runs
            end = first + n
            mutations[vb] = mutations.get(vb, 0) + ops[first:end].count(Op.MUTATION)
            row.high_seqno = seqnos[end - 1]
            first = end
        return True

    def _put_bodies_one_by_one(self, vb: int, items: Iterable[BodyItem]) -> None:
        """`put_body` of each of `items` (`put_bodies`' and `put_columns`' loop when a run
        is not clean or is short): the first bad one raises, naming itself."""
        for item in items:  # bounded by the run
            put = item.key, item.seqno, item.op
            self.put_body(vb, *put, datatype=item.datatype, cas=item.cas, body=item.body)

    def put_prepare(
        self,
        vb: int,
        key: bytes,
        seqno: int,
        op: Op,
        *,
        level: int,
        datatype: int,
        cas: int,
        body: bytes,
    ) -> None:
        """Keep a pending SyncWrite prepare of `key`: its document (`op` MUTATION or DELETION,
        `body` in that layout) and durability `level`, in the `prepared` database, not in
        `by_seqno`: no read or application stream sees it. The vbucket's high seqno moves to
        `seqno`, so a restart knows the seqno was used.

        Raises:
            ValueError: as for `put_body`, or `op` is not MUTATION/DELETION.
            RuntimeError: the batch has ended.
        """
        if op not in (Op.MUTATION, Op.DELETION):
            raise ValueError(f"vb {vb} seqno {seqno}: a prepare of {op!r}")
        row = self._row(vb)
        key_at = _MUTATION_EXTRAS_SIZE if op is Op.MUTATION else _DELETION_EXTRAS_SIZE
        _check_item(vb, row, key, seqno, len(body) - key_at - len(key), datatype)
        if body[key_at : key_at + len(key)] != key or _unpack_body_seqno(body)[0] != seqno:
            raise ValueError(f"vb {vb} seqno {seqno}: body is not this prepare's")
        if not 0 <= level <= 0xFF:
            raise ValueError(f"vb {vb} seqno {seqno}: durability level {level}")
        try:
            prefix = _pack_prefix(_TAGS[op], datatype, len(key), cas)
        except struct.error as error:
            raise ValueError(f"vb {vb} seqno {seqno}: field out of range: {error}") from None
        self._prepared[_VB_PREFIXES[vb] + key] = bytes((level,)) + prefix + body
        row.high_seqno = seqno

    def put_prepares(self, vb: int, items: Sequence[PreparedItem]) -> None:
        """`put_prepare` of each of `items`, in order (seqnos rising): the flusher's stretch
        of a vbucket's prepares, with the row looked up once and the checks inline.

        Raises:
            ValueError, RuntimeError: as for `put_prepare`; the items before the bad one stay
                in the batch (the flusher discards a batch that raised).
        """
        if not items:
            return
        row = self._row(vb)
        prepared = self._prepared
        vb_prefix = _VB_PREFIXES[vb]
        for item in items:  # bounded by the stretch
            op, key, seqno, body, datatype = (
                item.doc_op,
                item.key,
                item.seqno,
                item.body,
                item.datatype,
            )
            if op is Op.MUTATION:
                key_at = _MUTATION_EXTRAS_SIZE
            elif op is Op.DELETION:
                key_at = _DELETION_EXTRAS_SIZE
            else:
                raise ValueError(f"vb {vb} seqno {seqno}: a prepare of {op!r}")
            value_size = len(body) - key_at - len(key)
            if (
                seqno <= row.high_seqno
                or not 0 < len(key) <= _KEY_SIZE_MAX
                or value_size > _VALUE_SIZE_MAX
                or datatype & ~DATATYPE_MASK
            ):
                _check_item(vb, row, key, seqno, value_size, datatype)
            if not body.startswith(key, key_at) or _unpack_body_seqno(body)[0] != seqno:
                raise ValueError(f"vb {vb} seqno {seqno}: body is not this prepare's")
            level = item.level
            if not 0 <= level <= 0xFF:
                raise ValueError(f"vb {vb} seqno {seqno}: durability level {level}")
            try:
                prefix = _pack_prefix(_TAGS[op], datatype, len(key), item.cas)
            except struct.error as error:
                raise ValueError(f"vb {vb} seqno {seqno}: field out of range: {error}") from None
            prepared[vb_prefix + key] = _LEVEL_BYTES[level] + prefix + body
            row.high_seqno = seqno

    def end_prepare(self, vb: int, key: bytes, seqno: int = 0) -> None:
        """Forget the kept prepare of `key` (committed, aborted or overwritten), if any.

        A non-zero `seqno` is that of an abort, which stores nothing else: the vbucket's high
        seqno moves to it.

        Raises:
            ValueError: `seqno` not above the high seqno.
            RuntimeError: the batch has ended.
        """
        row = self._row(vb)
        if seqno:
            if seqno <= row.high_seqno:
                raise ValueError(f"vb {vb}: abort seqno {seqno} <= high seqno {row.high_seqno}")
            row.high_seqno = seqno
        self._prepared[_VB_PREFIXES[vb] + key] = None

    def put_record(self, record: Record) -> None:
        """Write a record received from elsewhere (replica path); `record.body` is stored as is.

        Raises:
            ValueError, RuntimeError: as for `set`.
        """
        row = self._row(record.vb)
        _check_item(record.vb, row, record.key, record.seqno, len(record.value), record.datatype)
        self._add(record.vb, row, record.key, record.seqno, record.op, encode_stored(record))

    def set_vbucket_meta(
        self,
        vb: int,
        *,
        state: VBucketState | str | None = None,
        failover_log: list[tuple[int, int]] | None = None,
        snap_start: int | None = None,
        snap_end: int | None = None,
        high_completed_seqno: int | None = None,
    ) -> None:
        """Create a vbucket or change its metadata; arguments left None keep their value
        (`high_completed_seqno` only moves up).

        A new vbucket needs `state`; it starts with an empty failover log and zero counters.

        Raises:
            ValueError: vb outside 0..VBUCKETS_MAX-1, a new vb without state, an unknown
                state, a failover log that is not pairs of u64 or is over
                FAILOVER_LOG_ENTRIES_MAX, or snap_start > snap_end after the change.
            RuntimeError: the batch has ended.
        """
        self._require_open()
        if type(vb) is not int or not 0 <= vb < limits.VBUCKETS_MAX:
            raise ValueError(f"vb {vb!r} outside 0..{limits.VBUCKETS_MAX - 1}")
        row = self._rows.get(vb) or self._committed.get(vb)
        if row is None and state is None:
            raise ValueError(f"vb {vb} is new: set_vbucket_meta needs its state")
        if state is not None:
            new_state = check_state(state)
        else:
            assert row is not None, vb
            new_state = row.state
        log = check_failover_log(failover_log) if failover_log is not None else None
        start = snap_start if snap_start is not None else row.snap_start if row else 0
        end = snap_end if snap_end is not None else row.snap_end if row else 0
        if not (type(start) is int and type(end) is int and 0 <= start <= end <= _U64_MAX):
            raise ValueError(f"vb {vb}: snapshot range {start!r}..{end!r} is not u64 start <= end")
        working = (
            self._row(vb) if row is not None else self._rows.setdefault(vb, VbState(new_state))
        )
        working.state = new_state
        working.failover_log = log if log is not None else working.failover_log
        working.snap_start, working.snap_end = start, end
        if high_completed_seqno is not None:
            if type(high_completed_seqno) is not int or not 0 <= high_completed_seqno <= _U64_MAX:
                raise ValueError(f"vb {vb}: high_completed_seqno {high_completed_seqno!r}")
            working.high_completed_seqno = max(working.high_completed_seqno, high_completed_seqno)
        assert working.problem() is None, (vb, working)

    def apply(
        self,
        txn: lmdb.Transaction[bytes],
        by_seqno: lmdb._Database,
        by_key: lmdb._Database,
        vbmeta: lmdb._Database,
        prepared: lmdb._Database | None = None,
    ) -> dict[int, VbState]:
        """Write the batch into `txn`, the store's write transaction; the batch then ends.

        Returns:
            vb -> new metadata of every vbucket the batch touched, already written to `vbmeta`;
            the store adopts them once `txn` has committed.

        Raises:
            CorruptRecordError: a by_key entry is malformed or points at a missing record.
        """
        self._require_open()
        self._open = False
        if self._keys or self._runs:
            self._apply_items(txn, by_seqno, by_key)
        if self._prepared:
            assert prepared is not None, "a batch with prepares needs the prepared database"
            kept_now = [(key, kept) for key, kept in self._prepared.items() if kept is not None]
            if len(kept_now) < len(self._prepared):
                delete = txn.delete
                for key, kept in self._prepared.items():  # bounded by the batch
                    if kept is None:
                        delete(key, db=prepared)
            if kept_now:  # one C call for the prepares kept (each key once: a dict's)
                consumed, _ = txn.cursor(db=prepared).putmulti(kept_now)
                assert consumed == len(kept_now), (consumed, len(kept_now))
        for vb, row in self._rows.items():
            txn.put(VB_KEY.pack(vb), encode_vbstate(row), db=vbmeta)  # encode checks invariants
        return self._rows

    def close(self) -> None:
        """End the batch without applying it (the store calls this when the block raised)."""
        self._open = False
        self._records.clear()
        self._keys.clear()
        self._runs.clear()
        self._mutations.clear()
        self._prepared.clear()

    def _apply_items(
        self, txn: lmdb.Transaction[bytes], by_seqno: lmdb._Database, by_key: lmdb._Database
    ) -> None:
        count_delta = dict.fromkeys(self._rows, 0)
        count_delta.update(self._mutations)
        runs = self._runs
        by_keys = itertools.chain(self._keys, runs.by_keys()) if runs else self._keys
        found = txn.cursor(db=by_key).getmulti(by_keys)
        if found:  # the versions this batch replaces (updates, not inserts)
            for vb, replaced in drop_replaced(txn, by_seqno, found).items():
                count_delta[vb] -= replaced
        # Sorting the records first was measured: no faster (the same pages are touched).
        # A clean run goes from its lists (staged_runs.py); each version is held once.
        versions = len(self._records) + len(runs)
        records = itertools.chain(self._records.items(), runs.records())
        consumed, added = txn.cursor(db=by_seqno).putmulti(records, dupdata=False)
        assert consumed == added == versions, (consumed, added, versions)
        entries = itertools.chain(self._keys.items(), runs.entries())
        consumed, added = txn.cursor(db=by_key).putmulti(entries, dupdata=False)
        assert consumed == added == versions, (consumed, added, versions)
        for vb, delta in count_delta.items():
            row = self._rows[vb]
            row.item_count += delta
            assert row.item_count >= 0, (vb, row)

    def _row(self, vb: int) -> VbState:
        self._require_open()
        row = self._rows.get(vb)
        if row is None:
            committed = self._committed.get(vb)
            if committed is None:
                raise ValueError(
                    f"vb {vb!r} has no metadata: create it with set_vbucket_meta(vb, state=...) "
                    "first (it may be in the same batch)"
                )
            row = self._rows[vb] = committed.copy()
        return row

    def _add(self, vb: int, row: VbState, key: bytes, seqno: int, op: Op, stored: bytes) -> None:
        if self._bytes + len(stored) > limits.STORAGE_BATCH_BYTES_MAX:
            raise ValueError(
                f"batch would hold {self._bytes + len(stored)} bytes, over "
                "limits.STORAGE_BATCH_BYTES_MAX: commit it and start another"
            )
        by_key_key = _VB_PREFIXES[vb] + key
        if self._runs:
            self._unstage_holding(vb, by_key_key)
        previous = self._keys.get(by_key_key)
        mutations = self._mutations.get(vb, 0) + (op == Op.MUTATION)
        if previous is not None:  # the key was written earlier in this batch: drop that version
            previous_seqno, previous_op = BY_KEY_VALUE.unpack(previous)
            self._bytes -= len(self._records.pop(_pack_seqno_key(vb, previous_seqno)))
            mutations -= previous_op == Op.MUTATION
        self._mutations[vb] = mutations
        self._records[_pack_seqno_key(vb, seqno)] = stored
        self._keys[by_key_key] = _pack_by_key_value(seqno, op)
        self._bytes += len(stored)
        row.high_seqno = seqno

    def _unstage_holding(self, vb: int, by_key_key: bytes) -> None:
        """Move the clean run holding `by_key_key` (if one does) into the dicts, where a
        write of the key replaces it (`_add`)."""
        run = self._runs.take_holding(vb, by_key_key)
        if run is not None:
            self._records.update(zip(run.seqno_keys, run.stored, strict=True))
            self._keys.update(zip(run.by_keys, run.by_key_values, strict=True))

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError("this write batch has ended; start another with store.write_batch()")


def _bodies_hold_fields(
    sizes: list[int],
    keys: Sequence[bytes],
    seqnos: Sequence[int],
    bodies: Sequence[bytes],
    ops: list[Op],
) -> bool:
    """The BodyItem contract (the body holds the item's key and seqno where its op puts
    them) of runs of `sizes` items laid end to end in the columns, checked as `put_bodies`
    checks it: every item of a run shorter than CLEAN_RUN_MIN
    (which `put_bodies` puts one by one), the ends of a longer one (its items were built from
    their fields by the checkpoint, or its columns decoded from the bodies)."""
    first = 0
    for n in sizes:  # bounded by the runs
        picks = range(first, first + n) if n < CLEAN_RUN_MIN else (first, first + n - 1)
        for at in picks:  # at most CLEAN_RUN_MIN - 1 items
            body = bodies[at]
            if not body.startswith(keys[at], _EXTRAS_SIZE_OF_OP[ops[at]]) or (
                _unpack_body_seqno(body)[0] != seqnos[at]
            ):
                return False
        first += n
    assert first == len(keys), (first, len(keys))
    return True


def _bodies_hold_extras_and_keys(
    body_sizes: list[int], key_sizes: list[int], key_size_max: int, ops: list[Op]
) -> bool:
    """Each body is at least its op's extras plus its key: one pass when every body clears
    the largest extras plus the longest key (a run of mutations), else item by item."""
    if min(body_sizes) >= _MUTATION_EXTRAS_SIZE + key_size_max:
        return True
    heads = map(operator.add, map(_EXTRAS_SIZE_OF_OP.__getitem__, ops), key_sizes)
    shortest: int = min(map(operator.sub, body_sizes, heads))
    return shortest >= 0


def _check_item(
    vb: int, row: VbState, key: bytes, seqno: int, value_size: int, datatype: int
) -> None:
    if seqno <= row.high_seqno:
        raise ValueError(f"vb {vb}: seqno {seqno} must be above the high seqno {row.high_seqno}")
    if not 0 < len(key) <= limits.STORED_KEY_SIZE_MAX:
        raise ValueError(
            f"vb {vb} seqno {seqno}: key length {len(key)} outside 1..STORED_KEY_SIZE_MAX"
        )
    if value_size > limits.VALUE_SIZE_MAX:
        raise ValueError(f"vb {vb} seqno {seqno}: value of {value_size} bytes over VALUE_SIZE_MAX")
    if datatype & ~DATATYPE_MASK:
        raise ValueError(f"vb {vb} seqno {seqno}: datatype {datatype!r} has bits above 0x07")
