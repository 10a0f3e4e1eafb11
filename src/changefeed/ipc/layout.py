"""Byte layout of a service's two shared-memory segments, and its checked decoder.

One service (one stream group of a node) has a CONTROL segment and a DATA segment. All integers
are little-endian; every field that is read or written atomically sits on its natural alignment
(the mapping is page-aligned), and each section starts on a 64-byte boundary.

CONTROL segment::

    header (192 bytes)
      0  8s  magic b"CFIPCCT1"          static: written once at creation, covered by the CRC
      8  u32 layout version (1)
     12  u32 header bytes (192)
     16  u32 slot_count                  sample slots in the data segment
     20  u32 slot_bytes                  bytes per slot (header + positions + Arrow IPC message)
     24  u32 max_subscribers             = transaction logs in the set
     28  u32 pid_map_entries
     32  u32 group_size                  vbuckets of the group
     36  u32 index_entries               seq -> slot ring (2 x slot_count)
     40  u64 control_bytes               size of this segment
     48  u64 data_bytes                  size of the data segment
     56  u64 segment_id                  random, new at every creation (tells a recreated
                                         segment from the one a process mapped before)
     64  u32 node_port
     68  u32 (reserved)
     72  32s bucket name, UTF-8, NUL-padded
    104  u32 CRC-32 of bytes 0..104 and the group table
    108  u32 service_state     atomic    INITIALIZING 0, OFFERED 1, STOPPED 2, REPLACED 3
    112  u64 provider_epoch    atomic    +1 at every offer (creation or reuse)
    120  u64 head_seq          atomic    newest published batch (0: none yet)
    128  u32 provider_pid      atomic
    132  u32 subscription      atomic    subscribers << 16 | subscribed slots (LoLa's
                                         EventSubscriptionControl state)
    136  (reserved to 192)
    group table       u16 x group_size: the group's vbuckets, ascending
    slot states       u64 x slot_count: seq << 16 | refcount; seq 0 = empty,
                      seq SEQ_IN_WRITING = being written by the provider
    index             u64 x index_entries: seq << 16 | slot, at [seq % index_entries]
    transaction logs  max_subscribers x node (see NODE_*), then per slot 2 bytes (BEGIN, END)
    UID/PID map       pid_map_entries x 32: u64 key = status << 32 | app_id, u32 pid,
                      u32 -, u64 process start time, u64 -

DATA segment: slot_count slots of slot_bytes each::

      0  u64 seq          the batch's seq (also in the slot's state word)
      8  u32 rows
     12  u32 ipc_bytes    length of the Arrow IPC record-batch message
     16  u32 group_size
     20  u32 flags        SLOT_FLAG_GAP: the rows do not cover the positions (a reader must
                          resume over DCP; the provider could not fit a row into a slot)
     24  u64 provider_epoch
     32  u64 published_ns  wall clock at publish (latency)
     64  positions: group_size x (vb_uuid, seqno, snap_start, snap_end, seqno_before) u64,
         the publisher's position in every vbucket of the group after this batch, and its
         seqno before it
      …  Arrow IPC record-batch message (CHANGE_ROW_SCHEMA), at a 64-byte boundary

``decode_control`` checks everything it reads (magic, version, geometry bounds, sizes against
the mapping, CRC) and raises `ControlSegmentError` with what is wrong; ``check_control`` also
checks the live words (flags, refcounts, owners). Neither can fail any other way on any bytes.

Not here: the protocols on these words (provider.py, proxy.py, txlog.py).
"""

from __future__ import annotations

import itertools
import struct
import zlib
from dataclasses import dataclass
from typing import Final

from changefeed import limits
from changefeed.ipc.errors import ControlSegmentError

MAGIC: Final = b"CFIPCCT1"
LAYOUT_VERSION: Final = 1
HEADER_BYTES: Final = 192
_STATIC = struct.Struct("<8sIIIIIIIIQQQII32s")
assert _STATIC.size == 104, _STATIC.size
CRC_AT: Final = 104
SERVICE_STATE_AT: Final = 108
PROVIDER_EPOCH_AT: Final = 112
HEAD_SEQ_AT: Final = 120
PROVIDER_PID_AT: Final = 128
SUBSCRIPTION_AT: Final = 132

