"""Batch decoding: a received buffer → columns of changes plus the control frames between them.

The per-item hot path of a consumer. Instead of one ``Frame`` and one message object per
mutation, every classic-magic DCP mutation/deletion/expiration of a buffer becomes one entry of
``ChangeColumns``. Anything else (snapshot markers, stream ends, noops, responses, items with a
stream-id) is decoded as a ``Frame`` and returned with its position, so the caller can
interleave control and data in wire order.

One call, with one Python step per frame (ARCHITECTURE.md, protocol/: the hot path is
batch-shaped):

1. ``_walk`` finds where each complete frame starts, reading only the body length of each
   header (offset 8 in both header layouts). It trusts nothing else yet.
2. The frames found are checked and decoded together, one of two ways that give equal results:

   * vectorised (``VECTORISE_FRAMES_MIN`` frames or more): one numpy gather copies the first
     55 bytes (header + the longest extras) of every frame into an array read through a
     structured dtype built from the declared layouts (frame.py, dcp_items.py); every check is
     a mask over all frames. The first frame that fails any check is handed to the per-frame
     code, which raises its exact error; a test holds the two ways equal on every input;
   * per frame (pure Python; short runs, and the reference): ``check_header``, then one
     ``struct.unpack_from`` over header and extras per item, the checks of ``dcp_items``.

3. Keys and values are not sliced one by one: the bytes from the first change to the end of
   the last are copied once into ``ChangeColumns.data``, and each change holds offsets into it
   (Arrow's binary layout; consumer/change_rows.py builds Arrow arrays from it without a
   per-row step). The buffer given is never copied as a whole, and never kept.

Validation is the same as the per-frame path (``check_header`` first, then the item rules); the
tests hold ``decode_batch`` equal to ``FrameReader.next_frame`` + the message decoders.

Not here: pyarrow (protocol/ stays bytes and numpy), stream-ids on items, flow control.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from changefeed import limits
from changefeed.protocol.dcp_items import (
    ABORT_EXTRAS,
    DELETION_V1_EXTRAS,
    DELETION_V1_EXTRAS_FORMAT,
    DELETION_V1_PREFIX,
    DELETION_V2_EXTRAS,
    DELETION_V2_EXTRAS_FORMAT,
    DELETION_V2_PREFIX,
    EXPIRATION_EXTRAS,
    EXPIRATION_EXTRAS_FORMAT,
    EXPIRATION_PREFIX,
    MUTATION_EXTRAS,
    MUTATION_EXTRAS_FORMAT,
    MUTATION_PREFIX,
    PREPARE_EXTRAS,
)
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import (
    ALT_HEADER,
    HEADER_FORMAT,
    KNOWN_MAGICS,
    Frame,
    check_header,
    decode_frame,
)
from changefeed.protocol.opcode import DATATYPE_MASK, Magic, Opcode
from changefeed.protocol.status import Status
from changefeed.protocol.sync_columns import (
    OP_COMMIT,
    OP_PREPARE,
    SyncColumns,
    is_sync,
    sync_row,
)
from changefeed.protocol.sync_columns import Row as SyncRow

Buffer = bytes | bytearray | memoryview

_HEADER_SIZE: Final = limits.HEADER_SIZE
# Header + extras in one unpack per item; the layouts are declared once, in dcp_items.py.
_MUTATION = MUTATION_PREFIX
_DELETION_V1 = DELETION_V1_PREFIX
_DELETION_V2 = DELETION_V2_PREFIX
_EXPIRATION = EXPIRATION_PREFIX
assert _MUTATION.size == _HEADER_SIZE + MUTATION_EXTRAS.size
assert _DELETION_V1.size == _HEADER_SIZE + DELETION_V1_EXTRAS.size
assert _DELETION_V2.size == _HEADER_SIZE + DELETION_V2_EXTRAS.size
assert _EXPIRATION.size == _HEADER_SIZE + EXPIRATION_EXTRAS.size

ITEM_OPCODES = (Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION)
_REQUEST = int(Magic.REQUEST)
_OP_MUTATION = int(Opcode.DCP_MUTATION)
_OP_DELETION = int(Opcode.DCP_DELETION)
_OP_EXPIRATION = int(Opcode.DCP_EXPIRATION)
_MUTATION_SIZE = _MUTATION.size
_BODYLEN = struct.Struct(">I")  # total body length, at offset 8 of both header layouts
_BODYLEN_AT = 8
assert struct.calcsize(HEADER_FORMAT[:7]) == _BODYLEN_AT, HEADER_FORMAT
assert struct.calcsize(ALT_HEADER.format[:8]) == _BODYLEN_AT, ALT_HEADER.format

# Below this many frames the per-frame decoder is cheaper: numpy costs about 55 µs per call
# (some 60 array operations of ~1 µs on short arrays) + 0.16 µs per frame, the per-frame decoder
# 5 µs + 0.7 µs per frame (mutations of 171 bytes, bench/bench_codec.py's, on the bench machine);
# they cross near 95 frames. A busy stream's reads (256 KiB) hold ~1,500.
VECTORISE_FRAMES_MIN: Final = 96


# -- columns ----------------------------------------------------------------------------------

# The fixed-width fields of a change, at the wire's widths (native byte order in the arrays).
FIELD_DTYPES: Final[Mapping[str, type[np.unsignedinteger[Any]]]] = {
    "opcode": np.uint8,
    "vbucket": np.uint16,
    "opaque": np.uint32,
    "seqno": np.uint64,
    "rev_seqno": np.uint64,
    "cas": np.uint64,
    "flags": np.uint32,  # 0 unless a mutation
    "expiry": np.uint32,  # 0 unless a mutation
    "delete_time": np.uint32,  # 0 for mutations and V1 deletions
    "datatype": np.uint8,
}
# Where each change's key and value lie in ``ChangeColumns.data``.
OFFSET_NAMES: Final = ("key_start", "key_end", "value_end")
_DTYPES: Final[Mapping[str, type[np.integer[Any]]]] = {
    **FIELD_DTYPES,
    **dict.fromkeys(OFFSET_NAMES, np.int64),
}

Column = NDArray[Any] | list[int]


class _IntColumn:
    """A fixed-width column as a list of ints, for code that reads change by change."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        assert name in FIELD_DTYPES, name
        self.name = name

    def __get__(self, columns: ChangeColumns, owner: type | None = None) -> list[int]:
        return columns._int_list(self.name)


