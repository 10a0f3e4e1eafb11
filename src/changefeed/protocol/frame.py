"""The 24-byte packet header and the ``Frame`` value (dcp-wire.md §1.1–1.2).

Layout (all big-endian)::

    off size  request            response
    0   1     magic              magic
    1   1     opcode             opcode
    2   2     key length         key length     (alt magic: u8 framing len, u8 key len)
    4   1     extras length      extras length
    5   1     datatype           datatype
    6   2     vbucket            status
    8   4     total body length  (framing + extras + key + value)
    12  4     opaque             opaque
    16  8     cas                cas

Body order: ``[framing extras][extras][key][value]``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from changefeed import limits
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame_info import decode_frame_infos, stream_id_of
from changefeed.protocol.opcode import DATATYPE_MASK, Magic
from changefeed.protocol.quick_init import quick_init
from changefeed.protocol.status import Status

# The classic header, one format character per row of the layout above. The one declaration of
# it: structs that read header and extras in one call (dcp_items.py) append to this string.
HEADER_FORMAT = (
    ">"
    "B"  # 0  magic
    "B"  # 1  opcode
    "H"  # 2  key length
    "B"  # 4  extras length
    "B"  # 5  datatype
    "H"  # 6  vbucket (request) | status (response)
    "I"  # 8  total body length
    "I"  # 12 opaque
    "Q"  # 16 cas
)
HEADER = struct.Struct(HEADER_FORMAT)
ALT_HEADER = struct.Struct(">BBBBBBHIIQ")  # magic opcode framelen keylen extlen datatype ...
assert HEADER.size == limits.HEADER_SIZE
assert ALT_HEADER.size == limits.HEADER_SIZE

KNOWN_MAGICS = frozenset(int(m) for m in Magic)
ALT_MAGICS = frozenset((Magic.ALT_REQUEST, Magic.ALT_RESPONSE))
_RESPONSE = int(Magic.RESPONSE)
REQUEST_MAGICS = frozenset((Magic.REQUEST, Magic.ALT_REQUEST, Magic.SERVER_REQUEST))


@quick_init  # built per item: see quick_init.py
@dataclass(frozen=True, slots=True)
class Frame:
    """One packet, split into its parts. For responses ``vbucket`` holds the status.

    Frames are for control messages and tests; the mutation hot path decodes runs of frames
    into columns without building one of these per item (``batch.py``).
    """

    magic: int
    opcode: int
    datatype: int = 0
    vbucket: int = 0
    opaque: int = 0
    cas: int = 0
    extras: bytes = b""
    key: bytes = b""
    value: bytes = b""
    framing_extras: bytes = b""

    @property
    def is_request(self) -> bool:
        return self.magic in REQUEST_MAGICS

    @property
    def status(self) -> int:
        """The response status (meaningless for requests)."""
        return self.vbucket

    @property
    def stream_id(self) -> int | None:
        """DCP stream-id from the framing extras, if any. May raise ``ProtocolError``."""
        return stream_id_of(self.framing_extras)

    @property
    def wire_size(self) -> int:
        """Bytes this frame takes on the wire (what flow control counts)."""
        return (
            limits.HEADER_SIZE
            + len(self.framing_extras)
            + len(self.extras)
            + len(self.key)
            + len(self.value)
        )

    def encode(self) -> bytes:
        return encode_frame(
            self.magic,
            self.opcode,
            datatype=self.datatype,
            vbucket=self.vbucket,
            opaque=self.opaque,
            cas=self.cas,
            extras=self.extras,
            key=self.key,
            value=self.value,
            framing_extras=self.framing_extras,
        )


def encode_frame(
    magic: int,
    opcode: int,
    *,
    datatype: int = 0,
    vbucket: int = 0,
    opaque: int = 0,
    cas: int = 0,
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
    framing_extras: bytes = b"",
) -> bytes:
    """Encode a packet. ``vbucket`` is the status for responses.

    A request with ``framing_extras`` must use an alt magic (0x08/0x18), and an alt magic limits
    the key to 255 bytes. Breaking these rules is our bug, so it raises ``ValueError``.
    """
    if datatype & ~DATATYPE_MASK:
        raise ValueError(f"invalid datatype bits: 0x{datatype:02x}")
    bodylen = len(framing_extras) + len(extras) + len(key) + len(value)
    if magic in ALT_MAGICS:
        if len(key) > 0xFF or len(framing_extras) > 0xFF:
            raise ValueError("alt framing: key and framing extras are limited to 255 bytes")
        header = ALT_HEADER.pack(
            magic,
            opcode,
            len(framing_extras),
            len(key),
            len(extras),
            datatype,
            vbucket,
            bodylen,
            opaque,
            cas,
        )
    else:
        if framing_extras:
            raise ValueError(f"framing extras need an alt magic, not 0x{magic:02x}")
        if len(key) > 0xFFFF or len(extras) > 0xFF:
            raise ValueError("key or extras too long for the classic header")
        header = HEADER.pack(
            magic, opcode, len(key), len(extras), datatype, vbucket, bodylen, opaque, cas
        )
    return b"".join((header, framing_extras, extras, key, value))


def encode_response(
    request: Frame,
    status: int = Status.SUCCESS,
    *,
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
    cas: int = 0,
    datatype: int = 0,
) -> bytes:
    """Encode the response to ``request``: same opcode and opaque, classic response magic.

    ``encode_frame``'s classic branch inline (the same bytes and the same ValueErrors): a
    pipelined mix answers every GET and DELETE through here, and the keyword call with its
    magic checks cost ~0.5 µs a reply."""
    if datatype & ~DATATYPE_MASK:
        raise ValueError(f"invalid datatype bits: 0x{datatype:02x}")
    key_size, extras_size = len(key), len(extras)
    if key_size > 0xFFFF or extras_size > 0xFF:
        raise ValueError("key or extras too long for the classic header")
    header = HEADER.pack(
        _RESPONSE,
        request.opcode,
        key_size,
        extras_size,
        datatype,
        status,
        extras_size + key_size + len(value),
        request.opaque,
        cas,
    )
    return b"".join((header, extras, key, value))


def check_header(buffer: bytes | bytearray | memoryview, start: int, frame_size_max: int) -> int:
    """Validate the header at ``start`` and return its declared body length.

    Only the 24 header bytes are read, so a hostile length is refused before it is awaited.

    Raises:
        ProtocolError: unknown magic or datatype bits (EINVAL), body over ``frame_size_max``
            (E2BIG), or section lengths that do not fit the body (EINVAL).
    """
    magic = buffer[start]
    if magic not in KNOWN_MAGICS:
        raise ProtocolError(f"unknown magic 0x{magic:02x}", Status.EINVAL)
    if magic in ALT_MAGICS:
        _, _, framelen, keylen, extlen, datatype, _, bodylen, _, _ = ALT_HEADER.unpack_from(
            buffer, start
        )
    else:
        _, _, keylen, extlen, datatype, _, bodylen, _, _ = HEADER.unpack_from(buffer, start)
        framelen = 0
    if bodylen > frame_size_max:
        raise ProtocolError(f"body of {bodylen} bytes exceeds {frame_size_max}", Status.E2BIG)
    if datatype & ~DATATYPE_MASK:
        raise ProtocolError(f"invalid datatype 0x{datatype:02x}", Status.EINVAL)
    if framelen + extlen + keylen > bodylen:
        raise ProtocolError(
            f"framing {framelen} + extras {extlen} + key {keylen} > body {bodylen}", Status.EINVAL
        )
    return int(bodylen)


def decode_frame(buffer: bytes | bytearray | memoryview, start: int, total: int) -> Frame:
    """Build a ``Frame`` from a complete, header-checked packet at ``start``."""
    magic = buffer[start]
    if magic in ALT_MAGICS:
        _, opcode, framelen, keylen, extlen, datatype, vb, bodylen, opaque, cas = (
            ALT_HEADER.unpack_from(buffer, start)
        )
    else:
        _, opcode, keylen, extlen, datatype, vb, bodylen, opaque, cas = HEADER.unpack_from(
            buffer, start
        )
        framelen = 0
    assert limits.HEADER_SIZE + bodylen == total, (bodylen, total)
    pos = start + limits.HEADER_SIZE
    framing = bytes(buffer[pos : pos + framelen])
    if framing:
        decode_frame_infos(framing)  # validates structure; raises ProtocolError
    pos += framelen
    extras = bytes(buffer[pos : pos + extlen])
    pos += extlen
    key = bytes(buffer[pos : pos + keylen])
    pos += keylen
    value = bytes(buffer[pos : start + total])
    return Frame(magic, opcode, datatype, vb, opaque, cas, extras, key, value, framing)