INITIALIZING: Final = 0
OFFERED: Final = 1
STOPPED: Final = 2
REPLACED: Final = 3
SERVICE_STATES: Final = {
    INITIALIZING: "initializing",
    OFFERED: "offered",
    STOPPED: "stopped",
    REPLACED: "replaced",
}

# Slot state word: seq << 16 | refcount.
REFCOUNT_BITS: Final = 16
REFCOUNT_MASK: Final = (1 << REFCOUNT_BITS) - 1
SEQ_MAX: Final = (1 << 48) - 2
SEQ_IN_WRITING: Final = (1 << 48) - 1
IN_WRITING_WORD: Final = SEQ_IN_WRITING << REFCOUNT_BITS

# Transaction-log node header (64 bytes), then 2 bytes per slot.
INVALID_OWNER: Final = 0xFFFF_FFFF
NODE_HEADER_BYTES: Final = 64
NODE_OWNER: Final = 0  # u32, atomic
NODE_NEEDS_ROLLBACK: Final = 4  # u8
NODE_SUB_BEGIN: Final = 5  # u8
NODE_SUB_END: Final = 6  # u8
NODE_WAITING: Final = 7  # u8: the reader sleeps on its wakeup socket
NODE_MAX_SAMPLES: Final = 8  # u16, stored by SubscribeTxBegin, needed to undo the subscribe
NODE_OWNER_PID: Final = 12  # u32
NODE_OWNER_START: Final = 16  # u64: the owner process's start time (pid reuse)
NODE_NEXT_SEQ: Final = 24  # u64: the next seq the reader wants (lag; not used for recovery)
NODE_LOST: Final = 32  # u64: times the reader fell behind the ring
# u64: the inode of the owner's pid namespace (/proc/self/ns/pid); 0 = unknown. The provider
# judges a reader dead by its pid only when it shares this namespace (a pid means nothing in
# another one). In the header's reserved bytes: layout version 1 is unchanged (0 in old logs).
NODE_OWNER_PIDNS: Final = 40

# UID/PID map entry (32 bytes): key = status << 32 | app_id.
PID_ENTRY_BYTES: Final = 32
PID_UNUSED: Final = 0
PID_USED: Final = 1
PID_UPDATING: Final = 2
PID_INVALID: Final = 3

# Data slot.
SLOT_HEADER: Final = struct.Struct("<QIIIIQQ")
SLOT_HEADER_BYTES: Final = 64
POSITION_FIELDS: Final = 5  # vb_uuid, seqno, snap_start, snap_end, seqno_before
POSITION_BYTES: Final = 8 * POSITION_FIELDS
SLOT_FLAG_GAP: Final = 1

# Bounds of a geometry (the decoder refuses anything outside them).
SLOT_COUNT_MIN: Final = 2
SLOT_COUNT_MAX: Final = 4096
SLOT_BYTES_MIN: Final = 16 * 1024
SLOT_BYTES_MAX: Final = 1024 * 1024 * 1024
MAX_SUBSCRIBERS_MAX: Final = 1024
PID_MAP_ENTRIES_MAX: Final = 4096
SLOT_PAYLOAD_MIN: Final = 4096
assert SLOT_COUNT_MAX <= REFCOUNT_MASK and MAX_SUBSCRIBERS_MAX <= REFCOUNT_MASK


