"""The states of one DCP stream and every transition between them, in one table.

Only this module changes a stream's state; `Stream` (stream.py) feeds it what the reader hands
out and asks it what to send. It does not know where items come from or how they are encoded.

    SNAPSHOT_PENDING ──disk marker──▶ IN_DISK_SNAPSHOT ──item at snap_end──▶ SNAPSHOT_PENDING
          │        ──memory marker─▶ IN_MEMORY_SNAPSHOT ─item at snap_end──▶ SNAPSHOT_PENDING
          │                 (a marker may also follow a snapshot whose last item was deduplicated,
          │                  and a disk snapshot is followed by memory ones: the backfill switch)
          └─ any live state ──end seqno reached / end requested──▶ ENDING ──STREAM_END sent──▶ ENDED
                            ──connection closed────────────────────────────────────────────▶ ENDED

A stream ends with STREAM_END(OK) once the whole snapshot containing `end_seqno` was sent
(dcp-wire.md §11), or at once when nothing lies between start and end (§6.2 step 11); other
reasons come from the producer (CLOSED on CLOSE_STREAM, STATE_CHANGED, ...).

Seqnos a stream reads but does not send still move it: an application stream skips SyncWrite
PREPAREs and ABORTs (item_encoding.py frames them as 0 bytes), and some seqnos are in no place a
reader gets them from at all — a disk snapshot's range may end at a prepare or an abort (the
store keeps them out of `by_seqno`), a restarted vbucket holds its pending prepares in no
checkpoint, a replica may hold only the front of its active's snapshot. So the machine's
position (`last_sent_seqno`) is what the stream has *read*, and the reader says where it stands
when it has nothing more (`caught_up`): a stream whose end seqno lies in such a stretch ends
there instead of waiting for an item that never comes. For the consumer's sake a stream that
does not send prepares (`visible_only`) announces each snapshot only up to its max visible
seqno, and no snapshot at all when it holds nothing visible (kv_engine does the same for
streams without SyncReplication): the consumer then holds a whole snapshot where the stream
ends, never the front of one whose end it cannot receive.
"""

from __future__ import annotations

import dataclasses
import enum

from changefeed.checkpoint import SnapshotStart
from changefeed.protocol.dcp import StreamEndReason


class StreamState(enum.Enum):
    SNAPSHOT_PENDING = "snapshot_pending"  # the next thing sent is a snapshot marker
    IN_DISK_SNAPSHOT = "in_disk_snapshot"  # sending a backfill's snapshot
    IN_MEMORY_SNAPSHOT = "in_memory_snapshot"  # sending a checkpoint's snapshot
    ENDING = "ending"  # STREAM_END is the next (and last) thing sent
    ENDED = "ended"  # nothing more is sent; readers are released


class StreamInput(enum.Enum):
    DISK_MARKER = "disk_marker"
    MEMORY_MARKER = "memory_marker"
    ITEM = "item"
    SNAPSHOT_DONE = "snapshot_done"  # the item at snap_end was sent
    END = "end"  # end seqno reached, or the producer ends the stream
    END_SENT = "end_sent"
    CLOSE = "close"  # connection gone or stream replaced: no STREAM_END


_S, _I = StreamState, StreamInput
_LIVE = (_S.SNAPSHOT_PENDING, _S.IN_DISK_SNAPSHOT, _S.IN_MEMORY_SNAPSHOT)
TRANSITIONS: dict[tuple[StreamState, StreamInput], StreamState] = {
    **{(state, _I.DISK_MARKER): _S.IN_DISK_SNAPSHOT for state in _LIVE},
    **{(state, _I.MEMORY_MARKER): _S.IN_MEMORY_SNAPSHOT for state in _LIVE},
    (_S.IN_DISK_SNAPSHOT, _I.ITEM): _S.IN_DISK_SNAPSHOT,
    (_S.IN_MEMORY_SNAPSHOT, _I.ITEM): _S.IN_MEMORY_SNAPSHOT,
    (_S.IN_DISK_SNAPSHOT, _I.SNAPSHOT_DONE): _S.SNAPSHOT_PENDING,
    (_S.IN_MEMORY_SNAPSHOT, _I.SNAPSHOT_DONE): _S.SNAPSHOT_PENDING,
    **{(state, _I.END): _S.ENDING for state in _LIVE},
    (_S.ENDING, _I.END_SENT): _S.ENDED,
    **{(state, _I.CLOSE): _S.ENDED for state in (*_LIVE, _S.ENDING, _S.ENDED)},
}