class _BytesColumn:
    """Keys or values as a list of bytes, for code that reads change by change."""

    __slots__ = ("bounds",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.bounds = {"key": ("key_start", "key_end"), "value": ("key_end", "value_end")}[name]

    def __get__(self, columns: ChangeColumns, owner: type | None = None) -> list[bytes]:
        return columns._bytes_list(*self.bounds)


class ChangeColumns:
    """Changes as columns, one entry per change, in wire order. ``opcode`` tells the kind.

    Each field of ``FIELD_DTYPES`` and each offset of ``OFFSET_NAMES`` is one column; keys and
    values lie in one bytes buffer ``data``: change ``i`` has key
    ``data[key_start[i]:key_end[i]]`` and value ``data[key_end[i]:value_end[i]]``, and the
    offsets rise through the changes (Arrow's binary layout, interleaved).

    Two views of every column, each built from the other on first use and then kept:

    * ``array(name)``: a read-only numpy array, for vectorised readers;
    * the attribute of the field's name (``seqno``, ``key``...): a list of Python ints, or of
      bytes for ``key`` and ``value``, for readers that go change by change. Treat it as
      read-only.

    The numpy decoder builds arrays and the per-frame decoder lists: neither pays for the view
    its reader does not use.
    """

    __slots__ = ("_arrays", "_count", "_lists", "data")

    opcode = _IntColumn()
    vbucket = _IntColumn()
    opaque = _IntColumn()
    seqno = _IntColumn()
    rev_seqno = _IntColumn()
    cas = _IntColumn()
    flags = _IntColumn()
    expiry = _IntColumn()
    delete_time = _IntColumn()
    datatype = _IntColumn()
    key = _BytesColumn()
    value = _BytesColumn()

    def __init__(self, columns: Mapping[str, Column] | None = None, data: bytes = b"") -> None:
        """No arguments: no changes. Else every name of ``FIELD_DTYPES`` and ``OFFSET_NAMES``,
        each an integer numpy array of that dtype (it becomes read-only) or a list of ints."""
        self.data = data
        self._arrays: dict[str, NDArray[Any]] = {}
        self._lists: dict[str, list[int] | list[bytes]] = {}
        if columns is None:  # every Batch starts with one: shared read-only arrays, no lists
            assert not data, len(data)
            self._count = 0
            self._arrays.update(_NO_CHANGES)
            return
        assert columns.keys() == _DTYPES.keys(), sorted(columns)
        for name, column in columns.items():
            if isinstance(column, np.ndarray):
                self._arrays[name] = _frozen(column, _DTYPES[name])
            else:
                self._lists[name] = column
        self._count = len(columns["seqno"])
        assert all(len(c) == self._count for c in columns.values()), self._lengths()
        if self._count:  # O(1) here; every offset is checked in _check_invariants()
            assert columns["key_start"][0] >= 0, columns["key_start"][0]
            assert columns["value_end"][-1] <= len(data), (columns["value_end"][-1], len(data))

    @classmethod
    def _of_lists(cls, lists: dict[str, list[int] | list[bytes]], data: bytes) -> ChangeColumns:
        """The per-frame decoder's columns: lists it built, every name of ``_DTYPES``."""
        columns = cls.__new__(cls)
        columns.data = data
        columns._arrays = {}
        columns._lists = lists
        columns._count = len(lists["seqno"])
        assert len(lists) == len(_DTYPES), sorted(lists)  # each as long: _check_invariants()
        return columns

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"ChangeColumns({len(self)} changes, {len(self.data)} data bytes)"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChangeColumns):
            return NotImplemented
        return (
            len(self) == len(other)
            and all(self._int_list(name) == other._int_list(name) for name in FIELD_DTYPES)
            and self.key == other.key
            and self.value == other.value
        )

    __hash__ = None  # type: ignore[assignment]  # compared by content

    def array(self, name: str) -> NDArray[Any]:
        """The column ``name`` (of ``FIELD_DTYPES`` or ``OFFSET_NAMES``) as a read-only array."""
        array = self._arrays.get(name)
        if array is None:
            dtype = _DTYPES[name]
            array = self._arrays[name] = _frozen(np.array(self._lists[name], dtype), dtype)
        return array

    @property
    def key_start(self) -> NDArray[np.int64]:
        return self.array("key_start")

    @property
    def key_end(self) -> NDArray[np.int64]:
        return self.array("key_end")

    @property
    def value_end(self) -> NDArray[np.int64]:
        return self.array("value_end")

    def slice(self, start: int, stop: int) -> ChangeColumns:
        """Changes ``start`` to ``stop``, sharing ``data`` (arrays are sliced as views)."""
        assert 0 <= start <= stop <= len(self), (start, stop, len(self))
        if start == 0 and stop == len(self):
            return self
        columns: dict[str, Column] = {}
        for name in _DTYPES:
            array = self._arrays.get(name)
            columns[name] = self._int_list(name)[start:stop] if array is None else array[start:stop]
        return ChangeColumns(columns, self.data)

    def _check_invariants(self) -> None:
        """O(n): offsets rise and stay in ``data``, keys are not empty, opcodes are items; the
        two views agree where both exist."""
        starts, key_ends, value_ends = self.key_start, self.key_end, self.value_end
        assert bool(np.all(starts < key_ends)), "a key is empty or its offsets fall"
        assert bool(np.all(key_ends <= value_ends)), "a value's offsets fall"
        assert bool(np.all(value_ends[:-1] <= starts[1:])), "changes overlap in data"
        if len(self):
            assert starts[0] >= 0, starts[0]
            assert value_ends[-1] <= len(self.data), (value_ends[-1], len(self.data))
        assert bool(np.isin(self.array("opcode"), [int(op) for op in ITEM_OPCODES]).all())
        for name in _DTYPES:
            assert name in self._arrays or name in self._lists, name
            if name in self._arrays and name in self._lists:
                assert self._arrays[name].tolist() == self._lists[name], name

    def _lengths(self) -> dict[str, int]:
        return {name: len(c) for name, c in (*self._arrays.items(), *self._lists.items())}

    def _int_list(self, name: str) -> list[int]:
        listed = self._lists.get(name)
        if listed is None:
            listed = self._lists[name] = self._arrays[name].tolist()
        return listed  # type: ignore[return-value]  # ints (bytes only under "key"/"value")

    def _bytes_list(self, start_name: str, end_name: str) -> list[bytes]:
        name = "key" if start_name == "key_start" else "value"
        listed = self._lists.get(name)
        if listed is None:
            data = self.data
            bounds = zip(self._int_list(start_name), self._int_list(end_name), strict=True)
            listed = self._lists[name] = [data[a:b] for a, b in bounds]
        return listed  # type: ignore[return-value]


