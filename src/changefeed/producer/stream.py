"""``ActiveStream``: one vbucket's DCP stream on one connection, from accept to STREAM_END.

It reads events from a ``StreamReader`` (memory or disk, the reader decides) and turns them into
frames: a snapshot marker per snapshot — the first one starts at the requested start seqno
(snapshot-marker.md, "Memory/Disk snapshot start-seqno", case 1) — then the items. It ends with
STREAM_END(OK) once the whole snapshot containing ``end_seqno`` was sent (dcp-wire.md §11), or
with another reason when the producer ends it. Seqnos sent strictly increase (asserted).
"""

from __future__ import annotations

from enum import Enum

from changefeed.checkpoint.item import Item
from changefeed.checkpoint.reader import StreamReader
from changefeed.checkpoint.snapshot import CursorSignal, SnapshotStart
from changefeed.producer.item_encoding import ItemOptions, encode_item
from changefeed.protocol.dcp import StreamEnd, StreamEndReason, encode_stream_end
from changefeed.protocol.snapshot_marker import (
    MarkerVersion,
    SnapshotMarker,
    encode_snapshot_marker,
)


class StreamState(Enum):
    ACTIVE = "active"
    ENDED = "ended"


class ActiveStream:
    """Frames of one stream; ``fill`` is called by the producer's round-robin pump."""

    def __init__(
        self,
        vb: int,
        opaque: int,
        *,
        start_seqno: int,
        end_seqno: int,
        reader: StreamReader,
        options: ItemOptions,
        stream_id: int | None = None,
        marker_version: MarkerVersion = MarkerVersion.V1,
        purge_seqno: int = 0,
    ) -> None:
        self.vb = vb
        self.opaque = opaque
        self.start_seqno = start_seqno
        self.end_seqno = end_seqno
        self.reader = reader
        self.options = options
        self.stream_id = stream_id
        self.marker_version = marker_version
        self.purge_seqno = purge_seqno
        self.state = StreamState.ACTIVE
        self.last_sent_seqno = start_seqno
        self.items_sent = 0
        self._first_marker = True
        self._snap_end = start_seqno  # end of the snapshot being sent
        self._pending_end: StreamEndReason | None = None
        if start_seqno >= end_seqno:
            self._pending_end = StreamEndReason.OK  # nothing to send (dcp-wire.md §6.2 step 11)

    @property
    def ready(self) -> bool:
        """True when ``fill`` would produce something now."""
        if self.state is StreamState.ENDED:
            return False
        return self._pending_end is not None or self.reader.has_next

    def end(self, reason: StreamEndReason) -> None:
        """Ask the stream to end; the STREAM_END is sent by the next ``fill``."""
        if self.state is StreamState.ACTIVE and self._pending_end is None:
            self._pending_end = reason

    def fill(self, out: list[bytes], bytes_max: int) -> int:
        """Append frames to ``out`` until ``bytes_max`` bytes, caught up, or ended.

        Returns:
            Bytes appended.
        """
        written = 0
        while written < bytes_max and self.state is StreamState.ACTIVE:
            if self._pending_end is not None:
                written += self._finish(out, self._pending_end)
                break
            event = self.reader.next()
            if event is CursorSignal.CAUGHT_UP:
                break
            if isinstance(event, SnapshotStart):
                if event.snap_start > self.end_seqno and self._snap_end >= self.end_seqno:
                    self._pending_end = StreamEndReason.OK
                    continue
                written += self._marker(out, event)
            else:
                assert isinstance(event, Item), event
                written += self._item(out, event)
        return written

    def close(self) -> None:
        self.reader.close()
        self.state = StreamState.ENDED

    def _marker(self, out: list[bytes], event: SnapshotStart) -> int:
        snap_start = self.start_seqno if self._first_marker else event.snap_start
        snap_start = min(snap_start, event.snap_end)
        self._first_marker = False
        self._snap_end = event.snap_end
        marker = SnapshotMarker(
            self.vb,
            self.opaque,
            snap_start,
            event.snap_end,
            event.flags,
            purge_seqno=self.purge_seqno if self.marker_version is MarkerVersion.V2_2 else 0,
            version=self.marker_version,
            stream_id=self.stream_id,
        )
        frame = encode_snapshot_marker(marker)
        out.append(frame)
        return len(frame)

    def _item(self, out: list[bytes], item: Item) -> int:
        assert item.seqno > self.last_sent_seqno, (self.vb, item.seqno, self.last_sent_seqno)
        assert item.seqno <= self._snap_end, (self.vb, item.seqno, self._snap_end)
        self.last_sent_seqno = item.seqno
        self.items_sent += 1
        frame = encode_item(item, self.vb, self.opaque, self.options, self.stream_id)
        out.append(frame)
        if item.seqno == self._snap_end and self._snap_end >= self.end_seqno:
            self._pending_end = StreamEndReason.OK
        return len(frame)

    def _finish(self, out: list[bytes], reason: StreamEndReason) -> int:
        self.close()
        frame = encode_stream_end(StreamEnd(self.vb, self.opaque, reason, self.stream_id))
        out.append(frame)
        return len(frame)
