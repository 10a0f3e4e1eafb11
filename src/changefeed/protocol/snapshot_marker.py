"""DCP_SNAPSHOT_MARKER (0x56) in its three encodings (dcp-wire.md §7.2, seed snapshot-marker.md).

V1 — extras 20 bytes, no value::

    0 snap_start u64 | 8 snap_end u64 | 16 flags u32

V2.x — extras 1 byte (version), fields in the value, all big-endian (the seed's V2.0 byte
diagram looks little-endian; the reference and the server's code are big-endian)::

    V2.0 (version 0), 36 bytes: 0 start | 8 end | 16 flags u32 | 20 max_visible_seqno
                                | 28 high_completed_seqno
    V2.2 (version 2), 52 bytes: V2.0 fields | 36 purge_seqno | 44 high_prepared_seqno

Version 1 (V2.1) was removed and is rejected.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag

from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.frame_info import encode_stream_id
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.quick_init import quick_init
from changefeed.protocol.status import Status

V1 = struct.Struct(">QQI")
V2_0 = struct.Struct(">QQIQQ")
V2_2 = struct.Struct(">QQIQQQQ")
assert V1.size == 20
assert V2_0.size == 36
assert V2_2.size == 52


class MarkerFlag(IntFlag):
    """Snapshot type bits."""

    MEMORY = 0x01
    DISK = 0x02
    CHECKPOINT = 0x04
    ACK = 0x08
    HISTORY = 0x10
    MAY_CONTAIN_DUPLICATES = 0x20


MARKER_FLAGS_MASK = 0x3F


class MarkerVersion(IntEnum):
    V1 = 1  # not a wire value: V1 is told apart by its 20-byte extras
    V2_0 = 0x100
    V2_2 = 0x102


@quick_init  # built per item: see protocol/quick_init.py
@dataclass(frozen=True, slots=True)
class SnapshotMarker:
    """A snapshot ``[snap_start, snap_end]`` announced to a consumer."""

    vbucket: int
    opaque: int
    snap_start: int
    snap_end: int
    flags: int
    max_visible_seqno: int = 0
    high_completed_seqno: int = 0
    purge_seqno: int = 0
    high_prepared_seqno: int = 0
    version: MarkerVersion = MarkerVersion.V1
    stream_id: int | None = None

    @property
    def is_disk(self) -> bool:
        return bool(self.flags & MarkerFlag.DISK)


def encode_snapshot_marker(marker: SnapshotMarker) -> bytes:
    """Encode ``marker`` in its ``version``."""
    if marker.snap_start > marker.snap_end:
        raise ValueError(f"snap_start {marker.snap_start} > snap_end {marker.snap_end}")
    if marker.flags & ~MARKER_FLAGS_MASK:
        raise ValueError(f"unknown marker flags 0x{marker.flags:x}")
    if marker.version is MarkerVersion.V1:
        extras = V1.pack(marker.snap_start, marker.snap_end, marker.flags)
        value = b""
    elif marker.version is MarkerVersion.V2_0:
        extras = b"\x00"
        value = V2_0.pack(
            marker.snap_start,
            marker.snap_end,
            marker.flags,
            marker.max_visible_seqno,
            marker.high_completed_seqno,
        )
    else:
        extras = b"\x02"
        value = V2_2.pack(
            marker.snap_start,
            marker.snap_end,
            marker.flags,
            marker.max_visible_seqno,
            marker.high_completed_seqno,
            marker.purge_seqno,
            marker.high_prepared_seqno,
        )
    framing = b"" if marker.stream_id is None else encode_stream_id(marker.stream_id)
    return encode_frame(
        Magic.ALT_REQUEST if framing else Magic.REQUEST,
        Opcode.DCP_SNAPSHOT_MARKER,
        vbucket=marker.vbucket,
        opaque=marker.opaque,
        extras=extras,
        value=value,
        framing_extras=framing,
    )


def decode_snapshot_marker(frame: Frame) -> SnapshotMarker:
    """Decode any marker version.

    Raises:
        ProtocolError: wrong sizes, a key, V2.1, unknown flag bits, or start > end (EINVAL).
    """
    if frame.key:
        raise ProtocolError("snapshot marker must not have a key")
    if len(frame.extras) == V1.size:
        if frame.value:
            raise ProtocolError("V1 snapshot marker must not have a value")
        start, end, flags = V1.unpack(frame.extras)
        mvs = hcs = purge = hps = 0
        version = MarkerVersion.V1
    elif len(frame.extras) == 1:
        start, end, flags, mvs, hcs, purge, hps, version = _decode_v2(frame.extras[0], frame.value)
    else:
        raise ProtocolError(f"snapshot marker extras of {len(frame.extras)} bytes")
    if flags & ~MARKER_FLAGS_MASK:
        raise ProtocolError(f"unknown snapshot marker flags 0x{flags:x}")
    if start > end:
        raise ProtocolError(f"snapshot marker start {start} > end {end}")
    return SnapshotMarker(
        frame.vbucket,
        frame.opaque,
        start,
        end,
        flags,
        mvs,
        hcs,
        purge,
        hps,
        version,
        frame.stream_id,
    )


def _decode_v2(
    version_byte: int, value: bytes
) -> tuple[int, int, int, int, int, int, int, MarkerVersion]:
    if version_byte == 0:
        if len(value) != V2_0.size:
            raise ProtocolError(f"V2.0 snapshot marker value of {len(value)} bytes, not 36")
        start, end, flags, mvs, hcs = V2_0.unpack(value)
        return start, end, flags, mvs, hcs, 0, 0, MarkerVersion.V2_0
    if version_byte == 2:
        if len(value) != V2_2.size:
            raise ProtocolError(f"V2.2 snapshot marker value of {len(value)} bytes, not 52")
        start, end, flags, mvs, hcs, purge, hps = V2_2.unpack(value)
        return start, end, flags, mvs, hcs, purge, hps, MarkerVersion.V2_2
    raise ProtocolError(f"snapshot marker version {version_byte} is not supported", Status.EINVAL)