def align(value: int, to: int = 64) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True, slots=True)
class Geometry:
    """The sizes a provider offers a service with (fixed for the life of the segments).

    Attributes:
        slot_count: sample slots; at most ``slot_count - 1`` of them can be held by readers
            (the subscription budget), so the provider always has one to write.
        slot_bytes: bytes of one slot: header, positions, one Arrow IPC batch message.
        max_subscribers: transaction logs in the set, and the most readers at once.
        group: the vbuckets of the stream group, ascending.
        pid_map_entries: UID/PID pairs kept (application ids that ever subscribed).
    """

    slot_count: int
    slot_bytes: int
    max_subscribers: int
    group: tuple[int, ...]
    pid_map_entries: int = 64

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str:
        """What is wrong with this geometry, or ""."""
        return self.problem_of(
            self.slot_count, self.slot_bytes, self.max_subscribers, self.group, self.pid_map_entries
        )

    @staticmethod
    def problem_of(
        slot_count: int,
        slot_bytes: int,
        max_subscribers: int,
        group: tuple[int, ...],
        pid_map_entries: int = 64,
    ) -> str:
        """What is wrong with a geometry of these values, or "" (a node checks its config)."""
        if not SLOT_COUNT_MIN <= slot_count <= SLOT_COUNT_MAX:
            return f"slot_count {slot_count} is not {SLOT_COUNT_MIN}..{SLOT_COUNT_MAX}"
        if not SLOT_BYTES_MIN <= slot_bytes <= SLOT_BYTES_MAX or slot_bytes % 64:
            return (
                f"slot_bytes {slot_bytes} is not a multiple of 64 in "
                f"{SLOT_BYTES_MIN}..{SLOT_BYTES_MAX}"
            )
        if not 1 <= max_subscribers <= MAX_SUBSCRIBERS_MAX:
            return f"max_subscribers {max_subscribers} is not 1..{MAX_SUBSCRIBERS_MAX}"
        if max_subscribers > slot_count - 1:
            return (
                f"max_subscribers {max_subscribers} needs at least {max_subscribers + 1} slots "
                f"(each reader holds one or more), not {slot_count}"
            )
        if not 1 <= pid_map_entries <= PID_MAP_ENTRIES_MAX:
            return f"pid_map_entries {pid_map_entries} is not 1..{PID_MAP_ENTRIES_MAX}"
        if not 1 <= len(group) <= limits.VBUCKETS_MAX:
            return f"a group holds 1..{limits.VBUCKETS_MAX} vbuckets, not {len(group)}"
        if any(not 0 <= vb < limits.VBUCKETS_MAX for vb in group):
            return f"group vbuckets must be 0..{limits.VBUCKETS_MAX - 1}"
        if any(a >= b for a, b in itertools.pairwise(group)):
            return "group vbuckets must be ascending and unique"
        payload = slot_bytes - align(SLOT_HEADER_BYTES + POSITION_BYTES * len(group))
        if payload < SLOT_PAYLOAD_MIN:
            return (
                f"slot_bytes {slot_bytes} leaves {payload} bytes for a batch after the positions "
                f"of {len(group)} vbuckets; at least {SLOT_PAYLOAD_MIN}"
            )
        return ""

    @property
    def index_entries(self) -> int:
        return 2 * self.slot_count

    @property
    def positions_at(self) -> int:
        """Offset of the positions inside a slot."""
        return SLOT_HEADER_BYTES

    @property
    def payload_at(self) -> int:
        """Offset of the Arrow message inside a slot."""
        return align(SLOT_HEADER_BYTES + POSITION_BYTES * len(self.group))

    @property
    def slot_payload_bytes(self) -> int:
        return self.slot_bytes - self.payload_at

    @property
    def subscribable_slots(self) -> int:
        """Slots readers may hold in all (the provider keeps one to write)."""
        return self.slot_count - 1

    @property
    def node_bytes(self) -> int:
        return NODE_HEADER_BYTES + align(2 * self.slot_count, 8)

    @property
    def data_bytes(self) -> int:
        return self.slot_count * self.slot_bytes


@dataclass(frozen=True, slots=True)
class ControlLayout:
    """Where everything is in a control segment of a given geometry."""

    geometry: Geometry
    group_at: int
    slots_at: int
    index_at: int
    logs_at: int
    pid_map_at: int
    control_bytes: int

    @classmethod
    def of(cls, geometry: Geometry) -> ControlLayout:
        group_at = HEADER_BYTES
        slots_at = align(group_at + 2 * len(geometry.group))
        index_at = align(slots_at + 8 * geometry.slot_count)
        logs_at = align(index_at + 8 * geometry.index_entries)
        pid_map_at = align(logs_at + geometry.max_subscribers * geometry.node_bytes)
        end = align(pid_map_at + PID_ENTRY_BYTES * geometry.pid_map_entries, 4096)
        return cls(geometry, group_at, slots_at, index_at, logs_at, pid_map_at, end)

    def slot_state(self, slot: int) -> int:
        return self.slots_at + 8 * slot

    def index_entry(self, seq: int) -> int:
        return self.index_at + 8 * (seq % self.geometry.index_entries)

    def node(self, index: int) -> int:
        return self.logs_at + index * self.geometry.node_bytes

    def node_slot(self, index: int, slot: int) -> int:
        """Offset of the BEGIN byte of `slot` in log `index` (END follows)."""
        return self.node(index) + NODE_HEADER_BYTES + 2 * slot

    def pid_entry(self, index: int) -> int:
        return self.pid_map_at + index * PID_ENTRY_BYTES


