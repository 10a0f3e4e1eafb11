"""A run of SET requests taken from a receive buffer in one pass, as columns. No I/O.

Pipelined ingest is a buffer of many SETs back to back. Decoding each into a ``Frame`` and
dispatching it alone costs more than applying the write, so the server takes the longest
prefix of the buffer made of SETs of one kind and hands it over as columns:

* *plain* SETs: classic magic (so no framing extras and no durability); 8 bytes of extras; no
  CAS; a key and a value within the limits `decode_store` enforces; valid datatype bits;
* *durable* SETs: the same, but flexible magic whose framing extras are exactly one
  durability frame info (dcp-wire.md §1.3, id 1: a known level, optionally a u16 timeout),
  byte for byte the same for the whole run (one level and timeout), so the run is one
  `SetRun` whose `framing_extras` hold it.

The first frame decides the kind. Anything else ends the run and goes through the ordinary
per-frame path, which also reports every malformed header: a run never consumes a frame it
did not fully check.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from changefeed import limits
from changefeed.protocol.errors import StatusError
from changefeed.protocol.frame import HEADER_FORMAT, Frame
from changefeed.protocol.frame_info import FRAME_INFO_DURABILITY, DurabilityLevel
from changefeed.protocol.kv import MUTATION_TOKEN
from changefeed.protocol.opcode import DATATYPE_MASK, Magic, Opcode

_SET_HEAD: Final = struct.Struct(HEADER_FORMAT + "II")  # the header | flags, expiry
_HEAD_SIZE: Final = _SET_HEAD.size
_HEADER_SIZE: Final = limits.HEADER_SIZE
_EXTRAS_SIZE: Final = 8
_STORE_EXTRAS: Final = struct.Struct(">II")  # flags, expiry
_REQUEST: Final = int(Magic.REQUEST)
_ALT_REQUEST: Final = int(Magic.ALT_REQUEST)
_RESPONSE: Final = int(Magic.RESPONSE)
_SET: Final = int(Opcode.SET)
_DATATYPE_INVALID: Final = ~DATATYPE_MASK
_KEY_SIZE_MAX: Final = limits.KEY_SIZE_MAX
_VALUE_SIZE_MAX: Final = limits.VALUE_SIZE_MAX
# A key starting with 0xff ends a run: the per-frame path stores it in its collection's form
# (storage/keys.py; server/collection_commands.py `escape_default_key`). Never a UTF-8 key.
_STORED_KEY_MARKER: Final = 0xFF
assert _HEAD_SIZE == _HEADER_SIZE + _EXTRAS_SIZE
# A durable SET's head: the alt header (framing length and key length one byte each), its
# framing extras (one durability frame info: 2 bytes, or 4 with a timeout), flags, expiry.
_ALT_FORMAT: Final = ">BBBBBBHIIQ"
_DURABLE_HEADS: Final = {
    2: struct.Struct(_ALT_FORMAT + "2sII"),
    4: struct.Struct(_ALT_FORMAT + "4sII"),
}
_LEVELS: Final = frozenset(int(level) for level in DurabilityLevel)
assert all(head.size == _HEADER_SIZE + n + _EXTRAS_SIZE for n, head in _DURABLE_HEADS.items())


def durability_framing(framing: bytes) -> bool:
    """Whether `framing` (a request's framing extras) is exactly one durability frame info
    with a known level: `frame_info.durability_of` reads it without error, and nothing else."""
    size = len(framing)
    return (
        size in _DURABLE_HEADS
        and framing[0] == (FRAME_INFO_DURABILITY << 4 | (size - 1))
        and framing[1] in _LEVELS
    )


@dataclass(slots=True)
class SetRunAnswers:
    """What a run of SETs got, as columns in run order: write i got `cases[i]` and, on
    `vb_uuids[i]`, `seqnos[i]`, unless `errors` holds i (the server answers it alone)."""

    cases: list[int]
    seqnos: list[int]
    vb_uuids: list[int]
    errors: dict[int, StatusError]


@dataclass(slots=True)
class SetRun:
    """SETs in arrival order, one entry per request in each column: plain ones, or (with
    `framing_extras`, one durability frame info) durable ones all asking the same."""

    vbuckets: list[int] = field(default_factory=list)
    opaques: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    expiries: list[int] = field(default_factory=list)
    datatypes: list[int] = field(default_factory=list)
    consumed: int = 0  # bytes of the buffer the run took
    # Every field is known to be within a SET's limits (a key of 1..KEY_SIZE_MAX bytes, a
    # value within VALUE_SIZE_MAX, valid datatype bits, u32 flags and expiry): the applier
    # need not check them again. `take_set_run` checks them; a run built otherwise is not.
    checked: bool = False
    framing_extras: bytes = b""  # the durability frame info of every write, or b"": plain

    def __len__(self) -> int:
        return len(self.opaques)

    def extend(self, other: SetRun) -> None:
        """Append `other`'s writes (it follows this run on the wire; of the same kind)."""
        assert other.framing_extras == self.framing_extras, (other.framing_extras, self)
        self.vbuckets += other.vbuckets
        self.opaques += other.opaques
        self.keys += other.keys
        self.values += other.values
        self.flags += other.flags
        self.expiries += other.expiries
        self.datatypes += other.datatypes
        self.consumed += other.consumed
        self.checked = self.checked and other.checked

    def select(self, indexes: Sequence[int]) -> SetRun:
        """The writes at `indexes`, in that order, as a run of their own (checked as this one)."""
        return SetRun(
            [self.vbuckets[i] for i in indexes],
            [self.opaques[i] for i in indexes],
            [self.keys[i] for i in indexes],
            [self.values[i] for i in indexes],
            [self.flags[i] for i in indexes],
            [self.expiries[i] for i in indexes],
            [self.datatypes[i] for i in indexes],
            checked=self.checked,
            framing_extras=self.framing_extras,
        )


def run_frames(run: SetRun) -> list[Frame]:
    """The run's SETs as the frames they came in (flexible magic and the run's framing extras
    for durable ones), for the per-frame path."""
    magic = _ALT_REQUEST if run.framing_extras else _REQUEST
    pack = _STORE_EXTRAS.pack
    return [
        Frame(
            magic,
            _SET,
            datatype=run.datatypes[i],
            vbucket=run.vbuckets[i],
            opaque=run.opaques[i],
            extras=pack(run.flags[i], run.expiries[i]),
            key=run.keys[i],
            value=run.values[i],
            framing_extras=run.framing_extras,
        )
        for i in range(len(run))
    ]


def take_set_run(
    buffer: bytes | bytearray, start: int, frame_size_max: int, items_max: int
) -> SetRun:
    """The SETs of one kind (module docstring) at ``buffer[start:]``, up to ``items_max``
    (empty if the first frame is anything else or incomplete). ``frame_size_max`` is the
    reader's body limit: a larger frame ends the run (the per-frame path answers it)."""
    if len(buffer) - start >= _HEADER_SIZE and buffer[start] == _ALT_REQUEST:
        return _take_durable_run(buffer, start, frame_size_max, items_max)
    run = SetRun()
    end = len(buffer)
    pos = start
    view = memoryview(buffer)
    unpack = _SET_HEAD.unpack_from
    vbuckets, opaques, keys, values = run.vbuckets, run.opaques, run.keys, run.values
    flags_out, expiries, datatypes = run.flags, run.expiries, run.datatypes
    try:
        while len(opaques) < items_max and end - pos >= _HEAD_SIZE:  # bounded by the buffer
            magic, opcode, keylen, extlen, datatype, vb, bodylen, opaque, cas, flags, expiry = (
                unpack(buffer, pos)
            )
            total = _HEADER_SIZE + bodylen
            if (
                magic != _REQUEST
                or opcode != _SET
                or extlen != _EXTRAS_SIZE
                or cas
                or not 0 < keylen <= _KEY_SIZE_MAX
                or bodylen - _EXTRAS_SIZE - keylen > _VALUE_SIZE_MAX
                or datatype & _DATATYPE_INVALID
                or bodylen > frame_size_max
                or _EXTRAS_SIZE + keylen > bodylen
                or end - pos < total
                or buffer[pos + _HEAD_SIZE] == _STORED_KEY_MARKER
            ):
                break
            key_at = pos + _HEAD_SIZE
            value_at = key_at + keylen
            pos += total
            vbuckets.append(vb)
            opaques.append(opaque)
            keys.append(bytes(view[key_at:value_at]))
            values.append(bytes(view[value_at:pos]))
            flags_out.append(flags)
            expiries.append(expiry)
            datatypes.append(datatype)
    finally:
        view.release()  # the caller may resize the buffer next
    run.consumed = pos - start
    run.checked = True
    return run


def _take_durable_run(
    buffer: bytes | bytearray, start: int, frame_size_max: int, items_max: int
) -> SetRun:
    """`take_set_run` of durable SETs: every frame's framing extras are the first one's, and
    that is one durability frame info (`durability_framing`).

    The column appends repeat `take_set_run`'s on purpose: one helper call per write for
    both cost 11% (plain) and 13% (durable) more per item, 0.73 -> 0.81 and 0.78 -> 0.88 µs
    (512 SETs a buffer, alternating in one run, load ~6)."""
    run = SetRun()
    end = len(buffer)
    framing_size = buffer[start + 2]
    head = _DURABLE_HEADS.get(framing_size)
    if head is None:
        return run
    head_size = head.size
    fixed = framing_size + _EXTRAS_SIZE  # body bytes before the key
    pos = start
    view = memoryview(buffer)
    unpack = head.unpack_from
    vbuckets, opaques, keys, values = run.vbuckets, run.opaques, run.keys, run.values
    flags_out, expiries, datatypes = run.flags, run.expiries, run.datatypes
    framing = b""
    try:
        while len(opaques) < items_max and end - pos >= head_size:  # bounded by the buffer
            (magic, opcode, framelen, keylen, extlen, datatype, vb, bodylen, opaque, cas,
             frame_infos, flags, expiry) = unpack(buffer, pos)  # fmt: skip
            total = _HEADER_SIZE + bodylen
            if (
                magic != _ALT_REQUEST
                or opcode != _SET
                or framelen != framing_size
                or extlen != _EXTRAS_SIZE
                or cas
                or not 0 < keylen <= _KEY_SIZE_MAX
                or bodylen - fixed - keylen > _VALUE_SIZE_MAX
                or datatype & _DATATYPE_INVALID
                or bodylen > frame_size_max
                or fixed + keylen > bodylen
                or end - pos < total
                or buffer[pos + head_size] == _STORED_KEY_MARKER
            ):
                break
            if frame_infos != framing:
                if framing or not durability_framing(frame_infos):
                    break  # another level or timeout: the next run's
                framing = frame_infos
            key_at = pos + head_size
            value_at = key_at + keylen
            pos += total
            vbuckets.append(vb)
            opaques.append(opaque)
            keys.append(bytes(view[key_at:value_at]))
            values.append(bytes(view[value_at:pos]))
            flags_out.append(flags)
            expiries.append(expiry)
            datatypes.append(datatype)
    finally:
        view.release()  # the caller may resize the buffer next
    run.consumed = pos - start
    run.checked = True
    run.framing_extras = framing
    assert bool(framing) == bool(opaques), (framing, len(opaques))
    return run


_SUCCESS_REPLY: Final = struct.Struct(HEADER_FORMAT)
_SUCCESS_REPLY_WITH_TOKEN: Final = struct.Struct(HEADER_FORMAT + MUTATION_TOKEN.format[1:])
_TOKEN_SIZE: Final = MUTATION_TOKEN.size

# The success reply of a SET, from the request's opaque and the write's CAS (and, when the
# connection negotiated MutationSeqno, its vb_uuid and seqno): status 0, no key or value.
pack_set_success: Final = functools.partial(
    _SUCCESS_REPLY.pack, int(Magic.RESPONSE), _SET, 0, 0, 0, 0, 0
)
pack_set_success_with_token: Final = functools.partial(
    _SUCCESS_REPLY_WITH_TOKEN.pack, int(Magic.RESPONSE), _SET, 0, _TOKEN_SIZE, 0, 0, _TOKEN_SIZE
)

# The same replies as numpy records, so a run's successes are packed column by column.
_HEADER_FIELDS: Final = [
    ("magic", "u1"), ("opcode", "u1"), ("keylen", ">u2"), ("extlen", "u1"),
    ("datatype", "u1"), ("status", ">u2"), ("bodylen", ">u4"), ("opaque", ">u4"),
    ("cas", ">u8"),
]  # fmt: skip
_REPLIES: Final = np.dtype(_HEADER_FIELDS)
_REPLIES_WITH_TOKEN: Final = np.dtype([*_HEADER_FIELDS, ("vb_uuid", ">u8"), ("seqno", ">u8")])
# Below this many replies a struct pack each is cheaper than numpy's fixed cost (~2 µs a call).
_NUMPY_FROM: Final = 16
assert _REPLIES.itemsize == _SUCCESS_REPLY.size
assert _REPLIES_WITH_TOKEN.itemsize == _SUCCESS_REPLY_WITH_TOKEN.size


def pack_set_successes(
    opaques: Sequence[int],
    cases: Sequence[int],
    vb_uuids: Sequence[int] | None = None,
    seqnos: Sequence[int] | None = None,
) -> bytes:
    """`pack_set_success` (or, given `vb_uuids` and `seqnos`, `pack_set_success_with_token`)
    of every write, joined: one numpy pass per field instead of a pack per reply."""
    token = vb_uuids is not None
    assert token == (seqnos is not None), "a mutation token needs both vb_uuids and seqnos"
    if len(opaques) < _NUMPY_FROM:  # a few replies (the SETs between a mix's GETs): struct
        if token:
            assert vb_uuids is not None and seqnos is not None
            return b"".join(map(pack_set_success_with_token, opaques, cases, vb_uuids, seqnos))
        return b"".join(map(pack_set_success, opaques, cases))
    replies = np.zeros(len(opaques), _REPLIES_WITH_TOKEN if token else _REPLIES)
    replies["magic"] = _RESPONSE
    replies["opcode"] = _SET
    replies["opaque"] = opaques
    replies["cas"] = cases
    if token:
        replies["extlen"] = _TOKEN_SIZE
        replies["bodylen"] = _TOKEN_SIZE
        replies["vb_uuid"] = vb_uuids
        replies["seqno"] = seqnos
    return replies.tobytes()