def _frozen(array: NDArray[Any], dtype: type[np.integer[Any]]) -> NDArray[Any]:
    assert array.ndim == 1, array.shape
    assert array.dtype == dtype, (array.dtype, dtype)
    array.flags.writeable = False  # the columns own it; slices share it
    return array


_NO_CHANGES: Final = {name: _frozen(np.empty(0, dtype), dtype) for name, dtype in _DTYPES.items()}


@dataclass(slots=True)
class Batch:
    """What one ``decode_batch`` call found.

    Attributes:
        changes: the data items, as columns.
        controls: ``(position, frame)`` pairs; ``position`` = changes that precede the frame.
        syncs: the DCP_PREPAREs and DCP_COMMITs (sync_columns.py), each with where it sits
            among the changes and controls; empty unless decoded with ``sync_columns``.
        consumed: bytes of the buffer used (whole frames only).
        item_bytes: wire bytes of the changes (what flow control acks; not of the syncs).
    """

    changes: ChangeColumns = field(default_factory=ChangeColumns)
    controls: list[tuple[int, Frame]] = field(default_factory=list)
    syncs: SyncColumns = field(default_factory=SyncColumns)
    consumed: int = 0
    item_bytes: int = 0

    def keep_controls(self, keep: list[bool]) -> None:
        """Drop the control frames whose ``keep`` entry is False (a connection took them: its
        own responses), and count the sync rows' places among the rest, so the batch reads as
        if those frames had never been on the wire."""
        assert len(keep) == len(self.controls), (len(keep), len(self.controls))
        kept_before = list(itertools.accumulate(keep, initial=0))  # per control, and the end
        self.controls = list(itertools.compress(self.controls, keep))
        if len(self.syncs) and len(self.controls) < len(keep):
            self.syncs.renumber_controls(kept_before)