@dataclass(frozen=True, slots=True)
class Header:
    """The static header of a control segment, as decoded."""

    layout: ControlLayout
    segment_id: int
    node_port: int
    bucket: str

    @property
    def geometry(self) -> Geometry:
        return self.layout.geometry


def encode_header(
    buffer: memoryview, geometry: Geometry, *, segment_id: int, node_port: int, bucket: str
) -> ControlLayout:
    """Write the static header and group table of a fresh (zeroed) control segment."""
    layout = ControlLayout.of(geometry)
    assert len(buffer) >= layout.control_bytes, (len(buffer), layout.control_bytes)
    name = bucket.encode()
    if len(name) > 32:
        raise ValueError(f"bucket name {bucket!r} is over 32 bytes")
    static = _STATIC.pack(
        MAGIC,
        LAYOUT_VERSION,
        HEADER_BYTES,
        geometry.slot_count,
        geometry.slot_bytes,
        geometry.max_subscribers,
        geometry.pid_map_entries,
        len(geometry.group),
        geometry.index_entries,
        layout.control_bytes,
        geometry.data_bytes,
        segment_id,
        node_port,
        0,
        name,
    )
    buffer[: len(static)] = static
    group = struct.pack(f"<{len(geometry.group)}H", *geometry.group)
    buffer[layout.group_at : layout.group_at + len(group)] = group
    struct.pack_into("<I", buffer, CRC_AT, _crc(buffer, layout))
    return layout


def _crc(buffer: memoryview, layout: ControlLayout) -> int:
    group_end = layout.group_at + 2 * len(layout.geometry.group)
    return zlib.crc32(buffer[layout.group_at : group_end], zlib.crc32(buffer[:CRC_AT]))


def decode_control(buffer: memoryview | bytes) -> Header:
    """Decode and check a control segment's static header.

    Raises:
        ControlSegmentError: not a control segment of this layout, or damaged; the message says
            which field is wrong.
    """
    view = memoryview(buffer)
    if len(view) < HEADER_BYTES:
        raise ControlSegmentError(
            f"control segment of {len(view)} bytes is shorter than its header"
        )
    (
        magic,
        version,
        header_bytes,
        slot_count,
        slot_bytes,
        max_subscribers,
        pid_entries,
        group_size,
        index_entries,
        control_bytes,
        data_bytes,
        segment_id,
        node_port,
        _reserved,
        raw_bucket,
    ) = _STATIC.unpack_from(view, 0)
    if magic != MAGIC:
        raise ControlSegmentError(f"bad magic {magic!r} (not a changefeed.ipc control segment)")
    if version != LAYOUT_VERSION or header_bytes != HEADER_BYTES:
        raise ControlSegmentError(
            f"layout version {version} (header {header_bytes} bytes); this code reads version "
            f"{LAYOUT_VERSION} ({HEADER_BYTES})"
        )
    if not 1 <= group_size <= limits.VBUCKETS_MAX:
        raise ControlSegmentError(f"group size {group_size} is not 1..{limits.VBUCKETS_MAX}")
    if HEADER_BYTES + 2 * group_size > len(view):
        raise ControlSegmentError("the group table runs past the segment")
    group = tuple(struct.unpack_from(f"<{group_size}H", view, HEADER_BYTES))
    try:
        geometry = Geometry(slot_count, slot_bytes, max_subscribers, group, pid_entries)
    except ValueError as error:
        raise ControlSegmentError(f"bad geometry: {error}") from None
    layout = ControlLayout.of(geometry)
    if index_entries != geometry.index_entries:
        raise ControlSegmentError(
            f"index of {index_entries} entries, expected {geometry.index_entries}"
        )
    if control_bytes != layout.control_bytes or control_bytes > len(view):
        raise ControlSegmentError(
            f"control size {control_bytes} does not match its geometry ({layout.control_bytes}) "
            f"or the mapping ({len(view)} bytes)"
        )
    if data_bytes != geometry.data_bytes:
        raise ControlSegmentError(
            f"data size {data_bytes} != {geometry.data_bytes} of its geometry"
        )
    (crc,) = struct.unpack_from("<I", view, CRC_AT)
    if crc != _crc(view, layout):
        raise ControlSegmentError("header checksum mismatch (the header was overwritten)")
    try:
        bucket = raw_bucket.rstrip(b"\0").decode()
    except UnicodeDecodeError:
        raise ControlSegmentError("bucket name is not UTF-8") from None
    return Header(layout, segment_id, node_port, bucket)


