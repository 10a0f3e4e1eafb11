"""`Stream`: one vbucket's DCP stream on one connection, from accept to STREAM_END.

It pulls runs of events from a `StreamReader` (memory or disk: the reader decides), lets the
`StreamMachine` judge each one (snapshot boundaries, end seqno, end reasons) and hands what is to
be sent to its `StreamEncoder`. A run read ahead waits in a small buffer when the byte budget of
one `fill` is used up, so reading in runs never skips or repeats an event.
"""

from __future__ import annotations

from typing import cast

from changefeed import limits
from changefeed.checkpoint import Item, SnapshotStart, StreamReader
from changefeed.producer.encoder import StreamEncoder
from changefeed.producer.stream_machine import StreamMachine, StreamState
from changefeed.protocol.dcp import StreamEndReason


class Stream:
    """What `fill` sends for one stream; called by the producer's round-robin pump.

    Args:
        vb: the vbucket.
        reader: where events come from; closed when the stream ends.
        machine: the stream's state (start and end seqno).
        encoder: how events become bytes.
        purge_seqno: put in V2.2 snapshot markers.
    """

    def __init__(
        self,
        vb: int,
        *,
        reader: StreamReader,
        machine: StreamMachine,
        encoder: StreamEncoder,
        purge_seqno: int = 0,
    ) -> None:
        self.vb = vb
        self.reader = reader
        self.machine = machine
        self.encoder = encoder
        self.purge_seqno = purge_seqno
        self.items_sent = 0
        self.holds_backfill_slot = False  # managed by the producer (backfill_slots.py)
        # Events read but not sent yet: a run of at most STREAM_RUN_EVENTS_MAX, consumed from
        # index _next (a list and an index: cheaper per item than a deque's popleft).
        self._ahead: list[Item | SnapshotStart] = []
        self._next = 0

    @property
    def state(self) -> StreamState:
        return self.machine.state

    @property
    def ended(self) -> bool:
        return self.machine.state is StreamState.ENDED

    @property
    def needs_disk(self) -> bool:
        """True while the stream reads (or is about to read) a disk backfill."""
        return self.machine.live and not self.reader.from_memory

    @property
    def last_sent_seqno(self) -> int:
        return self.machine.last_sent_seqno

    @property
    def ready(self) -> bool:
        """True when `fill` would produce something now."""
        if self.machine.state is StreamState.ENDING:
            return True
        return self.machine.live and (self._next < len(self._ahead) or self.reader.has_next)

    def end(self, reason: StreamEndReason) -> None:
        """Ask the stream to end; the STREAM_END is sent by the next `fill`."""
        self.machine.end(reason)

    def fill(self, out: list[bytes], bytes_max: int) -> int:
        """Append output to `out` until `bytes_max` bytes, caught up, or ended.

        Returns:
            Bytes appended.
        """
        written = 0
        machine = self.machine
        while written < bytes_max and machine.live:  # bounded by bytes_max and what is queued
            if self._next == len(self._ahead):
                # No further ahead than the budget could send (+1: the overshoot message).
                fits = (bytes_max - written) // self.encoder.event_bytes_min + 1
                self._ahead = self.reader.read(min(limits.STREAM_RUN_EVENTS_MAX, fits))
                self._next = 0
                if not self._ahead:
                    break  # caught up
            written += self._send_run(out, bytes_max - written)
        if machine.state is StreamState.ENDING:
            written += self.encoder.stream_end(out, machine.end_sent())
            self.close()
        return written

    def close(self) -> None:
        """Release the reader (cursor, backfill scan); idempotent."""
        if not self.ended:
            self.machine.close()
        self._ahead = []
        self._next = 0
        self.reader.close()

    def _send_run(self, out: list[bytes], bytes_max: int) -> int:
        """Send a marker, or the run of items at the front of the buffer that fits."""
        ahead, start = self._ahead, self._next
        first = ahead[start]
        if isinstance(first, SnapshotStart):
            self._next = start + 1
            marker = self.machine.marker(first)
            if marker is None:
                return 0  # the stream is complete: the machine is ENDING
            return self.encoder.snapshot_marker(out, marker, self.purge_seqno)
        snap_end = self.machine.snap_end
        stop = start
        for event in ahead[start:]:  # bounded by the run read
            if not isinstance(event, Item):
                break
            stop += 1
            if event.seqno == snap_end:
                break  # the snapshot (and maybe the stream) completes here
        run = cast(list[Item], ahead[start:stop])  # items only: checked by the loop above
        count, written = self.encoder.items(out, run, bytes_max)
        assert 0 < count <= len(run), (count, len(run))
        self.machine.items(run[0].seqno, run[count - 1].seqno)
        self._next = start + count
        self.items_sent += count
        return written