# -- the call ---------------------------------------------------------------------------------


def decode_batch(
    buffer: Buffer,
    start: int = 0,
    *,
    frame_size_max: int = limits.FRAME_SIZE_MAX,
    items_max: int = 1 << 20,
    vectorise: bool | None = None,
    sync_columns: bool = True,
) -> Batch:
    """Decode every complete frame in ``buffer[start:]`` (up to ``items_max`` changes).

    Args:
        vectorise: decode with numpy (True) or per frame (False); None picks by the number of
            frames (``VECTORISE_FRAMES_MIN``). The result is the same either way.
        sync_columns: DCP_PREPAREs and DCP_COMMITs that their decoders would take go to
            ``Batch.syncs`` (True) instead of ``controls`` as frames (False: the reference).

    Raises:
        ProtocolError: as the per-frame decoders would, at the first bad frame.
    """
    assert 0 <= start <= len(buffer), (start, len(buffer))
    assert items_max >= 0, items_max
    starts, stop, whole = _walk_items(buffer, start, items_max)
    if vectorise is None:
        vectorise = len(starts) >= VECTORISE_FRAMES_MIN
    if not starts:
        batch = Batch()
    elif vectorise:
        batch = _decode_vectorised(buffer, starts, stop, frame_size_max, sync_columns)
    else:
        batch = _decode_per_frame(buffer, starts, stop, frame_size_max, sync_columns)
    if whole and len(buffer) - stop >= _HEADER_SIZE:
        # An unfinished frame follows: refuse a bad header before its body is awaited.
        check_header(buffer, stop, frame_size_max)
    batch.consumed = stop - start
    assert len(batch.changes) <= items_max, (len(batch.changes), items_max)
    return batch


def _walk_items(buffer: Buffer, pos: int, items_max: int) -> tuple[list[int], int, bool]:
    """Starts of the complete frames from ``pos`` holding at most ``items_max`` items, where
    they end, and whether the walk stopped for want of bytes (not for ``items_max``)."""
    starts: list[int] = []
    budget = items_max
    while True:  # bounded: a round that walks no frame ends it, and the buffer is finite
        walked, pos = _walk(buffer, pos, budget)
        starts += walked
        if len(walked) < budget:
            return starts, pos, True
        # Only when the budget ran out (a caller's small items_max): frames are counted as
        # items so far; count again, per frame, and go on while controls took the budget.
        budget -= sum(1 for at in walked if _is_item(buffer, at))
        assert budget >= 0, budget
        if budget == 0:
            return starts, pos, False


def _walk(buffer: Buffer, pos: int, frames_max: int) -> tuple[list[int], int]:
    """Starts of up to ``frames_max`` complete frames from ``pos``, and where they end.

    The one Python step per frame: read the declared body length, step over the frame. No
    length is trusted here beyond stepping over bytes that have arrived; the decoders check
    every header of the frames walked, in order, before anything is used.
    """
    unpack_from = _BODYLEN.unpack_from
    end = len(buffer)
    last_header = end - _HEADER_SIZE
    starts: list[int] = []
    append = starts.append
    for _ in itertools.repeat(None, frames_max):
        if pos > last_header:
            break
        (bodylen,) = unpack_from(buffer, pos + _BODYLEN_AT)
        following = pos + _HEADER_SIZE + bodylen
        if following > end:
            break
        append(pos)
        pos = following
    return starts, pos


def _is_item(buffer: Buffer, pos: int) -> bool:
    return buffer[pos] == _REQUEST and buffer[pos + 1] in ITEM_OPCODES


def _ends(starts: list[int], stop: int) -> Iterator[tuple[int, int]]:
    return zip(starts, itertools.chain(itertools.islice(starts, 1, None), (stop,)), strict=True)


# -- per frame (pure Python) ------------------------------------------------------------------


# A change as the per-frame decoder yields it: the fields in FIELD_DTYPES order, then where its
# key starts, where its key ends and where its frame ends (offsets in the buffer).
_Row = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int]


def _decode_per_frame(
    buffer: Buffer, starts: list[int], stop: int, frame_size_max: int, sync_columns: bool
) -> Batch:
    """The walked frames one by one: ``check_header``, then one unpack per item."""
    batch = Batch()
    rows: list[_Row] = []
    sync_rows: list[SyncRow] = []
    first = -1  # where the first item starts: offsets count from there
    for pos, following in _ends(starts, stop):
        total = following - pos
        if buffer[pos] == _REQUEST and buffer[pos + 1] == _OP_MUTATION and total >= _MUTATION_SIZE:
            first = pos if first < 0 else first
            rows.append(_mutation_row(buffer, pos, total, frame_size_max, first))
        else:
            assert _HEADER_SIZE + check_header(buffer, pos, frame_size_max) == total, pos
            if not _is_item(buffer, pos):
                if sync_columns and is_sync(buffer, pos):
                    row = sync_row(buffer, pos, total, len(rows), len(batch.controls))
                    if row is not None:
                        sync_rows.append(row)
                        continue
                batch.controls.append((len(rows), decode_frame(buffer, pos, total)))
                continue
            first = pos if first < 0 else first
            rows.append(_item_row(buffer, pos, total, first))
        batch.item_bytes += total
    if rows:
        transposed = map(list, zip(*rows, strict=True))  # in C: one list per column
        lists: dict[str, list[int] | list[bytes]] = dict(zip(_DTYPES, transposed, strict=True))
        data = bytes(memoryview(buffer)[first : first + rows[-1][-1]])
        batch.changes = ChangeColumns._of_lists(lists, data)
    if sync_rows:
        batch.syncs = SyncColumns(sync_rows)
    return batch