def check_control(buffer: memoryview | bytes) -> Header:
    """`decode_control`, then check every live word against the geometry.

    Raises:
        ControlSegmentError: naming the first word out of range.
    """
    header = decode_control(buffer)
    view = memoryview(buffer)
    layout = header.layout
    geometry = layout.geometry
    (state,) = struct.unpack_from("<I", view, SERVICE_STATE_AT)
    if state not in SERVICE_STATES:
        raise ControlSegmentError(f"service state {state} is unknown")
    (head,) = struct.unpack_from("<Q", view, HEAD_SEQ_AT)
    if head > SEQ_MAX:
        raise ControlSegmentError(f"head seq {head} is out of range")
    (subscription,) = struct.unpack_from("<I", view, SUBSCRIPTION_AT)
    subscribers, subscribed = subscription >> 16, subscription & 0xFFFF
    if subscribers > geometry.max_subscribers or subscribed > geometry.subscribable_slots:
        raise ControlSegmentError(
            f"subscription state {subscribers} subscribers / {subscribed} slots exceeds "
            f"{geometry.max_subscribers} / {geometry.subscribable_slots}"
        )
    for slot in range(geometry.slot_count):
        (word,) = struct.unpack_from("<Q", view, layout.slot_state(slot))
        seq, refs = word >> REFCOUNT_BITS, word & REFCOUNT_MASK
        if refs > geometry.max_subscribers or (seq == SEQ_IN_WRITING and refs):
            raise ControlSegmentError(f"slot {slot}: refcount {refs} is out of range")
    for index in range(geometry.max_subscribers):
        at = layout.node(index)
        flags = bytes(view[at + NODE_NEEDS_ROLLBACK : at + NODE_WAITING + 1])
        if any(flag > 1 for flag in flags):
            raise ControlSegmentError(f"transaction log {index}: header flags {flags!r} not 0/1")
        at = layout.node_slot(index, 0)
        marks = bytes(view[at : at + 2 * geometry.slot_count])
        if any(mark > 1 for mark in marks):
            raise ControlSegmentError(f"transaction log {index}: slot flags are not 0/1")
    for index in range(geometry.pid_map_entries):
        (key,) = struct.unpack_from("<Q", view, layout.pid_entry(index))
        if key >> 32 > PID_INVALID:
            raise ControlSegmentError(f"UID/PID entry {index}: status {key >> 32} is unknown")
    return header


@dataclass(frozen=True, slots=True)
class SlotHeader:
    seq: int
    rows: int
    ipc_bytes: int
    group_size: int
    flags: int
    provider_epoch: int
    published_ns: int


def decode_slot_header(buffer: memoryview, geometry: Geometry) -> SlotHeader:
    """The header of one data slot, checked against the geometry.

    Raises:
        ControlSegmentError: a field is out of range (a damaged slot).
    """
    header = SlotHeader(*SLOT_HEADER.unpack_from(buffer, 0))
    if header.group_size != len(geometry.group):
        raise ControlSegmentError(f"slot of seq {header.seq}: group size {header.group_size}")
    if header.ipc_bytes > geometry.slot_payload_bytes:
        raise ControlSegmentError(f"slot of seq {header.seq}: {header.ipc_bytes} IPC bytes")
    if not 0 < header.seq <= SEQ_MAX:
        raise ControlSegmentError(f"slot seq {header.seq} is out of range")
    return header
