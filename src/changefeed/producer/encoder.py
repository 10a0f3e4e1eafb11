"""How a stream's output is encoded, behind one small interface.

A `Stream` decides *what* to send (markers, runs of items, the end); a `StreamEncoder` decides
*how*: `DcpEncoder` produces DCP frames for a socket today, and an Arrow encoder for the
shared-memory fan-out can produce record batches from the same calls. Each method appends to
`out` and returns the bytes it appended, which the producer counts against flow control. Runs
come as checkpoint items (memory) or as stored records (disk backfill), both carrying their
DCP bodies; `DcpEncoder` frames a run into one bytes object (item_encoding.py).

Not here: flow-control accounting (flow_control.py), stream state (stream_machine.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from changefeed.checkpoint import Item, SnapshotStart
from changefeed.producer.item_encoding import ItemFramer, ItemOptions
from changefeed.protocol.dcp import StreamEnd, StreamEndReason, encode_stream_end
from changefeed.protocol.snapshot_marker import (
    MarkerVersion,
    SnapshotMarker,
    encode_snapshot_marker,
)


class StreamEncoder(Protocol):
    """The output side of one stream.

    Attributes:
        event_bytes_min: the fewest bytes any one marker or item takes; a stream reads ahead
            no more events than a budget could hold at that size, so a stream throttled by flow
            control does not move its cursor past what it can send.
    """

    event_bytes_min: int

    def snapshot_marker(self, out: list[bytes], marker: SnapshotStart, purge_seqno: int) -> int:
        """Append a snapshot marker; returns bytes appended."""
        ...

    def items(self, out: list[bytes], items: Sequence[Item], bytes_max: int) -> tuple[int, int]:
        """Append items from the front of `items` until `bytes_max` bytes are appended (at least
        one item: a message may overshoot the window, dcp-wire.md §8.1).

        Returns:
            (items encoded, bytes appended).
        """
        ...

    def stored(self, out: list[bytes], records: Sequence[bytes], bytes_max: int) -> tuple[int, int]:
        """Like `items`, for records read from disk in their stored form (storage/record.py).

        Returns:
            (records encoded, bytes appended).
        """
        ...

    def stream_end(self, out: list[bytes], reason: StreamEndReason) -> int:
        """Append the end of the stream; returns bytes appended."""
        ...


class DcpEncoder:
    """DCP frames for one stream: its vbucket, opaque, stream-id and the connection's options."""

    # The smallest frame a stream sends: a V1 snapshot marker, header + 20 bytes of extras
    # (dcp-wire.md §7.2); every item frame is larger (header + >= 18 bytes extras + key).
    event_bytes_min = 24 + 20

    def __init__(
        self,
        vb: int,
        opaque: int,
        options: ItemOptions,
        *,
        marker_version: MarkerVersion = MarkerVersion.V1,
        stream_id: int | None = None,
    ) -> None:
        self.vb = vb
        self.opaque = opaque
        self.options = options
        self.marker_version = marker_version
        self.stream_id = stream_id
        self._framer = ItemFramer(vb, opaque, options, stream_id)

    def snapshot_marker(self, out: list[bytes], marker: SnapshotStart, purge_seqno: int) -> int:
        v2_2 = self.marker_version is MarkerVersion.V2_2
        frame = encode_snapshot_marker(
            SnapshotMarker(
                self.vb,
                self.opaque,
                marker.snap_start,
                marker.snap_end,
                marker.flags,
                max_visible_seqno=marker.max_visible_seqno,
                high_completed_seqno=marker.high_completed_seqno,
                purge_seqno=purge_seqno if v2_2 else 0,
                version=self.marker_version,
                stream_id=self.stream_id,
            )
        )
        out.append(frame)
        return len(frame)

    def items(self, out: list[bytes], items: Sequence[Item], bytes_max: int) -> tuple[int, int]:
        return _appended(out, self._framer.items(items, bytes_max), len(items))

    def plain_items(
        self, out: list[bytes], items: Sequence[Item], bytes_max: int
    ) -> tuple[int, int] | None:
        """`items` if no key of the run names a collection (`ItemFramer.plain_items`); else
        None, and nothing appended.

        Returns:
            (items framed, bytes appended to `out`), or None if a key of the run begins with
            the collection marker.
        """
        framed = self._framer.plain_items(items, bytes_max)
        return None if framed is None else _appended(out, framed, len(items))

    def plain_stored(
        self, out: list[bytes], records: Sequence[bytes], bytes_max: int
    ) -> tuple[int, int] | None:
        """`records` on the fast path if no key names a collection (`ItemFramer.plain_stored`);
        else None, and nothing appended.

        Returns:
            (records framed, bytes appended to `out`), or None if a key begins with the
            collection marker or a record is not on the fast path (the caller frames the run
            another way).
        """
        framed = self._framer.plain_stored(records, bytes_max)
        return None if framed is None else _appended(out, framed, len(records))

    def stored(self, out: list[bytes], records: Sequence[bytes], bytes_max: int) -> tuple[int, int]:
        return _appended(out, self._framer.stored(records, bytes_max), len(records))

    def stream_end(self, out: list[bytes], reason: StreamEndReason) -> int:
        frame = encode_stream_end(StreamEnd(self.vb, self.opaque, reason, self.stream_id))
        out.append(frame)
        return len(frame)


def _appended(out: list[bytes], framed: tuple[bytes, int, int], run_len: int) -> tuple[int, int]:
    """Appends a run's frames (`ItemFramer`'s answer) to `out`: (count framed, bytes)."""
    frames, count, written = framed
    assert len(frames) == written, (len(frames), written)  # flow control counts `written`
    assert 0 < count <= run_len, (count, run_len)
    out.append(frames)
    return count, written
