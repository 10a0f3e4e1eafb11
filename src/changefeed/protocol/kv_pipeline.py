"""Pipelined store requests, a window at a time: encode all requests at once, decode the
replies in one pass. No I/O.

``KvClient.upsert_many`` sends windows of up to ``PIPELINE_DEPTH_MAX`` SETs. One ``Frame``,
one ``encode_frame`` call and one future per request cost some 15 µs of client CPU each, most
of a pipelined write's cost; a window is instead:

* encoded by ``encode_stores``: one pre-compiled struct packs header + store extras per item,
  one ``b"".join`` makes the window's bytes (byte for byte what ``kv.encode_store`` gives);
* answered into a ``StoreReplies``: the requests carry consecutive opaques
  ``first_opaque + index`` (mod 2**32), so a reply's index is ``(opaque - first) mod 2**32``,
  whatever order the replies come in. ``StoreReplies.feed`` consumes, in one pass over the
  received buffer, each complete reply that belongs to the window: a plain success (classic
  magic, status SUCCESS, no key or value, the 16-byte mutation token) becomes three ints in the
  window's columns, with no object: a run of them answering consecutive requests is read
  by numpy as an array of 40-byte records (one mask checks every header), a short or broken
  run one ``struct.unpack_from`` per reply; any other reply is checked and decoded as a
  ``Frame`` (``check_header``, ``decode_frame``: the per-frame path, so its errors are the
  per-frame path's) and kept by index for the caller's general handling.

``feed`` stops at the first frame that is not a reply to the window (another request's, a
second reply to the same opaque, a server push) or that has not fully arrived, and returns
where; the caller decodes that one by the general path and calls ``feed`` again.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import numpy as np

from changefeed import limits
from changefeed.protocol.frame import HEADER, HEADER_FORMAT, Frame, check_header, decode_frame
from changefeed.protocol.kv import STORE_OPCODES, StoreCommand, encode_store
from changefeed.protocol.opcode import Magic

Buffer = bytes | bytearray | memoryview

OPAQUE_MASK: Final = 0xFFFF_FFFF
_HEADER_SIZE: Final = limits.HEADER_SIZE
# A store request's header + extras (flags u32, expiry u32): kv.py's layout, in one struct.
STORE_REQUEST_PREFIX: Final = struct.Struct(HEADER_FORMAT + "II")
STORE_EXTRAS_SIZE: Final = STORE_REQUEST_PREFIX.size - _HEADER_SIZE
# A plain store reply: header + the mutation token (vb_uuid u64, seqno u64) as extras.
STORE_REPLY: Final = struct.Struct(HEADER_FORMAT + "QQ")
TOKEN_SIZE: Final = STORE_REPLY.size - _HEADER_SIZE
STORE_REPLY_SIZE: Final = STORE_REPLY.size
assert STORE_EXTRAS_SIZE == 8 and TOKEN_SIZE == 16, (STORE_EXTRAS_SIZE, TOKEN_SIZE)

_REQUEST: Final = int(Magic.REQUEST)
_RESPONSE: Final = int(Magic.RESPONSE)
_RESPONSE_MAGICS: Final = frozenset((int(Magic.RESPONSE), int(Magic.ALT_RESPONSE)))

# A run of plain successes through numpy: the first 8 header bytes must read magic 0x81, any
# opcode, key length 0, extras length 16, datatype 0, status SUCCESS.
_RUN_DTYPE: Final = np.dtype(
    [("head", ">u8"), ("bodylen", ">u4"), ("opaque", ">u4"), ("cas", ">u8"),
     ("vb_uuid", ">u8"), ("seqno", ">u8")]
)  # fmt: skip
assert _RUN_DTYPE.itemsize == STORE_REPLY_SIZE
_PLAIN_HEAD_MASK: Final = np.uint64(0xFF00_FFFF_FFFF_FFFF)
_PLAIN_HEAD: Final = np.uint64(int(Magic.RESPONSE) << 56 | TOKEN_SIZE << 24)
# Below this many bytes (of plain replies) the per-frame loop is cheaper: a numpy run costs
# ~10 µs + 0.04 µs per reply, the loop ~0.3 µs per reply; they cross near 32 replies (a whole
# window's answers usually arrive in one read: 1,024 take 1/6 of the loop's time).
RUN_BYTES_MIN: Final = 32 * STORE_REPLY_SIZE

# ``StoreReplies.state`` values, one per request.
WAITING: Final = 0  # no reply yet
TOKEN: Final = 1  # a plain success: cas, vb_uuid, seqno are in the columns
FRAME: Final = 2  # any other reply: in ``frames``
_TOKENS: Final = bytes([TOKEN]) * 4096


def encode_stores(
    opcode: int,
    items: Sequence[tuple[bytes, bytes]],
    vbuckets: Sequence[int],
    first_opaque: int,
    framing_extras: bytes = b"",
) -> bytes:
    """The store requests (``opcode`` SET/ADD/REPLACE, no flags, expiry, CAS or datatype) of
    ``items`` to ``vbuckets`` (one per item) with opaques ``first_opaque + index`` (mod 2**32),
    as one buffer: the concatenation of ``kv.encode_store`` of each (with ``framing_extras``,
    e.g. a durability frame, each is an alt-magic request encoded on its own).

    Raises:
        ValueError: as ``encode_store`` (not a store opcode, a key over 65,535 bytes).
    """
    assert len(items) == len(vbuckets), (len(items), len(vbuckets))
    count = len(items)
    if count == 0:
        return b""
    if first_opaque + count <= OPAQUE_MASK + 1:
        opaques: Sequence[int] = range(first_opaque, first_opaque + count)
    else:
        opaques = [opaque & OPAQUE_MASK for opaque in range(first_opaque, first_opaque + count)]
    pack = STORE_REQUEST_PREFIX.pack
    ext = STORE_EXTRAS_SIZE
    try:
        heads = [
            pack(_REQUEST, opcode, len(key), ext, 0, vb, ext + len(key) + len(value), op, 0, 0, 0)
            for (key, value), vb, op in zip(items, vbuckets, opaques, strict=True)
        ]
    except struct.error:  # a field out of range: let the per-item encoder say which
        heads = []
    if len(heads) != count or opcode not in STORE_OPCODES or framing_extras:
        # The per-item encoder raises the error it would have raised; it may also succeed.
        return b"".join(
            encode_store(StoreCommand(opcode, vb, op, key, value), framing_extras)
            for (key, value), vb, op in zip(items, vbuckets, opaques, strict=True)
        )
    parts: list[bytes] = [b""] * (3 * count)
    parts[0::3] = heads
    parts[1::3] = [key for key, _ in items]
    parts[2::3] = [value for _, value in items]
    return b"".join(parts)


class StoreReplies:
    """The replies to one window of ``count`` pipelined store requests, by request index.

    Attributes:
        first_opaque: the opaque of request 0; request i has ``first_opaque + i`` (mod 2**32).
        count: requests in the window.
        state: per request, ``WAITING``, ``TOKEN`` or ``FRAME``.
        cas, vb_uuid, seqno: per request, the plain success's fields (0 unless ``TOKEN``).
        frames: the other replies, by request index.
        remaining: requests not answered yet.
    """

    __slots__ = ("cas", "count", "first_opaque", "frames", "remaining", "seqno", "state", "vb_uuid")

    def __init__(self, first_opaque: int, count: int) -> None:
        assert 0 <= first_opaque <= OPAQUE_MASK, first_opaque
        assert 0 <= count <= OPAQUE_MASK, count
        self.first_opaque = first_opaque
        self.count = count
        self.state = bytearray(count)
        self.cas = [0] * count
        self.vb_uuid = [0] * count
        self.seqno = [0] * count
        self.frames: dict[int, Frame] = {}
        self.remaining = count

    @property
    def done(self) -> bool:
        return self.remaining == 0

    def index_of(self, opaque: int) -> int:
        """The index of the request with ``opaque`` still waiting for its reply, else -1."""
        index = (opaque - self.first_opaque) & OPAQUE_MASK
        if index < self.count and self.state[index] == WAITING:
            return index
        return -1

    def take(self, frame: Frame) -> bool:
        """Keep ``frame`` (a decoded response) if it answers a waiting request of the window."""
        if frame.magic not in _RESPONSE_MAGICS:
            return False
        index = self.index_of(frame.opaque)
        if index < 0:
            return False
        self.state[index] = FRAME
        self.frames[index] = frame
        self.remaining -= 1
        return True

    def feed(
        self,
        buffer: Buffer,
        start: int,
        frame_size_max: int = limits.FRAME_SIZE_MAX,
        *,
        vectorise: bool | None = None,
    ) -> int:
        """Consume the complete replies to this window at ``buffer[start:]``, in one pass.

        Args:
            vectorise: take runs of plain successes with numpy (True), per frame only (False),
                or by the bytes at hand (None: ``RUN_BYTES_MIN``). The result is the same.

        Returns:
            where the first frame not consumed starts: one that has not fully arrived, or is
            not a reply to a waiting request of this window (``len(buffer)`` if none).

        Raises:
            ProtocolError: a reply to the window breaks the protocol (as ``check_header``).
        """
        pos = start
        while True:  # bounded: a run or a frame is consumed per turn, or it returns
            if vectorise or (vectorise is None and len(buffer) - pos >= RUN_BYTES_MIN):
                pos = self._feed_run(buffer, pos)
            pos, stopped = self._feed_frames(buffer, pos, frame_size_max, vectorise)
            if stopped:
                return pos

    def _feed_run(self, buffer: Buffer, pos: int) -> int:
        """Take the longest run of plain successes at ``pos`` that answer consecutive waiting
        requests, with a few array operations over all of them; returns where it ends."""
        records = min((len(buffer) - pos) // STORE_REPLY_SIZE, self.remaining)
        if records <= 0:
            return pos
        run = np.frombuffer(buffer, _RUN_DTYPE, records, pos)
        first_index = (int(run["opaque"][0]) - self.first_opaque) & OPAQUE_MASK
        if first_index >= self.count:
            return pos
        records = min(records, self.count - first_index)
        run = run[:records]
        expected = np.arange(records, dtype=np.uint32)
        expected += np.uint32((self.first_opaque + first_index) & OPAQUE_MASK)  # wraps mod 2**32
        plain = (run["head"] & _PLAIN_HEAD_MASK) == _PLAIN_HEAD
        plain &= run["bodylen"] == TOKEN_SIZE
        plain &= run["opaque"] == expected
        plain &= np.frombuffer(self.state, np.uint8, records, first_index) == WAITING
        taken = records if plain.all() else int(plain.argmin())
        if taken == 0:
            return pos
        end_index = first_index + taken
        self.cas[first_index:end_index] = run["cas"][:taken].tolist()
        self.vb_uuid[first_index:end_index] = run["vb_uuid"][:taken].tolist()
        self.seqno[first_index:end_index] = run["seqno"][:taken].tolist()
        del run  # a view of the caller's buffer, which it may resize once we return
        self.state[first_index:end_index] = (
            _TOKENS[:taken] if taken <= len(_TOKENS) else bytes([TOKEN]) * taken
        )
        self.remaining -= taken
        return pos + taken * STORE_REPLY_SIZE

    def _feed_frames(
        self, buffer: Buffer, pos: int, frame_size_max: int, vectorise: bool | None
    ) -> tuple[int, bool]:
        """Take replies one by one from ``pos``; returns where it stopped and whether for good
        (False: after a reply that was not a plain success, with enough bytes left for a run)."""
        end = len(buffer)
        first = self.first_opaque
        count = self.count
        state = self.state
        cas_column, uuid_column, seqno_column = self.cas, self.vb_uuid, self.seqno
        unpack_reply = STORE_REPLY.unpack_from
        unpack_header = HEADER.unpack_from
        answered = 0
        try:
            while end - pos >= _HEADER_SIZE:  # bounded: each turn consumes >= 24 bytes or ends
                if end - pos >= STORE_REPLY_SIZE:
                    (magic, _, keylen, extlen, datatype, status, bodylen, opaque, cas, uuid,
                     seqno) = unpack_reply(buffer, pos)  # fmt: skip
                else:
                    magic, _, keylen, extlen, datatype, status, bodylen, opaque, cas = (
                        unpack_header(buffer, pos)
                    )
                    uuid = seqno = 0
                index = (opaque - first) & OPAQUE_MASK
                if index >= count or state[index] or magic not in _RESPONSE_MAGICS:
                    break
                if (
                    bodylen == TOKEN_SIZE
                    and extlen == TOKEN_SIZE
                    and magic == _RESPONSE
                    and status == 0
                    and keylen == 0
                    and datatype == 0
                ):
                    if end - pos < STORE_REPLY_SIZE:
                        break
                    cas_column[index] = cas
                    uuid_column[index] = uuid
                    seqno_column[index] = seqno
                    state[index] = TOKEN
                    answered += 1
                    pos += STORE_REPLY_SIZE
                    continue
                total = _HEADER_SIZE + check_header(buffer, pos, frame_size_max)
                if end - pos < total:
                    break
                self.frames[index] = decode_frame(buffer, pos, total)
                state[index] = FRAME
                answered += 1
                pos += total
                if vectorise or (vectorise is None and end - pos >= RUN_BYTES_MIN):
                    return pos, False  # a run of plain successes may follow
        finally:
            self.remaining -= answered
        return pos, True


def complete_frame_size(
    buffer: Buffer, start: int, frame_size_max: int = limits.FRAME_SIZE_MAX
) -> int:
    """Bytes of the frame at ``buffer[start:]`` if it has fully arrived, else 0.

    A header that has arrived is checked first, so a bad one is refused before its body is
    awaited.

    Raises:
        ProtocolError: as ``check_header``.
    """
    available = len(buffer) - start
    if available < _HEADER_SIZE:
        return 0
    total = _HEADER_SIZE + check_header(buffer, start, frame_size_max)
    return total if available >= total else 0
