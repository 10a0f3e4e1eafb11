"""`Stream`: one vbucket's DCP stream on one connection, from accept to STREAM_END.

It pulls runs from a `StreamReader` (memory or disk: the reader decides): snapshot markers, runs
of checkpoint items and runs of stored records, all in seqno order and each run inside one
snapshot. The `StreamMachine` judges each marker and each run by its first and last seqno
(snapshot boundaries, end seqno, end reasons), and the `StreamEncoder` frames a run at once. What
was read ahead waits in a small buffer (a run may be cut where the byte budget of one `fill` ends)
so reading in runs never skips or repeats an item.
"""

from __future__ import annotations

from changefeed import limits
from changefeed.checkpoint import SnapshotStart, StreamReader
from changefeed.checkpoint.backfill import StoredRun
from changefeed.checkpoint.reader import Run
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
        # Runs read but not sent yet, of at most STREAM_RUN_EVENTS_MAX events in all: the run at
        # index _next is being sent, _sent of its items already were.
        self._ahead: list[Run] = []
        self._next = 0
        self._sent = 0

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
        machine = self.machine
        if machine.state is StreamState.ENDING:
            return True
        if not machine.live:
            return False
        # Read up to its end seqno but inside a snapshot: the next `fill` ends it if the reader
        # has nothing more (`StreamMachine.caught_up`).
        at_end = machine.last_sent_seqno >= machine.end_seqno
        return at_end or self._next < len(self._ahead) or self.reader.has_next

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
                budget = bytes_max - written
                fits = budget // self.encoder.event_bytes_min + 1
                self._ahead = self.reader.read_runs(min(limits.STREAM_RUN_EVENTS_MAX, fits), budget)
                self._next = 0
                self._sent = 0
                if not self._ahead:
                    # Caught up, all read was sent: the reader's position may be past the last
                    # item (a disk snapshot ending at a prepare or an abort), maybe at the end.
                    machine.caught_up(self.reader.last_seqno)
                    break
            written += self._send_run(out, bytes_max - written)
        if machine.state is StreamState.ENDING:
            written += self.encoder.stream_end(out, machine.end_sent())
            self.close()
        return written

    def close(self, *, retain_cursor: bool = False) -> None:
        """Release the reader (backfill scan, and the cursor unless `retain_cursor`: see
        `StreamReader.retain`); idempotent."""
        if not self.ended:
            self.machine.close()
        self._ahead = []
        self._next = 0
        self._sent = 0
        if retain_cursor:
            self.reader.retain()
        else:
            self.reader.close()

    def _send_run(self, out: list[bytes], bytes_max: int) -> int:
        """Send the marker at the front of the buffer, or what fits of the run there."""
        run = self._ahead[self._next]
        if isinstance(run, SnapshotStart):
            self._next += 1
            marker = self.machine.marker(run)
            if marker is None:
                return 0  # the stream is complete (ENDING), or the snapshot has nothing visible
            return self.encoder.snapshot_marker(out, marker, self.purge_seqno)
        sent = self._sent
        if isinstance(run, StoredRun):
            records = run.records[sent:] if sent else run.records
            count, written = self.encoder.stored(out, records, bytes_max)
            first_seqno, last_seqno = run.seqno(sent), run.seqno(sent + count - 1)
        else:
            items = run[sent:] if sent else run
            count, written = self.encoder.items(out, items, bytes_max)
            first_seqno, last_seqno = items[0].seqno, items[count - 1].seqno
        assert 0 < count <= len(run) - sent, (count, len(run), sent)
        # A run lies inside one snapshot (the reader splits at markers), so only its last item
        # can be the snapshot's end, and nothing of the run follows that.
        self.machine.items(first_seqno, last_seqno)
        sent += count
        if sent == len(run):
            self._next += 1
            sent = 0
        self._sent = sent
        self.items_sent += count
        return written