def _mutation_row(buffer: Buffer, pos: int, total: int, frame_size_max: int, base: int) -> _Row:
    """The common case: a classic-magic DCP_MUTATION, header and extras in one unpack.

    Checks exactly what ``check_header`` and ``_item_row`` check, in the same order.
    """
    (_, _, keylen, extlen, datatype, vb, bodylen, opaque, cas,
     seqno, rev, flags, expiry, _, nmeta, _) = _MUTATION.unpack_from(buffer, pos)  # fmt: skip
    assert _HEADER_SIZE + bodylen == total, (pos, bodylen, total)
    if bodylen > frame_size_max:
        raise ProtocolError(f"body of {bodylen} bytes exceeds {frame_size_max}", Status.E2BIG)
    if datatype & ~DATATYPE_MASK:
        raise ProtocolError(f"invalid datatype 0x{datatype:02x}", Status.EINVAL)
    if extlen + keylen > bodylen:
        raise ProtocolError(
            f"framing 0 + extras {extlen} + key {keylen} > body {bodylen}", Status.EINVAL
        )
    if extlen != MUTATION_EXTRAS.size:
        raise ProtocolError(f"DCP_MUTATION with extras of {extlen} bytes")
    _check_item(seqno, nmeta, keylen)
    key_at = pos + _MUTATION_SIZE - base
    return (_OP_MUTATION, vb, opaque, seqno, rev, cas, flags, expiry, 0, datatype,
            key_at, key_at + keylen, pos + total - base)  # fmt: skip


def _item_row(buffer: Buffer, pos: int, total: int, base: int) -> _Row:
    """Any DCP item whose header ``check_header`` passed (offsets counted from ``base``)."""
    opcode = buffer[pos + 1]
    extlen = buffer[pos + 4]
    expiry = flags = delete_time = nmeta = 0
    if opcode == _OP_MUTATION and extlen == MUTATION_EXTRAS.size:
        fields = _MUTATION.unpack_from(buffer, pos)
        seqno, rev, flags, expiry, _, nmeta, _ = fields[9:]
    elif opcode == _OP_DELETION and extlen == DELETION_V2_EXTRAS.size:
        fields = _DELETION_V2.unpack_from(buffer, pos)
        seqno, rev, delete_time, _ = fields[9:]
    elif opcode == _OP_DELETION and extlen == DELETION_V1_EXTRAS.size:
        fields = _DELETION_V1.unpack_from(buffer, pos)
        seqno, rev, nmeta = fields[9:]
    elif opcode == _OP_EXPIRATION and extlen == EXPIRATION_EXTRAS.size:
        fields = _EXPIRATION.unpack_from(buffer, pos)
        seqno, rev, delete_time = fields[9:]
    else:
        name = Opcode(opcode).name
        raise ProtocolError(f"{name} with extras of {extlen} bytes")
    keylen = fields[2]
    _check_item(seqno, nmeta, keylen)
    key_at = pos + _HEADER_SIZE + extlen - base
    return (opcode, fields[5], fields[7], seqno, rev, fields[8], flags, expiry, delete_time,
            fields[4], key_at, key_at + keylen, pos + total - base)  # fmt: skip


def _check_item(seqno: int, nmeta: int, keylen: int) -> None:
    # dcp-wire.md §7.3: by_seqno must be non-zero, nmeta is always 0 now; an item has a key.
    if seqno == 0:
        raise ProtocolError("DCP item with seqno 0")
    if nmeta:
        raise ProtocolError(f"DCP item with nmeta {nmeta}")
    if not keylen:
        raise ProtocolError("DCP item without a key")


# -- vectorised (numpy) -----------------------------------------------------------------------

_NUMPY_CODES: Final = {"B": "u1", "H": ">u2", "I": ">u4", "Q": ">u8"}


def _layout(struct_format: str, names: tuple[str, ...], at: int) -> list[tuple[str, str, int]]:
    """``(name, numpy dtype, offset)`` for each field of a big-endian struct format."""
    assert struct_format.startswith(">"), struct_format
    codes = struct_format[1:]
    assert len(codes) == len(names), (codes, names)
    out = []
    for code, name in zip(codes, names, strict=True):
        if name:
            out.append((name, _NUMPY_CODES[code], at))
        at += struct.calcsize(">" + code)
    return out


