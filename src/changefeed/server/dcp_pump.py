"""The DCP side of one server connection: the pump task that writes stream frames, noops and
the idle timeout.

Joins the sans-IO `DcpProducer` to an output sink. The pump writes frames while the sink accepts
them (`writable` cleared by `pause_writing`: backpressure) and the flow-control window has room,
then sleeps until something can change that: an item queued in a streamed vbucket (checkpoint
wakeup), a buffer ack, a new stream, or the noop tick. It is given everything it uses at
construction and reports its own stats; it knows nothing of the connection or node around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from changefeed import limits
from changefeed.checkpoint import Wakeup
from changefeed.producer.producer import DcpProducer
from changefeed.producer.stream_request import Accepted, Refused, RollbackTo
from changefeed.protocol.dcp import StreamRequest
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Opcode
from changefeed.server.rate_limit import ByteRate
from changefeed.server.replication import ReplicationTracker

log = logging.getLogger("changefeed.dcp")

TICK_S = 0.1  # noop and idle checks (kv_engine connection_manager_interval, dcp-wire.md §8.2)


class FrameSink(Protocol):
    """Where the pump writes: a connection's transport, with its backpressure flag."""

    writable: asyncio.Event  # cleared while the transport's buffer is over its high-water mark

    def write_frames(self, frames: list[bytes]) -> None:
        """Write `frames` in order (one writelines)."""
        ...

    def close(self) -> None:
        """Close the connection (the pump is closed by the connection when it is gone)."""
        ...


class DcpPump:
    """Runs one producer connection's output.

    Args:
        producer: the connection's sans-IO producer.
        sink: where frames go.
        wakeup_of: the checkpoint wakeup of a vbucket, to sleep on while streams are caught up.
        idle_timeout_s: with noops on, a peer silent this long is disconnected.
        disk_rate: when given, bytes sent while a stream reads from disk are charged to it and
            the pump waits when it is spent (replica catch-up, rate_limit.py).
        replica: a replica connection (DCP_OPEN role REPLICA): the replica node's name and the
            active's tracker, which the pump tells of each stream opened, acknowledged and
            closed (the tracker tells the durable-write monitor). None for applications.
    """

    def __init__(
        self,
        producer: DcpProducer,
        *,
        sink: FrameSink,
        wakeup_of: Callable[[int], Wakeup],
        idle_timeout_s: float,
        disk_rate: ByteRate | None = None,
        replica: tuple[str, ReplicationTracker] | None = None,
    ) -> None:
        assert idle_timeout_s > 0, idle_timeout_s
        self._disk_rate = disk_rate
        self.replica_name: str | None = None if replica is None else replica[0]
        self._tracker: ReplicationTracker | None = None if replica is None else replica[1]
        self.producer = producer
        self._sink = sink
        self._wakeup_of = wakeup_of
        self._idle_timeout_s = idle_timeout_s
        self._work = asyncio.Event()
        self._wakeups: dict[int, Wakeup] = {}
        self._stream_ids: dict[int, int] = {}  # the tracker's id of each replica stream opened here
        producer.backfill_slots.add_waiter(self.wake)  # a stream may wait for a backfill slot
        self._task = asyncio.get_running_loop().create_task(self._pump_loop())

    @property
    def name(self) -> str:
        return self.producer.name

    def wake(self) -> None:
        self._work.set()

    def on_received(self) -> None:
        self.producer.on_received()

    def on_response(self, frame: Frame) -> None:
        self.producer.on_received()
        if frame.opcode == Opcode.DCP_NOOP:
            self.producer.on_noop_response(frame.opaque)

    def stream_request(self, request: StreamRequest) -> Accepted | RollbackTo | Refused:
        """Let the producer decide; on acceptance, sleep on the vbucket's wakeup too."""
        outcome = self.producer.stream_request(request)
        vb = request.vbucket
        if isinstance(outcome, RollbackTo):
            log.info("%s vb %d: rollback to %d (%s)", self.name, vb, outcome.seqno, outcome.reason)
        if isinstance(outcome, Accepted) and self._tracker is not None:
            assert self.replica_name is not None
            self._stream_ids[vb] = self._tracker.stream_opened(
                vb, self.replica_name, outcome.start_seqno
            )
        if isinstance(outcome, Accepted):
            if vb not in self._wakeups:
                wakeup = self._wakeup_of(vb)
                wakeup.add_callback(self.wake)
                self._wakeups[vb] = wakeup
            self.wake()
        return outcome

    def disconnect(self) -> None:
        """Close the connection this pump writes to (a newer connection took its name)."""
        self._sink.close()

    def acknowledged(self, vb: int, received: int, persisted: int) -> bool:
        """DCP_SEQNO_ACKNOWLEDGED from the replica; False on an application connection."""
        if self._tracker is None:
            return False
        assert self.replica_name is not None
        self._tracker.acknowledged(vb, self.replica_name, received, persisted)
        return True

    def close(self) -> None:
        """The connection is gone: stop the task, release every stream and wakeup (a
        replica's streams are closed at its tracker first)."""
        if self._tracker is not None:
            assert self.replica_name is not None
            for vb in list(self.producer.streams):
                self._tracker.stream_closed(vb, self.replica_name, self._stream_ids.get(vb))
        self._task.cancel()
        for wakeup in self._wakeups.values():
            with contextlib.suppress(ValueError):
                wakeup.remove_callback(self.wake)
        self._wakeups.clear()
        self.producer.backfill_slots.remove_waiter(self.wake)
        self.producer.close()

    async def _pump_loop(self) -> None:
        try:
            while True:  # the connection's DCP loop; ends with the connection
                await self._sink.writable.wait()
                self._work.clear()
                out: list[bytes] = []
                bytes_max = limits.PUMP_BYTES_MAX
                rate = self._disk_rate
                charged = rate is not None and self.producer.reading_disk
                if rate is not None and charged:
                    bytes_max = min(bytes_max, rate.available())
                    if bytes_max == 0:
                        await asyncio.sleep(rate.wait_s())
                        continue
                sent = self.producer.pump(out, bytes_max)
                if rate is not None and charged:
                    rate.spend(sent)
                noop = self.producer.due_noop()
                if noop is not None:
                    out.append(noop)
                if out:
                    self._sink.write_frames(out)
                if self._idle_timed_out():
                    return
                if out and self.producer.ready:
                    await asyncio.sleep(0)  # let reads (acks) in between large writes
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), TICK_S)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("DCP pump of %s failed; closing the connection", self.name)
            self._sink.close()

    def _idle_timed_out(self) -> bool:
        limit = self._idle_timeout_s
        if self.producer.noop_enabled and self.producer.idle_for_s() > limit:
            log.warning("%s idle for %.0f s; disconnecting", self.name, limit)
            self._sink.close()
            return True
        return False
