"""Flexible framing extras ("frame infos") carried by alt-magic packets (dcp-wire.md §1.3).

Each object starts with a byte ``(id << 4) | len``; a nibble of 15 escapes to ``15 + next byte``
(id escape first, then length escape). The only one DCP needs is the stream-id (id 2, two bytes).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.status import Status

FRAME_INFO_BARRIER = 0
FRAME_INFO_DURABILITY = 1
FRAME_INFO_DCP_STREAM_ID = 2
FRAME_INFO_PRESERVE_TTL = 5

_ESCAPE = 15


def encode_frame_info(info_id: int, data: bytes) -> bytes:
    """Encode one frame info object.

    Args:
        info_id: frame info id (0..270).
        data: payload (0..270 bytes).
    """
    if not 0 <= info_id <= _ESCAPE + 255:
        raise ValueError(f"frame info id out of range: {info_id}")
    if len(data) > _ESCAPE + 255:
        raise ValueError(f"frame info too long: {len(data)}")
    out = bytearray()
    id_nibble = min(info_id, _ESCAPE)
    len_nibble = min(len(data), _ESCAPE)
    out.append((id_nibble << 4) | len_nibble)
    if id_nibble == _ESCAPE:
        out.append(info_id - _ESCAPE)
    if len_nibble == _ESCAPE:
        out.append(len(data) - _ESCAPE)
    out += data
    return bytes(out)


def encode_stream_id(stream_id: int) -> bytes:
    """The 3-byte stream-id frame info: ``0x22, sid_hi, sid_lo``."""
    if not 1 <= stream_id <= 0xFFFF:
        raise ValueError(f"stream id must be 1..65535: {stream_id}")
    return bytes((0x22, stream_id >> 8, stream_id & 0xFF))


def decode_frame_infos(data: bytes) -> list[tuple[int, bytes]]:
    """Split framing extras into ``(id, payload)`` pairs.

    Raises:
        ProtocolError: a truncated object (EINVAL).
    """
    infos: list[tuple[int, bytes]] = []
    pos = 0
    end = len(data)
    while pos < end:  # bounded: every iteration consumes at least one byte
        first = data[pos]
        pos += 1
        info_id = first >> 4
        length = first & 0x0F
        if info_id == _ESCAPE:
            if pos >= end:
                raise ProtocolError("frame info id escape truncated", Status.EINVAL)
            info_id += data[pos]
            pos += 1
        if length == _ESCAPE:
            if pos >= end:
                raise ProtocolError("frame info length escape truncated", Status.EINVAL)
            length += data[pos]
            pos += 1
        if pos + length > end:
            raise ProtocolError(
                f"frame info {info_id} declares {length} bytes, {end - pos} left", Status.EINVAL
            )
        infos.append((info_id, bytes(data[pos : pos + length])))
        pos += length
    return infos


def stream_id_of(framing_extras: bytes) -> int | None:
    """Return the DCP stream-id in ``framing_extras``, or None when there is none.

    Raises:
        ProtocolError: malformed frame infos (EINVAL), or a stream-id frame that is not 2 bytes
            or holds stream id 0 (DCP_STREAM_ID_INVALID).
    """
    if not framing_extras:
        return None
    for info_id, payload in decode_frame_infos(framing_extras):
        if info_id == FRAME_INFO_DCP_STREAM_ID:
            if len(payload) != 2:
                raise ProtocolError(
                    f"stream-id frame info has {len(payload)} bytes, not 2",
                    Status.DCP_STREAM_ID_INVALID,
                )
            stream_id = (payload[0] << 8) | payload[1]
            # dcp-wire.md §1.5 (0x8d): a sid that is missing, 0 or in use is invalid.
            if stream_id == 0:
                raise ProtocolError("stream id 0 is invalid", Status.DCP_STREAM_ID_INVALID)
            return stream_id
    return None


class DurabilityLevel(enum.IntEnum):
    """Levels of the durability frame info (dcp-wire.md §1.3, id 1), as the SDKs send them."""

    MAJORITY = 1
    MAJORITY_AND_PERSIST_TO_ACTIVE = 2
    PERSIST_TO_MAJORITY = 3


@dataclass(frozen=True, slots=True)
class DurabilityRequirement:
    """A write's durability frame: its level and, optionally, the client's timeout."""

    level: DurabilityLevel
    timeout_ms: int | None = None


_TIMEOUT = struct.Struct(">H")


def encode_durability(requirement: DurabilityRequirement) -> bytes:
    """The durability frame info a client puts in a write's framing extras."""
    payload = bytes((requirement.level,))
    if requirement.timeout_ms is not None:
        payload += _TIMEOUT.pack(requirement.timeout_ms)
    return encode_frame_info(FRAME_INFO_DURABILITY, payload)


def durability_of(framing_extras: bytes) -> DurabilityRequirement | None:
    """Return the durability requirement in ``framing_extras``, or None when there is none.

    The payload is one level byte, optionally followed by a u16 timeout in milliseconds.

    Raises:
        ProtocolError: malformed frame infos or a payload of another size (EINVAL), or an
            unknown level (DURABILITY_INVALID_LEVEL).
    """
    if not framing_extras:
        return None
    for info_id, payload in decode_frame_infos(framing_extras):
        if info_id != FRAME_INFO_DURABILITY:
            continue
        if len(payload) not in (1, 1 + _TIMEOUT.size):
            raise ProtocolError(f"durability frame info has {len(payload)} bytes, not 1 or 3")
        levels = [int(level) for level in DurabilityLevel]
        if payload[0] not in levels:
            raise ProtocolError(
                f"durability level {payload[0]} not in {levels}", Status.DURABILITY_INVALID_LEVEL
            )
        timeout_ms = _TIMEOUT.unpack(payload[1:])[0] if len(payload) > 1 else None
        return DurabilityRequirement(DurabilityLevel(payload[0]), timeout_ms)
    return None