def _prefix_dtype() -> np.dtype[np.void]:
    """The first 55 bytes of a frame, every layout at once (fields overlap where the layouts
    differ: the decoder picks per frame). Built from the declared formats, not restated."""
    header = ("magic", "opcode", "keylen", "extlen", "datatype", "vbucket", "", "opaque", "cas")
    alt_header = ("", "", "alt_framelen", "alt_keylen", "", "", "", "", "", "")
    mutation = ("seqno", "rev_seqno", "flags", "expiry", "", "mutation_nmeta", "")
    at = _HEADER_SIZE  # the extras
    fields = [
        *_layout(">H", ("code",), 0),  # magic and opcode as one u16
        *_layout(HEADER_FORMAT, header, 0),
        *_layout(ALT_HEADER.format, alt_header, 0),
        *_layout(MUTATION_EXTRAS_FORMAT, mutation, at),
        *_layout(DELETION_V1_EXTRAS_FORMAT, ("", "", "deletion_v1_nmeta"), at),
        *_layout(DELETION_V2_EXTRAS_FORMAT, ("", "", "deletion_v2_delete_time", ""), at),
        *_layout(EXPIRATION_EXTRAS_FORMAT, ("", "", "expiration_delete_time"), at),
        # DCP_PREPARE: seqno, rev_seqno, flags and expiry where a mutation has them.
        *_layout(PREPARE_EXTRAS.format, ("",) * 6 + ("prepare_deleted", "prepare_level"), at),
        *_layout(ABORT_EXTRAS.format, ("ending_prepared", "ending_seqno"), at),  # DCP_COMMIT
    ]
    names, formats, offsets = zip(*fields, strict=True)
    return np.dtype(
        {"names": names, "formats": formats, "offsets": offsets, "itemsize": _MUTATION_SIZE}
    )


_PREFIX: Final = _prefix_dtype()
_PREFIX_BYTES: Final = np.arange(_MUTATION_SIZE, dtype=np.int64)
assert _PREFIX.itemsize == max(p.size for p in (_MUTATION, _DELETION_V1, _DELETION_V2))
assert _PREFIX.fields is not None
# _columns reads both delete times through one field: the layouts put them at one offset.
assert _PREFIX.fields["expiration_delete_time"] == _PREFIX.fields["deletion_v2_delete_time"]
# _sync_columns reads a prepare's seqnos, flags and expiry through the mutation's fields.
assert PREPARE_EXTRAS.format[:5] == MUTATION_EXTRAS_FORMAT[:5] == ">QQII", PREPARE_EXTRAS.format
assert _HEADER_SIZE + PREPARE_EXTRAS.size == _PREFIX.itemsize


def _byte_table(members: Iterable[int]) -> NDArray[np.bool_]:
    """A 256-entry lookup: ``table[byte_array]`` is a membership mask (one gather)."""
    table = np.zeros(256, np.bool_)
    table[list(members)] = True
    return table


_KNOWN_MAGIC: Final = _byte_table(KNOWN_MAGICS)
_ALT_MAGIC: Final = _byte_table((Magic.ALT_REQUEST, Magic.ALT_RESPONSE))
# Frames that become changes, by the header's first two bytes (magic, opcode) as one u16.
_ITEM_CODE: Final = np.zeros(1 << 16, np.bool_)
_ITEM_CODE[[(_REQUEST << 8) | opcode for opcode in ITEM_OPCODES]] = True
# The extras layout of an item, by (opcode, extras length); anything else is refused.
_NOT_AN_ITEM, _MUTATION_LAYOUT, _DELETION_V1_LAYOUT, _DELETION_V2_LAYOUT, _EXPIRATION_LAYOUT = (
    range(5)
)
_ITEM_LAYOUT: Final = np.zeros((256, 256), np.uint8)
_ITEM_LAYOUT[_OP_MUTATION, MUTATION_EXTRAS.size] = _MUTATION_LAYOUT
_ITEM_LAYOUT[_OP_DELETION, DELETION_V1_EXTRAS.size] = _DELETION_V1_LAYOUT
_ITEM_LAYOUT[_OP_DELETION, DELETION_V2_EXTRAS.size] = _DELETION_V2_LAYOUT
_ITEM_LAYOUT[_OP_EXPIRATION, EXPIRATION_EXTRAS.size] = _EXPIRATION_LAYOUT
assert int(np.count_nonzero(_ITEM_LAYOUT)) == 4
# datatype & ~DATATYPE_MASK != 0 is datatype > DATATYPE_MASK: the mask is the low bits.
assert DATATYPE_MASK & (DATATYPE_MASK + 1) == 0, DATATYPE_MASK