class StreamMachine:
    """Position and state of one stream: what was sent, where its snapshot and the stream end.

    Args:
        start_seqno: the last seqno the client has; the first marker starts there.
        end_seqno: the stream ends after the snapshot holding this seqno.
        visible_only: the stream does not send SyncWrite prepares and aborts (an application
            stream): markers end at the snapshot's max visible seqno (see the module doc).
    """

    def __init__(self, start_seqno: int, end_seqno: int, *, visible_only: bool = False) -> None:
        assert start_seqno >= 0, start_seqno
        self.start_seqno = start_seqno
        self.end_seqno = end_seqno
        self.visible_only = visible_only
        self.state = StreamState.SNAPSHOT_PENDING
        # Seqno of the last item sent or passed over (read but not for this stream).
        self.last_sent_seqno = start_seqno
        self.snap_end = start_seqno  # end of the snapshot being read (not the one announced)
        self.end_reason: StreamEndReason | None = None
        self._first_marker = True
        if start_seqno >= end_seqno:
            self.end(StreamEndReason.OK)  # nothing to send (dcp-wire.md §6.2 step 11)

    def _apply(self, what: StreamInput) -> None:
        following = TRANSITIONS.get((self.state, what))
        assert following is not None, (self.state, what)
        self.state = following

    @property
    def live(self) -> bool:
        """True until the stream is ending or ended: markers and items may still be sent."""
        return self.state in _LIVE

    def marker(self, event: SnapshotStart) -> SnapshotStart | None:
        """The marker to send for `event`, or None when there is none to send: the stream is
        complete before it (the machine is ENDING), or it holds nothing this stream sends
        (`visible_only` and no visible item: its items are still read, none is sent).

        The stream's first marker starts at its start seqno (snapshot-marker.md, "Memory/Disk
        snapshot start-seqno", case 1), clamped to the snapshot's end.
        """
        assert self.live, self.state
        if event.snap_start > self.end_seqno and self.snap_end >= self.end_seqno:
            self.end(StreamEndReason.OK)
            return None
        self.snap_end = event.snap_end
        self._apply(StreamInput.DISK_MARKER if event.from_disk else StreamInput.MEMORY_MARKER)
        snap_end = event.snap_end
        if self.visible_only and event.max_visible_seqno < snap_end:
            # The items after the max visible seqno are prepares and aborts (or not held at
            # all): announced, they would leave the consumer inside a snapshot it cannot finish.
            snap_end = event.max_visible_seqno
            if snap_end < event.snap_start:
                return None  # nothing visible: no marker, as kv_engine sends none
        snap_start = self.start_seqno if self._first_marker else event.snap_start
        self._first_marker = False
        snap_start = min(snap_start, snap_end)
        if (snap_start, snap_end) == (event.snap_start, event.snap_end):
            return event  # the usual case: no copy (a marker per vbucket run when streaming live)
        return dataclasses.replace(event, snap_start=snap_start, snap_end=snap_end)

    def item(self, seqno: int) -> None:
        """An item with `seqno` is being sent; the snapshot or the stream may be complete."""
        self.items(seqno, seqno)

    def items(self, first_seqno: int, last_seqno: int) -> None:
        """A run of items from `first_seqno` to `last_seqno` (increasing, inside the snapshot;
        the reader asserts the order item by item) is being sent.

        One call per run: ITEM leaves the state as it is (see TRANSITIONS), so only the run's
        last item can change it.
        """
        assert first_seqno > self.last_sent_seqno, (first_seqno, self.last_sent_seqno)
        assert first_seqno <= last_seqno <= self.snap_end, (first_seqno, last_seqno, self.snap_end)
        self._apply(StreamInput.ITEM)
        self.last_sent_seqno = last_seqno
        if last_seqno == self.snap_end:
            self._snapshot_done()

    def caught_up(self, seqno: int) -> None:
        """The reader has nothing more now and stands at `seqno`: every seqno up to it was read.

        Seqnos between the last item and `seqno` exist in no place a reader gets them from (a
        disk snapshot's range ending at a prepare or an abort, which are not stored records).
        A stream that read up to its end seqno ends now, even inside a snapshot: the rest of a
        snapshot a replica holds only the front of (its marker's end past its high seqno) may
        never come, and the end seqno, at most that high seqno, is behind the stream.
        """
        assert self.live, self.state
        assert seqno <= max(self.snap_end, self.last_sent_seqno), (seqno, self.snap_end)
        if seqno > self.last_sent_seqno:
            self.last_sent_seqno = seqno
            if seqno == self.snap_end and self.state is not StreamState.SNAPSHOT_PENDING:
                self._snapshot_done()
        if self.last_sent_seqno >= self.end_seqno:
            self.end(StreamEndReason.OK)

    def _snapshot_done(self) -> None:
        self._apply(StreamInput.SNAPSHOT_DONE)
        if self.snap_end >= self.end_seqno:
            self.end(StreamEndReason.OK)

    def end(self, reason: StreamEndReason) -> None:
        """End the stream with `reason` (the first reason wins); STREAM_END is sent next."""
        if self.live:
            self._apply(StreamInput.END)
            self.end_reason = reason

    def end_sent(self) -> StreamEndReason:
        """STREAM_END went out; returns its reason."""
        reason = self.end_reason
        assert reason is not None, self.state
        self._apply(StreamInput.END_SENT)
        return reason

    def close(self) -> None:
        """The stream is gone without a STREAM_END (connection closed, stream removed)."""
        self._apply(StreamInput.CLOSE)