def _decode_vectorised(
    buffer: Buffer, starts: list[int], stop: int, frame_size_max: int, sync_columns: bool
) -> Batch:
    """The walked frames at once: gather every prefix, check with masks, decode columns."""
    at = np.array(starts, np.int64)
    following = np.empty_like(at)
    following[:-1] = at[1:]
    following[-1] = stop
    prefix = _prefixes(buffer, at)
    p = prefix.view(_PREFIX)[:, 0]
    is_item, layout, bad = _vectorised_checks(p, following - at - _HEADER_SIZE, frame_size_max)
    first_bad = int(np.argmax(bad)) if bad.any() else len(starts)
    batch = Batch()
    # Controls in order, up to the first bad frame; decoding one may raise first (stream-id).
    position: NDArray[np.intp] = np.cumsum(is_item) - is_item
    is_control = ~is_item
    if sync_columns:  # sync frames their decoders take are rows, not controls
        sync = _sync_mask(p)
        sync[first_bad:] = False
        is_control &= ~sync
        if sync.any():
            controls_before: NDArray[np.intp] = np.cumsum(is_control) - is_control
            batch.syncs = _sync_columns(buffer, p, at, following, sync, position, controls_before)
    for index in np.flatnonzero(is_control[:first_bad]).tolist():
        frame = decode_frame(buffer, starts[index], int(following[index]) - starts[index])
        batch.controls.append((int(position[index]), frame))
    if first_bad < len(starts):
        _raise_for(buffer, starts[first_bad], int(following[first_bad]), frame_size_max)
    items = np.flatnonzero(is_item)
    if len(items) == len(starts):  # the usual run: items only
        batch.changes = _columns(buffer, p, layout, at, following)
    elif len(items):
        # Rows of the byte array, not of the structured view: numpy copies overlapping
        # structured fields one by one, many times slower.
        item_prefixes = prefix[items].view(_PREFIX)[:, 0]
        item_layout = layout[items]
        batch.changes = _columns(buffer, item_prefixes, item_layout, at[items], following[items])
    batch.item_bytes = int((following[items] - at[items]).sum())
    return batch


_PREPARE_CODE: Final = (_REQUEST << 8) | OP_PREPARE
_COMMIT_CODE: Final = (_REQUEST << 8) | OP_COMMIT


def _sync_mask(p: NDArray[np.void]) -> NDArray[np.bool_]:
    """Per frame: a classic DCP_PREPARE / DCP_COMMIT that its decoder takes (the checks of
    ``sync_columns.sync_row``; a header's checks are ``bad``'s, applied by the caller)."""
    code, extlen, keyed = p["code"], p["extlen"], p["keylen"] != 0
    level = p["prepare_level"]
    prepare = (code == _PREPARE_CODE) & (extlen == PREPARE_EXTRAS.size) & keyed
    prepare &= (p["seqno"] != 0) & (p["cas"] != 0) & (level >= 1) & (level <= 3)
    prepare &= p["prepare_deleted"] <= 1
    prepared = p["ending_prepared"]
    commit = (code == _COMMIT_CODE) & (extlen == ABORT_EXTRAS.size) & keyed
    commit &= (prepared > 0) & (prepared < p["ending_seqno"])
    return prepare | commit  # type: ignore[no-any-return]


def _sync_columns(
    buffer: Buffer,
    p: NDArray[np.void],
    at: NDArray[np.int64],
    following: NDArray[np.int64],
    sync: NDArray[np.bool_],
    position: NDArray[np.intp],
    controls_before: NDArray[np.intp],
) -> SyncColumns:
    """The rows of the frames ``sync`` marks, as ``sync_columns.sync_row`` builds them."""
    q = p[sync]
    prepare = q["code"] == _PREPARE_CODE
    deleted = prepare & (q["prepare_deleted"] == 1)
    zero = np.zeros(len(q), np.uint64)
    starts, ends = at[sync], following[sync]
    key_start = starts + _HEADER_SIZE + q["extlen"]
    key_end = key_start + q["keylen"]
    value_end = np.where(prepare, ends, key_end)
    first = int(starts[0])
    data = bytes(memoryview(buffer)[first : int(ends[-1])])
    bounds = zip((key_start - first).tolist(), (key_end - first).tolist(), strict=True)
    columns: dict[str, list[Any]] = {
        "opcode": q["opcode"].tolist(),
        "vbucket": q["vbucket"].tolist(),
        "opaque": q["opaque"].tolist(),
        "seqno": np.where(prepare, q["seqno"], q["ending_seqno"]).tolist(),
        "prepared_seqno": np.where(prepare, zero, q["ending_prepared"]).tolist(),
        "cas": np.where(prepare, q["cas"], zero).tolist(),
        "rev_seqno": np.where(prepare, q["rev_seqno"], zero).tolist(),
        "flags": np.where(prepare, q["flags"], 0).tolist(),
        "expiry": np.where(prepare & ~deleted, q["expiry"], 0).tolist(),
        "delete_time": np.where(deleted, q["expiry"], 0).tolist(),
        "datatype": q["datatype"].tolist(),
        "deleted": deleted.tolist(),
        "level": np.where(prepare, q["prepare_level"], 0).tolist(),
        "key": [data[a:b] for a, b in bounds],
        "value": [
            data[a:b]
            for a, b in zip((key_end - first).tolist(), (value_end - first).tolist(), strict=True)
        ],
        "position": position[sync].tolist(),
        "control": controls_before[sync].tolist(),
        "wire_size": (ends - starts).tolist(),
    }
    return SyncColumns.of_columns(columns)


def _prefixes(data: Buffer, at: NDArray[np.int64]) -> NDArray[np.uint8]:
    """The first ``_PREFIX.itemsize`` bytes at each offset, one row each.

    A prefix runs past a short frame into the next one, and near the buffer's end it is filled
    up (zeros, or the last byte repeated in a buffer shorter than a prefix) instead of reading
    past it. Those bytes are never used: each field is masked by the layout of its own frame.
    """
    buffer = np.frombuffer(data, np.uint8)
    size = _PREFIX.itemsize
    if len(buffer) < size:
        return buffer.take(at[:, None] + _PREFIX_BYTES, mode="clip")
    # Every window of ``size`` bytes, as rows (a view: what sliding_window_view builds, without
    # its checks, which cost more than the gather on short runs).
    windows: NDArray[np.uint8] = np.ndarray(
        (len(buffer) - size + 1, size), np.uint8, buffer, strides=(1, 1)
    )
    whole = at <= len(buffer) - size
    if bool(whole.all()):
        return windows[at]
    prefix = np.zeros((len(at), size), np.uint8)
    prefix[whole] = windows[at[whole]]
    for row in np.flatnonzero(~whole).tolist():  # the last few frames: at most 2 (24 bytes each)
        tail = buffer[at[row] :]
        prefix[row, : len(tail)] = tail
    return prefix


def _vectorised_checks(
    p: NDArray[np.void], bodylen: NDArray[np.int64], frame_size_max: int
) -> tuple[NDArray[np.bool_], NDArray[np.uint8], NDArray[np.bool_]]:
    """``(is_item, layout, bad)`` per frame: the checks of ``check_header``, then of the items
    (the same as ``_mutation_row`` and ``_item_row``)."""
    magic, extlen = p["magic"], p["extlen"]
    alt = _ALT_MAGIC[magic]
    alt_sections = p["alt_framelen"].astype(np.int64) + p["alt_keylen"]
    sections = np.where(alt, alt_sections, p["keylen"]) + extlen
    bad = ~_KNOWN_MAGIC[magic]
    bad |= bodylen > frame_size_max
    bad |= p["datatype"] > DATATYPE_MASK
    bad |= sections > bodylen
    is_item = _ITEM_CODE[p["code"]]  # classic magic only: keylen is the classic field
    layout = _ITEM_LAYOUT[p["opcode"], extlen]
    nmeta = np.where(layout == _MUTATION_LAYOUT, p["mutation_nmeta"], 0)
    nmeta |= np.where(layout == _DELETION_V1_LAYOUT, p["deletion_v1_nmeta"], 0)
    bad_item = layout == _NOT_AN_ITEM
    bad_item |= p["seqno"] == 0
    bad_item |= nmeta != 0
    bad_item |= p["keylen"] == 0
    bad |= is_item & bad_item
    return is_item, layout, bad


def _raise_for(buffer: Buffer, pos: int, following: int, frame_size_max: int) -> None:
    """Raise the error the per-frame path raises for the frame at ``pos``."""
    total = following - pos
    assert _HEADER_SIZE + check_header(buffer, pos, frame_size_max) == total, pos
    if _is_item(buffer, pos):
        _item_row(buffer, pos, total, pos)
    raise AssertionError(f"the masks refused the frame at {pos}, the per-frame checks did not")


def _columns(
    buffer: Buffer,
    p: NDArray[np.void],
    layout: NDArray[np.uint8],
    at: NDArray[np.int64],
    following: NDArray[np.int64],
) -> ChangeColumns:
    """Columns of checked item frames (``p``: their prefixes, ``at``: where they start)."""
    mutation = layout == _MUTATION_LAYOUT
    has_delete_time = (layout == _DELETION_V2_LAYOUT) | (layout == _EXPIRATION_LAYOUT)
    # The u32 at extras offset 16 is the delete time of a V2 deletion and of an expiration.
    delete_time = np.where(has_delete_time, p["expiration_delete_time"], 0)
    arrays = {
        "opcode": p["opcode"],
        "vbucket": p["vbucket"],
        "opaque": p["opaque"],
        "seqno": p["seqno"],
        "rev_seqno": p["rev_seqno"],
        "cas": p["cas"],
        "flags": np.where(mutation, p["flags"], 0),
        "expiry": np.where(mutation, p["expiry"], 0),
        "delete_time": delete_time,
        "datatype": p["datatype"],
    }
    columns: dict[str, Column] = {
        name: arrays[name].astype(dtype) for name, dtype in FIELD_DTYPES.items()
    }
    first = int(at[0])
    columns["key_start"] = at - first + _HEADER_SIZE + p["extlen"]
    columns["key_end"] = columns["key_start"] + p["keylen"]
    columns["value_end"] = following - first
    return ChangeColumns(columns, bytes(memoryview(buffer)[first : int(following[-1])]))
